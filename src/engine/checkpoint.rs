//! The engine's sharded checkpoints: save, exact resume, reshard on load.
//! The file format (manifest, rank files, CRC blocks, the atomic publish)
//! is `crate::format::checkpoint`; this module walks the engine's state
//! and calls it.
//!
//! # Save
//!
//! [`Engine::save_checkpoint`](super::Engine::save_checkpoint) writes `root/step{global_steps:08}/`, a
//! collective in three rounds:
//!
//! ```text
//!  rank 0: mkdir root/.tmp-stepN-<id>        ── exchange (id) ──
//!  all:    write + fsync rankR.bin            ── exchange (CRCs) ──
//!  all:    gather unit by unit; rank 0 writes model.safetensors (optional)
//!  rank 0: manifest.json + fsync, fsync dir, rename → root/stepN, fsync root,
//!          latest.tmp + fsync → rename latest, fsync root, prune keep_last
//!                                             ── exchange (verdict) ──
//! ```
//!
//! Each rank writes its `E_r(u)` of every unit, whatever the stage (a
//! stage-0 rank holds the whole state but writes only its part), from its
//! host buffers or, offloaded, piece by piece through the offload store.
//! Parameters are not stored: in this engine the parameter in the
//! training dtype is always `P::from_f32(master)` (initialised from the
//! same f32 value, rewritten from the new master by every update), so
//! load casts the master.
//!
//! # Load and reshard
//!
//! The saving plan is rebuilt from the manifest. Each rank reads only the
//! byte ranges of the saved files that hold the elements it needs now: its
//! state range (the whole unit in stage 0, its shard from stage 1 on),
//! whose master it also casts into its parameters. A stage 1–2 rank holds
//! the whole unit's parameters but casts only its range: once every rank
//! has loaded, the parameters are all-gathered as after an optimizer step.
//! Reads go whole blocks straight into the rank's store (host buffers, the
//! offloaded tiles, the parameter home) and the ends of each range through
//! the reader's window, sequentially (the kernel reads ahead), verifying
//! the CRC of every block read. Without parameter offload the files are
//! read one after the other, each front to back (unit by unit, master, m,
//! v), so the window serves the block two consecutive ranges share and no
//! block is read twice
//! ([`EngineStats::checkpoint_read_bytes`](super::EngineStats) counts the
//! bytes). With optimizer offload the state is read tile by tile (each
//! piece's master also cast into the parameters), every array in turn, so
//! a block two ranges of one file share is read again where another file
//! was read in between. With parameter offload the parameters' homes are
//! written unit by unit, reading the master a second time when the
//! optimizer state is offloaded too. What only this rank reads leaves the
//! page cache once read.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use zero_comm::agree::{exchange_u64, first_failure};
use zero_core::backend::HostAccess;
use zero_core::partition::{PartitionPlan, UnitLayout, UnitSpec};
use zero_core::{bf16, convert, f16, DType, Element};

use super::backend::{EngineBackend, EngineComm};
use super::builder::EngineBuilder;
use super::devbuf::DevBuf;
use super::export::{export_live, write_safetensors};
use super::init::Init;
use super::optimizer::{commit_moments, Moments, OptimizerShard};
use super::param_offload::ParamOffload;
use super::progress::Progress;
use super::reducer::GradReducer;
use super::reducer::GradState;
use super::saving::SaveHow;
use super::state::StateIo;
use super::unit::Unit;
use crate::agree::agree_on_setup;
use crate::format::checkpoint::{
    check_files, check_units, frozen_layouts, prepare, publish, rank_file, read_frozen_file,
    read_manifest, step_dir_name, tmp_dir, FileEntry, Manifest, ModelFileEntry, RankFileWriter,
    Reader, SavedRun, StateArray, FROZEN_FILE, MANIFEST_FILE, MODEL_FILE,
};
use crate::format::safetensors::ExportDtype;
use crate::{Error, Result};

/// Elements of the master outside the state range converted at once on
/// load before the cast to the parameter dtype.
const CAST_CHUNK: usize = 1 << 16;

