//! The engine's sharded checkpoints: save, exact resume, reshard on load.
//! The file format (manifest, rank files, CRC blocks, the atomic publish)
//! is `crate::format::checkpoint`; this module walks the engine's state
//! and calls it.
//!
//! # Save
//!
//! [`Engine::save_checkpoint`] writes `root/step{global_steps:08}/`, a
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
use std::time::Instant;

use serde_json::Value;
use zero_comm::agree::{exchange_u64, first_failure};
use zero_core::backend::HostAccess;
use zero_core::partition::{PartitionPlan, UnitLayout, UnitSpec};
use zero_core::{bf16, convert, f16, DType, Element};

use super::devbuf::DevBuf;
use super::optimizer::{commit_moments, Moments, OptimizerShard};
use super::param_offload::ParamOffload;
use super::reducer::GradState;
use super::state::bytes_as_f32;
use super::step::StepOutcome;
use super::unit::Unit;
use super::{Engine, EngineBackend, EngineBuilder, EngineComm, Init};
use crate::agree::agree_on_setup;
use crate::format::checkpoint::{
    check_files, check_units, prepare, publish, rank_file, read_manifest, step_dir_name, tmp_dir,
    FileEntry, Manifest, ModelFileEntry, RankFileWriter, Reader, SavedRun, StateArray, FROZEN_FILE,
    MANIFEST_FILE, MODEL_FILE,
};
use crate::format::safetensors::{tensor_names, ExportDtype};
use crate::{Error, Result};

/// Elements of the master outside the state range converted at once on
/// load before the cast to the parameter dtype.
const CAST_CHUNK: usize = 1 << 16;

impl<C: EngineComm<B>, B: EngineBackend> Engine<C, B> {
    /// Saves a checkpoint to `root/step{N:08}`, `N` the
    /// [`Engine::global_steps`], and returns its path; a
    /// collective, at an optimizer-step boundary only (no micro-batch in
    /// progress, no gradient buffer out). Each rank writes its part of the
    /// fp32 master, m and v (read through the offload store piece by piece
    /// when offloaded); rank 0 writes `manifest.json` (with `client_state`,
    /// the trainer's own JSON: data position, RNG, …), renames the
    /// directory into place, points `root/latest` at it and deletes the
    /// oldest checkpoints beyond [`EngineBuilder::keep_last_checkpoints`].
    /// Every rank returns `Ok` only if every rank's part succeeded. The
    /// format and the crash safety are described in
    /// `src/format/checkpoint/mod.rs`, the rounds of the save in
    /// `src/engine/checkpoint.rs`. With a tracer, each rank records the
    /// span `checkpoint write` (its rank file, through the fsync).
    pub fn save_checkpoint(&mut self, root: &Path, client_state: Value) -> Result<PathBuf> {
        self.guard(|e| e.save_inner(root, client_state))
    }

