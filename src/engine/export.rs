//! Consolidated safetensors export: live ([`Engine::export_safetensors`](super::Engine::export_safetensors)),
//! at save time (`stage3_gather_16bit_weights_on_model_save`) and offline
//! from a checkpoint ([`export_checkpoint`], the `zero_to_safetensors`
//! tool, like DeepSpeed's `zero_to_fp32.py`). The file, its tensor names
//! and the writer are `crate::format::safetensors`; this module supplies
//! the values unit by unit (live: one unit gathered at a time; offline: a
//! chunk of [`CHUNK`] elements at a time read from the rank files).
//!
//! The values are the fp32 master: `F32` exactly, `BF16`/`F16` rounded to
//! nearest even, which are the engine's parameters when it trains in that
//! dtype (it always sets them to the cast master).

use std::path::{Path, PathBuf};

use zero_comm::agree::first_failure;
use zero_core::partition::{PartitionPlan, UnitLayout};

use super::backend::{EngineBackend, EngineComm};
use super::state::StateIo;
use crate::format::checkpoint::{open_saved, Reader, StateArray};
use crate::format::safetensors::{ExportDtype, SafetensorsWriter};
use crate::{Error, Result};

/// Elements read from the rank files at once by [`export_checkpoint`].
const CHUNK: usize = 1 << 20;