/// Whether a checkpoint may be saved now: at an optimizer-step boundary
/// (no micro-batch of `progress`'s window done), no gradient buffer out,
/// no reduction in flight (`Err`: why not).
pub(super) fn at_boundary<B: HostAccess>(
    progress: &Progress,
    reducer: &GradReducer<B>,
    units: &[Unit<B>],
) -> std::result::Result<(), String> {
    let (micro, ga) = (progress.micro(), progress.ga());
    if micro != 0 {
        return Err(format!(
            "save_checkpoint: in the middle of gradient accumulation ({micro} of {ga} \
             micro-batches done); save after the step() that ends the accumulation window"
        ));
    }
    if let Some(i) = reducer.find(GradState::Lent) {
        return Err(format!(
            "save_checkpoint: the gradient buffer of unit `{}` is out; hand it back and call \
             step() first",
            units[i].layout.name
        ));
    }
    if let Some(i) = reducer.find(GradState::Ready) {
        return Err(format!(
            "save_checkpoint: a micro-batch is in progress (unit `{}` is grad_ready); call \
             step() first",
            units[i].layout.name
        ));
    }
    if !reducer.is_idle() {
        return Err("save_checkpoint: gradient reductions are in flight; call step() first".into());
    }
    Ok(())
}

/// Saves the checkpoint of the run `run` (its counters, config and the
/// trainer's `client_state`) to `root/step{N:08}`, `N` its global steps,
/// in the three rounds drawn in the module doc (a collective); returns
/// the path and rank 0's warnings (old checkpoints it could not prune).
pub(super) fn save<C: EngineComm<B>, B: EngineBackend>(
    io: &mut StateIo<'_, C, B>,
    root: &Path,
    run: SavedRun,
    how: SaveHow,
) -> Result<(PathBuf, Vec<String>)> {
    let (rank, world) = (io.cx.comm.rank(), io.cx.comm.world_size());
    let usage = |what: String| Error::Usage { rank, what };
    let name = step_dir_name(run.global_steps);
    let dest = root.join(&name);
    // Round 1: rank 0 makes the temporary directory.
    let prep = if rank == 0 {
        prepare(root, &dest, &name)
    } else {
        Ok(0)
    };
    let id = *prep.as_ref().unwrap_or(&0);
    let words = exchange_u64(&io.cx.comm, &[u64::from(prep.is_err()), id])?;
    if words[0][0] != 0 {
        let why = first_failure(&io.cx.comm, prep.as_ref().err())?;
        prep?;
        return Err(usage(format!(
            "save_checkpoint: rank 0 could not create the checkpoint directory under {}: {}",
            root.display(),
            why.map_or_else(String::new, |(_, w)| w)
        )));
    }
    let tmp = tmp_dir(root, &name, words[0][1]);
    // Round 2: every rank writes its file; rank 0 learns the CRCs.
    let written = {
        let _span = io.cx.tracer.span(rank, "checkpoint write", "checkpoint");
        let path = tmp.join(rank_file(rank));
        let bases = state_bases(io.units, io.cx.stage, rank);
        write_rank_file(
            &path,
            io.cx.plan.units(),
            rank,
            &bases,
            io.opt,
            &io.cx.backend,
        )
    };
    let (bytes, crcs) = match &written {
        Ok((b, c)) => (*b, c.clone()),
        Err(_) => (0, Vec::new()),
    };
    let head = exchange_u64(
        &io.cx.comm,
        &[u64::from(written.is_err()), bytes, crcs.len() as u64],
    )?;
    let max = head.iter().map(|w| w[2] as usize).max().unwrap_or(0).max(1);
    let mut mine: Vec<u64> = crcs.iter().map(|&c| u64::from(c)).collect();
    mine.resize(max, 0);
    let all = exchange_u64(&io.cx.comm, &mine)?;
    if head.iter().any(|w| w[0] != 0) {
        // Every rank knows: share the first failure's text.
        let failed = first_failure(&io.cx.comm, written.as_ref().err())?;
        if rank == 0 {
            let _ = fs::remove_dir_all(&tmp);
        }
        written?;
        let (bad, why) = failed.expect("a rank failed");
        return Err(usage(format!(
            "save_checkpoint: rank {bad} could not write its rank file: {why}; no checkpoint \
             was written"
        )));
    }
    // On an error of a collective below, rank 0 removes the temporary
    // directory.
    let or_clean = |r: Result<Option<ModelFileEntry>>| {
        if r.is_err() && rank == 0 {
            let _ = fs::remove_dir_all(&tmp);
        }
        r
    };
    // `stage3_gather_16bit_weights_on_model_save`: the consolidated
    // weights in the parameter dtype, inside the temporary directory so
    // that the rename publishes them with the rest (a collective).
    let model = if how.model {
        let dtype = ExportDtype::of(io.cx.pdt);
        let written = export_live(io, &tmp.join(MODEL_FILE), dtype);
        or_clean(written.map(|w| w.map(|(bytes, crc32)| ModelFileEntry::new(dtype, bytes, crc32))))?
    } else {
        None
    };
    // `EngineBuilder::checkpoint_frozen`: the frozen tensors too (a
    // collective: sharded frozen segments are gathered unit by unit).
    let frozen = if how.frozen && io.cx.plan.frozen_numel() > 0 {
        or_clean(write_frozen(io, &tmp.join(FROZEN_FILE)))?
    } else {
        None
    };
    // Round 3: rank 0 writes the manifest and publishes the checkpoint.
    let done = if rank == 0 {
        let files = (0..world)
            .map(|r| {
                let crcs = all[r][..head[r][2] as usize].iter().map(|&c| c as u32);
                FileEntry::rank(r, head[r][1], crcs.collect())
            })
            .collect();
        let mut manifest = Manifest::new(run, io.cx.plan.units(), files, model);
        manifest.frozen = frozen;
        let r = publish(root, &tmp, &dest, &name, &manifest, how.keep_last);
        if r.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        r
    } else {
        Ok(Vec::new())
    };
    let failed = first_failure(&io.cx.comm, done.as_ref().err())?;
    let warnings = done?;
    if let Some((_, why)) = failed {
        return Err(usage(format!(
            "save_checkpoint: rank 0 could not publish {}: {why}",
            dest.display()
        )));
    }
    Ok((dest, warnings))
}