    fn save_inner(&mut self, root: &Path, client_state: Value) -> Result<PathBuf> {
        self.check_swap("save_checkpoint")?;
        let ga = self.cfg.gradient_accumulation_steps;
        if self.micro != 0 {
            return Err(self.usage(format!(
                "save_checkpoint: in the middle of gradient accumulation ({} of {ga} micro-batches \
                 done); save after the step() that ends the accumulation window",
                self.micro
            )));
        }
        if let Some(i) = self.reducer.find(GradState::Lent) {
            return Err(self.usage(format!(
                "save_checkpoint: the gradient buffer of unit `{}` is out; hand it back and call \
                 step() first",
                self.units[i].layout.name
            )));
        }
        if let Some(i) = self.reducer.find(GradState::Ready) {
            return Err(self.usage(format!(
                "save_checkpoint: a micro-batch is in progress (unit `{}` is grad_ready); call \
                 step() first",
                self.units[i].layout.name
            )));
        }
        if !self.reducer.is_idle() {
            return Err(self.usage(
                "save_checkpoint: gradient reductions are in flight; call step() first".into(),
            ));
        }
        let rank = self.rank;
        let name = step_dir_name(self.global_steps);
        let dest = root.join(&name);
        // Round 1: rank 0 makes the temporary directory.
        let prep = if rank == 0 {
            prepare(root, &dest, &name)
        } else {
            Ok(0)
        };
        let id = *prep.as_ref().unwrap_or(&0);
        let words = exchange_u64(&self.comm, &[u64::from(prep.is_err()), id])?;
        if words[0][0] != 0 {
            let why = first_failure(&self.comm, prep.as_ref().err())?;
            prep?;
            return Err(self.usage(format!(
                "save_checkpoint: rank 0 could not create the checkpoint directory under {}: {}",
                root.display(),
                why.map_or_else(String::new, |(_, w)| w)
            )));
        }
        let tmp = tmp_dir(root, &name, words[0][1]);
        // Round 2: every rank writes its file; rank 0 learns the CRCs.
        let written = {
            let _span = self.tracer.span(rank, "checkpoint write", "checkpoint");
            let path = tmp.join(rank_file(rank));
            let bases = self.state_bases();
            write_rank_file(
                &path,
                self.plan.units(),
                rank,
                &bases,
                &self.opt,
                &self.backend,
            )
        };
        let (bytes, crcs) = match &written {
            Ok((b, c)) => (*b, c.clone()),
            Err(_) => (0, Vec::new()),
        };
        let head = exchange_u64(
            &self.comm,
            &[u64::from(written.is_err()), bytes, crcs.len() as u64],
        )?;
        let max = head.iter().map(|w| w[2] as usize).max().unwrap_or(0).max(1);
        let mut mine: Vec<u64> = crcs.iter().map(|&c| u64::from(c)).collect();
        mine.resize(max, 0);
        let all = exchange_u64(&self.comm, &mine)?;
        if head.iter().any(|w| w[0] != 0) {
            // Every rank knows: share the first failure's text.
            let failed = first_failure(&self.comm, written.as_ref().err())?;
            if rank == 0 {
                let _ = fs::remove_dir_all(&tmp);
            }
            written?;
            let (bad, why) = failed.expect("a rank failed");
            return Err(self.usage(format!(
                "save_checkpoint: rank {bad} could not write its rank file: {why}; no checkpoint \
                 was written"
            )));
        }
        // `stage3_gather_16bit_weights_on_model_save`: the consolidated
        // weights in the parameter dtype, inside the temporary directory so
        // that the rename publishes them with the rest (a collective).
        let model = if self.cfg.zero.gather_16bit_weights_on_model_save {
            let dtype = ExportDtype::of(self.pdt);
            match self.export_inner(&tmp.join(MODEL_FILE), dtype) {
                Ok(written) => {
                    written.map(|(bytes, crc32)| ModelFileEntry::new(dtype, bytes, crc32))
                }
                Err(e) => {
                    if rank == 0 {
                        let _ = fs::remove_dir_all(&tmp);
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        // `EngineBuilder::checkpoint_frozen`: the frozen tensors too (a
        // collective: sharded frozen segments are gathered unit by unit).
        let frozen = if self.save_frozen && self.plan.frozen_numel() > 0 {
            match self.write_frozen(&tmp.join(FROZEN_FILE)) {
                Ok(written) => written,
                Err(e) => {
                    if rank == 0 {
                        let _ = fs::remove_dir_all(&tmp);
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        // Round 3: rank 0 writes the manifest and publishes the checkpoint.
        let done = if rank == 0 {
            let files = (0..self.world)
                .map(|r| {
                    let crcs = all[r][..head[r][2] as usize].iter().map(|&c| c as u32);
                    FileEntry::rank(r, head[r][1], crcs.collect())
                })
                .collect();
            let mut manifest = self.manifest(files, client_state, model);
            manifest.frozen = frozen;
            let r = publish(root, &tmp, &dest, &name, &manifest, self.keep_last);
            if r.is_err() {
                let _ = fs::remove_dir_all(&tmp);
            }
            r
        } else {
            Ok(Vec::new())
        };
        let failed = first_failure(&self.comm, done.as_ref().err())?;
        for w in done? {
            self.warn(w);
        }
        if let Some((_, why)) = failed {
            return Err(self.usage(format!(
                "save_checkpoint: rank 0 could not publish {}: {why}",
                dest.display()
            )));
        }
        Ok(dest)
    }

    /// The manifest of this engine's checkpoint with the rank files
    /// `files` and the consolidated weights `model`.
    fn manifest(
        &self,
        files: Vec<FileEntry>,
        client_state: Value,
        model: Option<ModelFileEntry>,
    ) -> Manifest {
        let run = SavedRun {
            world_size: self.world,
            stage: self.stage,
            param_dtype: self.pdt,
            steps: self.steps,
            global_steps: self.global_steps,
            loss_scaler: self.scaler.clone(),
            seed: self.seed,
            config: serde_json::to_value(&self.cfg).unwrap_or(Value::Null),
            client_state,
        };
        Manifest::new(run, self.plan.units(), files, model)
    }

    /// Writes every frozen tensor to `path` (rank 0) in the parameter
    /// dtype, unit by unit: a collective. Rank 0 gets the file's entry.
    fn write_frozen(&mut self, path: &Path) -> Result<Option<ModelFileEntry>> {
        let layouts = frozen_layouts(&self.plan)?;
        let dtype = ExportDtype::of(self.pdt);
        let done =
            self.write_safetensors(path, &layouts, dtype, "save_checkpoint", |io, i, out| {
                io.extend_frozen(i, out)
            })?;
        Ok(done.map(|(bytes, crc)| ModelFileEntry::frozen(dtype, bytes, crc)))
    }

    /// Reads the frozen tensors of a checkpoint (`entry`, in `dir`) into
    /// this engine's frozen segments (this rank's part of each).
    fn read_frozen(&mut self, dir: &Path, entry: &ModelFileEntry) -> Result<()> {
        let plan = self.plan.clone();
        // An engine error inside the walk, kept as it is.
        let mut failed = None;
        let mut io = self.state_io();
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
            rank: self.rank,
            what: format!("load_checkpoint: {what}"),
        })
    }

    /// Start of each unit's state range, in unit coordinates: 0 in stage
    /// 0 (the whole unit), the rank's shard from stage 1 on.
    fn state_bases(&self) -> Vec<usize> {
        let rank = if self.stage == 0 { 0 } else { self.rank };
        self.units
            .iter()
            .map(|u| rank * u.layout.shard_len)
            .collect()
    }

    /// Builds the engine from `builder` (the trainer registered the same
    /// units as when saving) and loads the checkpoint at `path` into it: a
    /// collective. `path` is a checkpoint directory (with `manifest.json`)
    /// or a root whose `latest` file names one. The checkpoint may come
    /// from any world size, stage and offload mode: each rank reads only
    /// the byte ranges it needs, verifying their blocks' CRCs. Restores the
    /// parameters (cast from the fp32 master), master, m, v, the step count
    /// (and with it the learning-rate schedule) and the loss scaler, and
    /// returns the trainer's `client_state`. On any error (a missing,
    /// truncated, corrupted or foreign file, an unknown manifest version,
    /// units that differ from the registered ones) no engine is returned;
    /// the error names the file and what is wrong. The registered initial
    /// values are not computed (the load overwrites them). With a tracer
    /// ([`EngineBuilder::tracer`]) each rank records the spans
    /// `checkpoint build` (building the engine) and `checkpoint load`
    /// (reading the state into it).
    pub fn load_checkpoint(
        builder: EngineBuilder<C, B>,
        path: &Path,
    ) -> Result<(Engine<C, B>, Value)> {
        let read = read_manifest(path).and_then(|(dir, m)| {
            let registered: Vec<&UnitSpec> = builder.s.specs.iter().map(|(s, _)| s).collect();
            let plan = check_units(&dir.join(MANIFEST_FILE), &m, &registered)?;
            check_files(&dir, &m, &plan)?;
            Ok((dir, m, plan))
        });
        let (dir, manifest, saved) = agree_on_setup(
            &builder.comm,
            read,
            "checkpoint (its manifest.json and rank files",
        )?;
        // The load overwrites every real element of the master and the
        // trainable parameters (padding is zero either way) and m, v start
        // at zero: the build need not compute their registered initial
        // values. Frozen tensors are not in the checkpoint: they keep the
        // values the trainer registered.
        let mut builder = builder;
        for (spec, inits) in &mut builder.s.specs {
            for (t, init) in spec.tensors.iter().zip(inits.iter_mut()) {
                if t.trainable {
                    *init = Init::Zeros;
                }
            }
        }
        builder.s.for_load = true;
        let (tracer, rank) = (builder.s.tracer.clone(), builder.comm.rank());
        let t0 = Instant::now();
        let built = builder.build();
        tracer.record(rank, "checkpoint build", "checkpoint", t0, Instant::now());
        let mut engine = built?;
        let loaded = {
            let _span = tracer.span(rank, "checkpoint load", "checkpoint");
            engine.load_state(&dir, &manifest, &saved)
        };
        let failed = first_failure(&engine.comm, loaded.as_ref().err())?;
        loaded?;
        if let Some((bad, why)) = failed {
            return Err(Error::Usage {
                rank: engine.rank,
                what: format!(
                    "load_checkpoint({}): rank {bad} could not load its part: {why}",
                    dir.display()
                ),
            });
        }
        // The frozen tensors, if the checkpoint holds them (else the
        // registration's stay).
        if let Some(entry) = &manifest.frozen {
            let read = engine.read_frozen(&dir, entry);
            let failed = first_failure(&engine.comm, read.as_ref().err())?;
            read?;
            if let Some((bad, why)) = failed {
                return Err(Error::Usage {
                    rank: engine.rank,
                    what: format!(
                        "load_checkpoint({}): rank {bad} could not read the frozen tensors: {why}",
                        dir.display()
                    ),
                });
            }
        }
        // Collectives only once every rank has its part: stages 1–2
        // all-gather the parameters each rank cast from its master range,
        // stage 3 gathers its persistent units.
        {
            let _span = tracer.span(rank, "checkpoint gather", "checkpoint");
            engine.gather_updated_params()?;
            engine.finish_param_gathers()?;
        }
        Ok((engine, manifest.client_state))
    }

    /// Reads this rank's part of the checkpoint in `dir` (manifest `m`,
    /// saved with the plan `saved`) into its state and parameters, and
    /// resumes its step count and loss scaler.
    fn load_state(&mut self, dir: &Path, m: &Manifest, saved: &PartitionPlan) -> Result<()> {
        let mut reader = Reader::new(dir, m, saved);
        let bases = self.state_bases();
        let how = (self.stage, self.rank, self.pdt);
        let Engine {
            units,
            opt,
            poff,
            backend,
            ..
        } = self;
        read_state(
            &mut reader,
            saved,
            (units, opt, poff.as_mut()),
            backend,
            how,
            &bases,
        )?;
        self.resume_counters(m);
        self.stats.checkpoint_read_bytes = reader.bytes_read();
        Ok(())
    }

    /// The step counts and the loss scaler of the checkpoint `m`.
    fn resume_counters(&mut self, m: &Manifest) {
        self.steps = m.steps;
        self.global_steps = m.global_steps;
        // Every rank resumes at the same point.
        self.micro_batches = 0;
        if self.scaler.is_some() {
            if let Some(s) = &m.loss_scaler {
                self.scaler = Some(s.clone());
            }
        }
        self.last = StepOutcome::between(self.lr(), self.loss_scale(), self.steps);
    }
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

/// The layouts of every unit's frozen tensors alone (units without any
/// left out), in order: the contents of [`FROZEN_FILE`].
fn frozen_layouts(plan: &PartitionPlan) -> Result<Vec<UnitLayout>> {
    let specs: Vec<UnitSpec> = plan
        .units()
        .iter()
        .filter(|l| l.frozen_numel > 0)
        .map(|l| {
            let mut spec = l.spec();
            spec.tensors.retain(|t| !t.trainable);
            spec
        })
        .collect();
    Ok(PartitionPlan::new(&specs, 1)?.units().to_vec())
}

/// The frozen tensors of a checkpoint (`entry` in `dir`, saved with
/// `plan`), unit by unit: `each(unit, values)` gets each unit's frozen
/// real elements in layout order, for the units that have frozen tensors.
/// The file is never in memory as a whole: its length and CRC32 are
/// checked reading it in chunks, then each tensor's bytes are read on
/// their own (host memory: the largest unit's frozen values). The error
/// names the file and the tensor.
pub(crate) fn read_frozen_file(
    dir: &Path,
    entry: &ModelFileEntry,
    plan: &PartitionPlan,
    mut each: impl FnMut(usize, &[f32]) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    use std::os::unix::fs::FileExt;
    let path = dir.join(&entry.name);
    let bad = |what: String| format!("{}: {what}", path.display());
    let file = fs::File::open(&path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| bad(format!("cannot read: {e}")))?
        .len();
    // The whole file's CRC32, a chunk at a time.
    let mut crc = crc32fast::Hasher::new();
    let mut chunk = vec![0u8; (len.min(4 << 20)) as usize];
    let mut at = 0u64;
    while at < len {
        let k = (len - at).min(chunk.len() as u64) as usize;
        file.read_exact_at(&mut chunk[..k], at)
            .map_err(|e| bad(format!("cannot read at byte {at}: {e}")))?;
        crc.update(&chunk[..k]);
        at += k as u64;
    }
    drop(chunk);
    let crc = crc.finalize();
    if len != entry.bytes || crc != entry.crc32 {
        return Err(bad(format!(
            "{len} bytes with CRC32 {crc:08x}, but the manifest says {} bytes with CRC32 {:08x} \
             (a truncated or damaged file)",
            entry.bytes, entry.crc32
        )));
    }
    let not_st = |what: String| bad(format!("not a safetensors file: {what}"));
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0)
        .map_err(|e| not_st(format!("no header length ({e})")))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) {
        return Err(not_st(format!(
            "a header of {n} bytes in a file of {len} bytes"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8)
        .map_err(|e| not_st(format!("the header: {e}")))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| not_st(format!("the header: {e}")))?;
    drop(header);
    let data_start = 8 + n;
    let layouts = frozen_layouts(plan).map_err(|e| bad(e.to_string()))?;
    let mut names = tensor_names(&layouts).map_err(bad)?.into_iter();
    let mut values = Vec::new();
    let mut bytes = Vec::new();
    for (u, l) in plan.units().iter().enumerate() {
        if l.frozen_numel == 0 {
            continue;
        }
        values.clear();
        for t in l.tensors.iter().filter(|t| !t.trainable) {
            let name = names.next().unwrap_or_default();
            let info = meta.info(&name).ok_or_else(|| {
                bad(format!(
                    "no tensor `{name}` (unit `{}`, tensor `{}`)",
                    l.name, t.name
                ))
            })?;
            if info.shape != t.shape {
                return Err(bad(format!(
                    "tensor `{name}` has shape {:?}, the model's `{}` of unit `{}` {:?}",
                    info.shape, t.name, l.name, t.shape
                )));
            }
            let size = match info.dtype {
                safetensors::Dtype::F32 => 4,
                safetensors::Dtype::BF16 | safetensors::Dtype::F16 => 2,
                other => {
                    return Err(bad(format!(
                        "tensor `{name}` is {other:?}; F32, BF16 or F16 expected"
                    )))
                }
            };
            let (b, e) = info.data_offsets;
            if e.checked_sub(b) != Some(t.numel * size) || data_start + e as u64 > len {
                return Err(bad(format!(
                    "tensor `{name}` has data offsets {b}..{e}: {} elements of {size} bytes \
                     in a file of {len} bytes expected",
                    t.numel
                )));
            }
            bytes.resize(e - b, 0);
            file.read_exact_at(&mut bytes, data_start + b as u64)
                .map_err(|err| bad(format!("tensor `{name}`: cannot read: {err}")))?;
            let dtype = match info.dtype {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                _ => DType::F16,
            };
            values.extend(bytes_as_f32(dtype, &bytes));
        }
        each(u, &values)?;
    }
    Ok(())
}