fn err(path: &Path, what: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// Writes the fp32 master of the checkpoint at `checkpoint` (a checkpoint
/// directory, or a root whose `latest` names one) to the safetensors file
/// `out` as `dtype`, and returns the checkpoint directory it read. Works
/// without an engine or a communicator, whatever world size, stage and
/// offload mode saved it.
///
/// Memory is bounded: each unit's master is read from the rank files a
/// chunk of 2²⁰ elements at a time, byte ranges only, verifying the CRC32
/// of every block read, and streamed to `out` (written to `out.tmp`,
/// fsynced, renamed). The file equals, byte for byte, what
/// [`Engine::export_safetensors`](super::Engine::export_safetensors) writes for the saved state. Errors name
/// the file: a missing directory or manifest, a malformed or foreign
/// manifest, a missing, truncated or corrupted rank file, an output that
/// cannot be written. Frozen tensors come from the checkpoint's
/// `frozen.safetensors` (`EngineBuilder::checkpoint_frozen`); without it a
/// model with frozen tensors is an error naming one.
pub fn export_checkpoint(checkpoint: &Path, out: &Path, dtype: ExportDtype) -> Result<PathBuf> {
    if !checkpoint.exists() {
        return Err(err(checkpoint, "no such checkpoint directory"));
    }
    if !checkpoint.is_dir() {
        return Err(err(
            checkpoint,
            "not a directory (give a checkpoint directory or a checkpoint root)",
        ));
    }
    let (dir, manifest, plan) = open_saved(checkpoint)?;
    // Frozen tensors: from the checkpoint's frozen file, if it has one.
    let frozen = match (&manifest.frozen, plan.frozen_numel()) {
        (_, 0) => None,
        (Some(entry), _) => Some(entry),
        (None, _) => {
            let (u, t) = plan
                .units()
                .iter()
                .find_map(|u| u.tensors.iter().find(|t| !t.trainable).map(|t| (u, t)))
                .expect("a frozen tensor");
            return Err(err(
                checkpoint,
                format!(
                    "tensor `{}` of unit `{}` is frozen and the checkpoint holds the trainable \
                     state only (save with EngineBuilder::checkpoint_frozen(true), or export \
                     from the engine with Engine::export_safetensors)",
                    t.name, u.name
                ),
            ));
        }
    };
    let mut writer = SafetensorsWriter::create(out, plan.units(), dtype)?;
    let mut reader = Reader::new(&dir, &manifest, &plan);
    let mut chunk = vec![0f32; CHUNK];
    // Each unit's master, then its frozen tensors: the frozen file is read
    // unit by unit as the walk reaches each unit that has some.
    let mut next = 0;
    if let Some(entry) = frozen {
        let mut failed = None;
        let walk = crate::format::checkpoint::read_frozen_file(&dir, entry, &plan, |u, values| {
            let r = write_masters(&mut reader, &mut writer, &plan, next..u + 1, &mut chunk)
                .and_then(|()| writer.write(values));
            next = u + 1;
            r.map_err(|e| {
                let what = e.to_string();
                failed = Some(e);
                what
            })
        });
        if let Some(e) = failed {
            return Err(e);
        }
        walk.map_err(|e| err(&dir, e))?;
    }
    write_masters(
        &mut reader,
        &mut writer,
        &plan,
        next..plan.units().len(),
        &mut chunk,
    )?;
    writer.finish()?;
    Ok(dir)
}

/// Streams the masters of `units` from `reader` to `writer`, `chunk`
/// elements at a time.
fn write_masters(
    reader: &mut Reader<'_>,
    writer: &mut SafetensorsWriter,
    plan: &PartitionPlan,
    units: std::ops::Range<usize>,
    chunk: &mut [f32],
) -> Result<()> {
    for u in units {
        let numel = plan.units()[u].numel;
        let mut at = 0;
        while at < numel {
            let k = (numel - at).min(chunk.len());
            reader.read_into(u, StateArray::Master, at..at + k, &mut chunk[..k])?;
            writer.write(&chunk[..k])?;
            at += k;
        }
    }
    Ok(())
}

/// The live export ([`Engine::export_safetensors`](super::Engine::export_safetensors)):
/// rank 0 writes every unit's fp32 master (and frozen tensors'
/// parameters) to `path` as `dtype`, a collective; rank 0 gets the file's
/// length and CRC32.
pub(super) fn export_live<C: EngineComm<B>, B: EngineBackend>(
    io: &mut StateIo<'_, C, B>,
    path: &Path,
    dtype: ExportDtype,
) -> Result<Option<(u64, u32)>> {
    let layouts = io.cx.plan.units().to_vec();
    write_safetensors(
        io,
        path,
        &layouts,
        dtype,
        "export_safetensors",
        |io, i, out| {
            let master = io.master(i)?;
            out.extend_from_slice(&master[..io.units[i].layout.numel]);
            // Frozen tensors have no master: their parameters.
            io.extend_frozen(i, out)
        },
    )
}

/// Rank 0 writes the safetensors file `path` of `layouts` (in `dtype`)
/// with the values `values(io, unit, out)` appends for each of the
/// engine's units in turn (a collective: every rank computes every
/// unit's values, so that the collectives in them stay matched, even
/// after a failed write on rank 0). Rank 0 gets the file's length and
/// CRC32; `call` names the caller in errors.
pub(super) fn write_safetensors<C: EngineComm<B>, B: EngineBackend>(
    io: &mut StateIo<'_, C, B>,
    path: &Path,
    layouts: &[UnitLayout],
    dtype: ExportDtype,
    call: &str,
    mut values: impl FnMut(&mut StateIo<'_, C, B>, usize, &mut Vec<f32>) -> Result<()>,
) -> Result<Option<(u64, u32)>> {
    let rank = io.cx.comm.rank();
    let usage = |what: String| Error::Usage { rank, what };
    // Round 1: rank 0 creates the file.
    let created = if rank == 0 {
        SafetensorsWriter::create(path, layouts, dtype).map(Some)
    } else {
        Ok(None)
    };
    let failed = first_failure(&io.cx.comm, created.as_ref().err())?;
    let mut writer = created?;
    if let Some((_, why)) = failed {
        return Err(usage(format!(
            "{call}: rank 0 could not create {}: {why}",
            path.display()
        )));
    }
    let mut failed = None;
    let mut unit = Vec::new();
    for i in 0..io.units.len() {
        unit.clear();
        values(io, i, &mut unit)?;
        if let (Some(w), None, false) = (writer.as_mut(), &failed, unit.is_empty()) {
            failed = w.write(&unit).err();
        }
    }
    let done = match (writer, failed) {
        (Some(_), Some(e)) => Err(e),
        (Some(w), None) => w.finish().map(Some),
        (None, _) => Ok(None),
    };
    let failed = first_failure(&io.cx.comm, done.as_ref().err())?;
    let done = done?;
    if let Some((_, why)) = failed {
        return Err(usage(format!(
            "{call}: rank 0 could not write {}: {why}",
            path.display()
        )));
    }
    Ok(done)
}