/// Writes every frozen tensor to `path` (rank 0) in the parameter
/// dtype, unit by unit: a collective. Rank 0 gets the file's entry.
fn write_frozen<C: EngineComm<B>, B: EngineBackend>(
    io: &mut StateIo<'_, C, B>,
    path: &Path,
) -> Result<Option<ModelFileEntry>> {
    let layouts = frozen_layouts(&io.cx.plan)?;
    let dtype = ExportDtype::of(io.cx.pdt);
    let done = write_safetensors(
        io,
        path,
        &layouts,
        dtype,
        "save_checkpoint",
        |io, i, out| io.extend_frozen(i, out),
    )?;
    Ok(done.map(|(bytes, crc)| ModelFileEntry::frozen(dtype, bytes, crc)))
}

/// Start of each unit's state range, in unit coordinates: 0 in stage
/// 0 (the whole unit), the rank's shard from stage 1 on.
fn state_bases<B: HostAccess>(units: &[Unit<B>], stage: u8, rank: usize) -> Vec<usize> {
    let rank = if stage == 0 { 0 } else { rank };
    units.iter().map(|u| rank * u.layout.shard_len).collect()
}

/// A checkpoint found and checked against the registered units, that
/// every rank agreed on.
pub(super) struct Opened {
    pub(super) dir: PathBuf,
    pub(super) manifest: Manifest,
    /// The saving plan.
    pub(super) saved: PartitionPlan,
}

/// Finds the checkpoint at `path` (a checkpoint directory or a root whose
/// `latest` names one) and checks it against the units registered with
/// `builder` (a collective: every rank learns every rank's verdict), and
/// sets the builder up for a load: the trainable tensors' registered
/// initial values are not computed (the load overwrites them).
pub(super) fn open<C: EngineComm<B>, B: EngineBackend>(
    builder: &mut EngineBuilder<C, B>,
    path: &Path,
) -> Result<Opened> {
    let read = read_manifest(path).and_then(|(dir, m)| {
        let registered: Vec<&UnitSpec> = builder.s.specs.iter().map(|(s, _)| s).collect();
        let plan = check_units(&dir.join(MANIFEST_FILE), &m, &registered)?;
        check_files(&dir, &m, &plan)?;
        Ok((dir, m, plan))
    });
    let (dir, manifest, saved) = agree_on_setup(
        builder.comm(),
        read,
        "checkpoint (its manifest.json and rank files",
    )?;
    // The load overwrites every real element of the master and the
    // trainable parameters (padding is zero either way) and m, v start
    // at zero: the build need not compute their registered initial
    // values. Frozen tensors are not in the checkpoint: they keep the
    // values the trainer registered.
    for (spec, inits) in &mut builder.s.specs {
        for (t, init) in spec.tensors.iter().zip(inits.iter_mut()) {
            if t.trainable {
                *init = Init::Zeros;
            }
        }
    }
    builder.s.for_load = true;
    Ok(Opened {
        dir,
        manifest,
        saved,
    })
}

/// Reads this rank's part of the checkpoint `o` into its state and
/// parameters, then the frozen tensors if the checkpoint holds them
/// (else the registration's stay): a collective, every rank learns
/// whether every rank loaded its part. Returns the bytes read from the
/// rank files.
pub(super) fn load<C: EngineComm<B>, B: EngineBackend>(
    io: &mut StateIo<'_, C, B>,
    o: &Opened,
) -> Result<u64> {
    let rank = io.cx.comm.rank();
    let loaded = {
        let _span = io.cx.tracer.span(rank, "checkpoint load", "checkpoint");
        let mut reader = Reader::new(&o.dir, &o.manifest, &o.saved);
        let bases = state_bases(io.units, io.cx.stage, rank);
        read_state(
            &mut reader,
            &o.saved,
            (&mut io.units[..], &mut *io.opt, io.poff.as_deref_mut()),
            &io.cx.backend,
            (io.cx.stage, rank, io.cx.pdt),
            &bases,
        )
        .map(|()| reader.bytes_read())
    };
    let failed = first_failure(&io.cx.comm, loaded.as_ref().err())?;
    let bytes = loaded?;
    if let Some((bad, why)) = failed {
        return Err(Error::Usage {
            rank,
            what: format!(
                "load_checkpoint({}): rank {bad} could not load its part: {why}",
                o.dir.display()
            ),
        });
    }
    if let Some(entry) = &o.manifest.frozen {
        let read = read_frozen(io, &o.dir, entry);
        let failed = first_failure(&io.cx.comm, read.as_ref().err())?;
        read?;
        if let Some((bad, why)) = failed {
            return Err(Error::Usage {
                rank,
                what: format!(
                    "load_checkpoint({}): rank {bad} could not read the frozen tensors: {why}",
                    o.dir.display()
                ),
            });
        }
    }
    Ok(bytes)
}

/// Reads the frozen tensors of a checkpoint (`entry`, in `dir`) into
/// this engine's frozen segments (this rank's part of each).
fn read_frozen<C: EngineComm<B>, B: EngineBackend>(
    io: &mut StateIo<'_, C, B>,
    dir: &Path,
    entry: &ModelFileEntry,
) -> Result<()> {
    let plan = io.cx.plan.clone();
    // An engine error inside the walk, kept as it is.
    let mut failed = None;
    let read = read_frozen_file(dir, entry, &plan, |i, v| {
        io.set_frozen(i, v).map_err(|e| {
            let what = e.to_string();
            failed = Some(e);
            what
        })
    });
    if let Some(e) = failed {
        return Err(e);
    }
    read.map_err(|what| Error::Usage {
        rank: io.cx.comm.rank(),
        what: format!("load_checkpoint: {what}"),
    })
}

/// Writes and fsyncs rank `rank`'s file at `path` (the plan's units
/// `layouts`) from its state: the offloaded store, piece by piece, or
/// else each unit's host buffers; `bases[u]` is unit `u`'s first element
/// in the rank's state. Returns the file's length and block CRCs.
fn write_rank_file<B: HostAccess>(
    path: &Path,
    layouts: &[UnitLayout],
    rank: usize,
    bases: &[usize],
    opt: &OptimizerShard<B>,
    backend: &B,
) -> Result<(u64, Vec<u32>)> {
    let mut w = RankFileWriter::create(path, layouts, rank)?;
    match opt.offload() {
        Some(off) => off.visit(|u, local, master, m, v| {
            w.write_state(u, local.start + bases[u], master, m, v)
        })?,
        None => {
            for (u, &base) in bases.iter().enumerate().take(layouts.len()) {
                let (master, m, v) = opt.moments(u).host(backend)?;
                w.write_state(u, base, &master, &m, &v)?;
            }
        }
    }
    w.finish()
}

/// Reads the rank's state (`units`, or the offloaded store `offload`)
/// and parameters (in `units`, or their offloaded homes `poff`) from
/// `reader`; `saved` is the saving plan, `bases[u]` unit `u`'s first
/// element in the rank's state.
fn read_state<B: HostAccess>(
    reader: &mut Reader<'_>,
    saved: &PartitionPlan,
    (units, opt, mut poff): (
        &mut [Unit<B>],
        &mut OptimizerShard<B>,
        Option<&mut ParamOffload>,
    ),
    backend: &B,
    (stage, rank, pdt): (u8, usize, DType),
    bases: &[usize],
) -> Result<()> {
    let mut scratch = vec![0f32; CAST_CHUNK];
    // Drop-behind (see `Reader::drop_behind`) for what only this rank
    // reads, once: from stage 1 on the ranks' state ranges are
    // disjoint and each reads only its own (the parameters of a stage
    // 1–2 rank are cast from its range and all-gathered afterwards);
    // the master on its last read (the parameters below read it again
    // when the optimizer state is offloaded). A stage-0 rank reads
    // everything: other ranks read those bytes too, and find them in
    // the page cache.
    let own_state = stage >= 1;
    // The offloaded optimizer state, tile by tile. Its pieces cover
    // the rank's parameter range, so each is also cast into the
    // parameters, unless those are offloaded too (their homes are then
    // written unit by unit below, reading the master a second time).
    let cast_in_fill = poff.is_none();
    let offloaded = opt.offload().is_some();
    if let Some(off) = opt.offload_mut() {
        off.fill(|u, local, master, mm, v| {
            let abs = local.start + bases[u]..local.end + bases[u];
            reader.drop_behind(own_state && cast_in_fill);
            reader.read_into(u, StateArray::Master, abs.clone(), master)?;
            if cast_in_fill {
                let p = units[u].params_mut();
                // The parameters hold the whole unit in stages 0–2
                // and the rank's shard (from bases[u]) in stage 3.
                let pbase = if stage == 3 { bases[u] } else { 0 };
                p.store_slice(backend, abs.start - pbase, master)?;
            }
            reader.drop_behind(own_state);
            reader.read_into(u, StateArray::M, abs.clone(), mm)?;
            reader.read_into(u, StateArray::V, abs, v)
        })?;
    }
    // Without any offload, file by file and in each file unit by
    // unit: every file is read front to back, and the one window
    // (`Reader`) serves the block two consecutive reads share, so no
    // block is read twice. With parameter offload, unit by unit (each
    // unit's home is written once), every file in turn for each array.
    // With optimizer offload only, the fill above did everything.
    reader.drop_behind(own_state);
    let passes: Vec<Option<usize>> = match poff {
        None if cast_in_fill && offloaded => Vec::new(),
        None => (0..saved.world_size()).map(Some).collect(),
        Some(_) => vec![None],
    };
    for pass in passes {
        for (i, unit) in units.iter_mut().enumerate() {
            let clip = match pass {
                Some(s) => saved.units()[i].real_range(s),
                None => 0..unit.layout.numel,
            };
            load_unit(
                reader,
                (i, unit, opt.moments_mut(i), backend),
                clip,
                (stage, rank, pdt),
                (offloaded, bases[i]),
                poff.as_deref_mut(),
                &mut scratch,
            )?;
        }
    }
    // The parameter homes' swap writes are queued: done before any
    // read of them (a gather right after the load read blocks whose
    // write had not completed, and found them never written).
    if let Some(po) = poff {
        po.flush()?;
    }
    Ok(())
}

/// Loads the part of unit `i` that lies in the element range `clip` of
/// the saved unit: its master over the rank's parameter range, cast into
/// the parameters (or their offloaded home), and its optimizer state (not
/// with optimizer offload: `offloaded`; that is filled tile by tile
/// before). `sbase` is the unit's first element in the rank's state.
fn load_unit<B: HostAccess>(
    reader: &mut Reader<'_>,
    (i, unit, moments, backend): (usize, &mut Unit<B>, &mut Moments<B>, &B),
    clip: Range<usize>,
    (stage, rank, pdt): (u8, usize, DType),
    (offloaded, state_base): (bool, usize),
    poff: Option<&mut ParamOffload>,
    scratch: &mut [f32],
) -> Result<()> {
    let l = unit.layout.clone();
    let (mut master, mut mm, mut v) = moments.host_mut(backend)?;
    let within = |r: Range<usize>| {
        let start = r.start.max(clip.start);
        start..r.end.min(clip.end).max(start)
    };
    // The parameter range this rank casts from the master: the whole unit
    // in stage 0, the rank's real range from stage 1 on (equal to its
    // state range; stages 1–2 hold the whole unit's parameters and
    // all-gather the other ranks' ranges once every rank has loaded,
    // stage 3 holds only the shard).
    let (prange, pbase) = match stage {
        0 => (0..l.numel, 0),
        3 => (l.real_range(rank), rank * l.shard_len),
        _ => (l.real_range(rank), 0),
    };
    let (state, sbase) = match (offloaded, stage) {
        (true, _) => (0..0, 0),
        (false, 0) => (0..l.numel, 0),
        (false, _) => (l.real_range(rank), state_base),
    };
    let (prange, state) = (within(prange), within(state));
    let mut job = MasterLoad {
        reader: &mut *reader,
        unit: i,
        params: prange,
        state: state.clone(),
        master: &mut master[..],
        sbase,
        scratch,
    };
    match poff {
        Some(po) => match pdt {
            DType::F32 => job.run_home::<f32>(po, pbase)?,
            DType::BF16 => job.run_home::<bf16>(po, pbase)?,
            DType::F16 => job.run_home::<f16>(po, pbase)?,
        },
        None => {
            let p = unit.params_mut();
            match pdt {
                DType::F32 => job.run_device::<f32, B>(backend, p, pbase)?,
                DType::BF16 => job.run_device::<bf16, B>(backend, p, pbase)?,
                DType::F16 => job.run_device::<f16, B>(backend, p, pbase)?,
            }
        }
    }
    if !state.is_empty() {
        let s = state.start - sbase..state.end - sbase;
        reader.read_into(i, StateArray::M, state.clone(), &mut mm[s.clone()])?;
        reader.read_into(i, StateArray::V, state, &mut v[s])?;
    }
    commit_moments(backend, (master, mm, v))
}

/// One read of unit `unit`'s saved master over the parameter range
/// `params` (unit coordinates), which contains the state range `state`:
/// the part in `state` goes into `master` (`master[k]` holds element
/// `sbase + k`), and every element is handed on as f32 to be cast to the
/// parameter dtype, from `master` where it went there and through
/// `scratch` ([`CAST_CHUNK`] elements) elsewhere.
struct MasterLoad<'r, 'a, 'b> {
    reader: &'r mut Reader<'a>,
    unit: usize,
    params: Range<usize>,
    state: Range<usize>,
    master: &'b mut [f32],
    sbase: usize,
    scratch: &'b mut [f32],
}

impl MasterLoad<'_, '_, '_> {
    /// Reads the master, calling `cast(i, x)` for consecutive pieces:
    /// `x[k]` is element `i + k`.
    fn run(&mut self, mut cast: impl FnMut(usize, &[f32])) -> Result<()> {
        let (params, state) = (self.params.clone(), self.state.clone());
        if state.is_empty() {
            return self.outside(params, &mut cast);
        }
        debug_assert!(params.start <= state.start && state.end <= params.end);
        self.outside(params.start..state.start, &mut cast)?;
        let x = &mut self.master[state.start - self.sbase..state.end - self.sbase];
        self.reader
            .read_into(self.unit, StateArray::Master, state.clone(), x)?;
        cast(state.start, x);
        self.outside(state.end..params.end, &mut cast)
    }

    /// The master over `r`, outside the state range, through `scratch`.
    fn outside(&mut self, r: Range<usize>, cast: &mut impl FnMut(usize, &[f32])) -> Result<()> {
        let unit = self.unit;
        self.reader
            .for_each(unit, StateArray::Master, r, self.scratch, cast)
    }

    /// [`MasterLoad::run`] into unit `unit`'s offloaded parameter home
    /// (its shard starts at element `pbase`).
    fn run_home<P: Element>(&mut self, po: &mut ParamOffload, pbase: usize) -> Result<()> {
        po.write_with::<P>(self.unit, |home| {
            self.run(|at, x| convert(x, &mut home[at - pbase..][..x.len()], false))
        })
    }

    /// [`MasterLoad::run`] into the unit's parameters `params` on the
    /// device tier (its elements start at element `pbase`).
    fn run_device<P: Element, B: HostAccess>(
        &mut self,
        backend: &B,
        params: &mut DevBuf<B>,
        pbase: usize,
    ) -> Result<()> {
        let dtype = params.dtype();
        let mut view =
            params
                .host_typed_mut::<P>(backend)?
                .ok_or(zero_core::Error::DTypeMismatch {
                    op: "load_checkpoint",
                    expected: dtype,
                    got: P::DTYPE,
                })?;
        self.run(|at, x| convert(x, &mut view[at - pbase..][..x.len()], false))?;
        backend.commit(view)?;
        Ok(())
    }
}
