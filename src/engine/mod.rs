//! The ZeRO engine: stages 0–3 over any [`Communicator`].
//!
//! A trainer registers its parameters as *units* (a layer, an embedding),
//! each one flat buffer of named tensors, then drives every micro-batch:
//!
//! ```text
//!  forward:   p = gather(u) → p.params() → … → drop(p)      for each unit
//!  backward:  p = gather(u) → g = grad_buffer(u) → write g → drop(p)
//!             → grad_ready(u, g)                            (reverse order)
//!  step()     after every micro-batch; the optimizer runs on the
//!             gradient_accumulation_steps-th
//! ```
//!
//! What each stage keeps per rank (Ψ parameters, N ranks; P, A, C the
//! parameter, gradient-accumulation and communication dtypes):
//!
//! | stage | params (P) | grads | fp32 master, m, v | gradient reduction |
//! |---|---|---|---|---|
//! | 0 | full | full P (+ full A) | full | all-reduce per bucket during backward |
//! | 1 | full | full P (+ shard A) | shard | reduce-scatter after backward, in buckets |
//! | 2 | full | shard A | shard | reduce-scatter per bucket during backward |
//! | 3 | shard, units gathered on demand | shard A | shard | as stage 2 |
//!
//! The separate A buffer of stages 0 and 1 is not needed (the reduced
//! gradient stays in the P buffer) when A = P and there is no gradient
//! accumulation: then model states are exactly ZeRO's 16Ψ, 4Ψ+12Ψ/N,
//! 2Ψ+14Ψ/N, 16Ψ/N for bf16, plus the padding of [`zero_core::partition`].
//!
//! # Arithmetic (identical in every stage)
//! Per micro-batch, each unit's gradient is converted to C, summed over
//! ranks in rank order with f32 accumulation (the communicator's reference
//! reduction), and stored in A (the first micro-batch of a step writes,
//! later ones add in f32). At the step, the gradient norm is the sum over
//! ranks (in rank order) of each rank's [`sum_squares`](zero_core::optim::sum_squares) over its shard of
//! every unit (in unit order); the AdamW update is
//! [`adamw_reference`](zero_core::optim::adamw_reference) with `grad_scale = clip / (loss_scale · N · GA)`.
//! Every stage performs these operations on the same values in the same
//! order, so all stages give bit-identical parameters and optimizer state
//! at the same world size.
//!
//! # Offload
//! `offload_optimizer.device` `"cpu"` or `"nvme"` (any stage; the JSON
//! parser asks for stage 1–3, as DeepSpeed) keeps the rank's fp32 master,
//! `m` and `v` in pre-faulted host buffers (`pin_memory` locks them) or a
//! per-rank swap file under `nvme_path`, and its accumulated gradient
//! shard in host memory (with `swap_gradients`, in a swap file of its
//! own); AdamW runs in tiles of `sub_group_size` elements, pipelined with
//! the swap traffic. `offload_param.device` `"cpu"` or `"nvme"` (stage 3
//! only; other stages refuse it naming the key) keeps the parameter
//! shards in a host pool or a swap file, read ahead of the gathers and
//! cached up to `max_in_cpu` elements ([`EngineStats::param_cache_hits`]).
//! Every combination gives the bits of no offload.
//!
//! A swap-file error fails the step on every rank, naming the file, and
//! training stops: a failed optimizer swap *write* loses nothing (the
//! step completes and the state after it stays readable), any other
//! error loses the optimizer state, or the parameters too
//! (`src/engine/health.rs` says what each case still allows).
//!
//! # Where things are
//! This file is the coordinator, and the only file that names `Engine`'s
//! fields: each call hands the components the parts they need, borrowed
//! (`GatherIo`, `AllGatherIo`, `StepIo`, `StateIo`), beside one `Ctx`
//! (`ctx.rs`: what none of them changes). `builder.rs` builds the
//! components ([`EngineBuilder`]); `unit.rs` holds the units and runs the
//! stage 1–2 all-gathers; `lease.rs` the guards and gradient buffers
//! lent; `step/` the optimizer step, one type per tier; `state.rs` reads
//! a unit's state for [`Engine::unit_state`], `checkpoint.rs` and
//! `export.rs`; `progress.rs`, `stats.rs`, `meter.rs`, `warnings.rs` and
//! `saving.rs` keep the bookkeeping (steps, mode, counters, swap traffic,
//! warnings, what checkpoints keep); `reducer.rs`, `gatherer.rs`,
//! `optimizer.rs`, `offload.rs`, `param_offload.rs`, `grad_swap.rs`,
//! `staging.rs` and `health.rs` are the components they drive.

mod backend;
mod builder;
mod checkpoint;
mod ctx;
mod devbuf;
mod dynbuf;
mod export;
mod faults;
mod gatherer;
mod grad_swap;
mod groups;
mod health;
mod init;
mod lease;
mod meter;
mod offload;
mod optimizer;
mod param_offload;
mod progress;
mod reducer;
mod saving;
mod staging;
mod state;
mod stats;
mod step;
mod unit;
mod warnings;

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::Value;

use grad_swap::GradSwap;
use zero_comm::Communicator;
use zero_core::backend::{CpuBackend, Stream};
use zero_core::config::{FrozenParams, ResolvedConfig};
use zero_core::memory::{MemoryReport, MemoryTracker};
use zero_core::partition::{PartitionPlan, UnitLayout};
use zero_core::{DType, Element};

pub use crate::format::checkpoint::{CHECKPOINT_FORMAT, CHECKPOINT_VERSION};
pub use crate::format::safetensors::{ExportDtype, SafetensorsWriter};
use crate::trace::Tracer;
use crate::Result;
pub use backend::{EngineBackend, EngineComm};
use builder::Built;
pub use builder::EngineBuilder;
use ctx::Ctx;
use dynbuf::DynBuf;
pub use export::export_checkpoint;
use gatherer::{GatherIo, ParamGatherer};
pub use groups::{is_bias_norm_or_embedding, GroupPredicate, ParamGroup};
use health::Health;
pub use init::{Init, TensorSource};
pub use lease::{GradBuffer, UnitGuard};
use lease::{Releases, Returns};
use meter::Meter;
use optimizer::OptimizerShard;
use param_offload::ParamOffload;
use progress::Progress;
pub use progress::StepOutcome;
use reducer::GradReducer;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use reducer::SkipWait;
use saving::SaveHow;
pub use state::UnitState;
use state::{StateIo, StateRead};
pub use stats::{EngineStats, SwapTraffic};
use step::{OptimizerStep, StepIo};
pub use unit::UnitId;
use unit::{AllGatherIo, Units};
use warnings::Warnings;

/// The sharded data-parallel engine of one rank.
pub struct Engine<C: Communicator, B: EngineBackend = CpuBackend> {
    /// The communicator, device, config, plan, tracker, tracer and the
    /// run's fixed facts, which every component borrows.
    cx: Ctx<C, B>,
    /// Every unit, its parameters, and the all-gathers of stages 1–2.
    units: Units<B>,
    /// Gradient buckets, reductions and homes.
    reducer: GradReducer<B>,
    /// Gradient buffers the trainer dropped instead of handing back.
    returns: Returns<B>,
    /// Units whose guards dropped.
    releases: Releases,
    /// The micro-batch and step counts, the loss scaler, the last step.
    progress: Progress,
    /// Stage 3: the gathered parameters and their schedule.
    s3: ParamGatherer<B>,
    /// [`Engine::stats`], and the swap traffic at the last reset.
    meter: Meter,
    warnings: Warnings,
    /// What still works after a failure (see [`health`]).
    health: Health,
    /// fp32 master, m, v, the AdamW and norm kernels, and the optimizer
    /// offload tiers.
    opt: OptimizerShard<B>,
    /// The optimizer step of this engine's tier, with its buffers (see
    /// [`step`]).
    optimizer: OptimizerStep<B>,
    /// Stage 3 parameter offload (`offload_param.device` cpu or nvme): the
    /// home of every unit's shard.
    poff: Option<ParamOffload>,
    /// What [`Engine::save_checkpoint`] records and keeps besides the
    /// state.
    saving: SaveHow,
}

impl<C: EngineComm<B>, B: EngineBackend> EngineBuilder<C, B> {
    /// Checks that every rank registered the same units with the same
    /// config (a collective), allocates every buffer of the memory plan and
    /// initialises this rank's parameters.
    pub fn build(self) -> Result<Engine<C, B>> {
        Engine::assemble(self.into_parts()?)
    }
}

impl<C: Communicator> Engine<C, CpuBackend> {
    /// Starts building an engine for `cfg` (resolved for this world size)
    /// over `comm`, on the CPU backend unless [`EngineBuilder::backend`]
    /// gives it another.
    pub fn builder(cfg: ResolvedConfig, comm: C) -> EngineBuilder<C> {
        EngineBuilder::new(cfg, comm)
    }
}

impl<C: EngineComm<B>, B: EngineBackend> Engine<C, B> {
    /// The coordinator over the components `b` built: its counters start
    /// at zero, and stage 3 gathers its persistent units.
    fn assemble(b: Built<C, B>) -> Result<Self> {
        let ga = b.cx.cfg.gradient_accumulation_steps;
        let progress = Progress::new(ga, b.scaler, b.cx.cfg.scheduler.lr_at(0));
        let warnings = Warnings::new(b.cx.rank, b.warnings);
        let mut engine = Engine {
            cx: b.cx,
            units: b.units,
            reducer: b.reducer,
            returns: Returns::default(),
            releases: Releases::default(),
            progress,
            s3: b.s3,
            meter: Meter::default(),
            warnings,
            health: Health::Ok,
            opt: b.opt,
            optimizer: b.optimizer,
            poff: b.poff,
            saving: b.saving,
        };
        engine.at_stage3(|s3, io| s3.gather_persistent(io))?;
        Ok(engine)
    }

    // ------------------------------------------------------------------
    // Introspection

    /// This rank.
    pub fn rank(&self) -> usize {
        self.cx.rank
    }

    /// The device backend the engine runs on: a trainer enqueues its own
    /// work (forward and backward) on its compute stream, where the
    /// engine's gathers and reductions are ordered with it.
    pub fn device_backend(&self) -> &B {
        &self.cx.backend
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.cx.world
    }

    /// The communicator (for the trainer's own collectives, e.g. averaging
    /// the loss for logging).
    pub fn comm(&self) -> &C {
        &self.cx.comm
    }

    /// The tracer this engine records its spans into
    /// ([`EngineBuilder::tracer`]; disabled by default). A trainer can
    /// record its own spans (forward, backward) into it too.
    pub fn tracer(&self) -> &Tracer {
        &self.cx.tracer
    }

    /// The resolved config.
    pub fn config(&self) -> &ResolvedConfig {
        &self.cx.cfg
    }

    /// The partition plan.
    pub fn plan(&self) -> &PartitionPlan {
        &self.cx.plan
    }

    /// Where stage 3 keeps the frozen tensors: the `frozen_params` policy
    /// in effect (`auto` resolved; `resident` at stages 0–2 and without
    /// frozen tensors, where every rank holds them anyway).
    pub fn frozen_params(&self) -> FrozenParams {
        self.cx.frozen_policy
    }

    /// The dtype of parameters and of the gradients the trainer writes.
    pub fn param_dtype(&self) -> DType {
        self.cx.pdt
    }

    /// The unit registered as `name`.
    pub fn unit_id(&self, name: &str) -> Option<UnitId> {
        self.cx.plan.find(name).map(|i| UnitId::new(self.cx.id, i))
    }

    /// Every unit, in registration order.
    pub fn unit_ids(&self) -> Vec<UnitId> {
        let id = self.cx.id;
        (0..self.units.len()).map(|i| UnitId::new(id, i)).collect()
    }

    /// The layout of a unit (its tensors' names, shapes and offsets).
    pub fn layout(&self, unit: UnitId) -> Result<&UnitLayout> {
        let i = self.check(unit, "layout")?;
        Ok(&self.units[i].layout)
    }

    /// This rank's optimizer swap file (`offload_optimizer.device =
    /// "nvme"`), named `zero-swap-optimizer-rank<r>-<run id>.swp` under
    /// `nvme_path` and removed when the engine is dropped; `None` without
    /// nvme offload.
    pub fn optimizer_swap_path(&self) -> Option<&std::path::Path> {
        self.opt.offload().and_then(|o| o.swap_path())
    }

    /// This rank's parameter swap file (`offload_param.device = "nvme"`,
    /// stage 3), named `zero-swap-params-rank<r>-<run id>.swp` under
    /// `offload_param.nvme_path` and removed when the engine is dropped;
    /// `None` otherwise.
    pub fn param_swap_path(&self) -> Option<&std::path::Path> {
        self.poff.as_ref().and_then(|p| p.swap_path())
    }

    /// This rank's gradient swap file
    /// (`offload_optimizer.swap_gradients`), named
    /// `zero-swap-gradients-rank<r>-<run id>.swp` under the optimizer's
    /// `nvme_path` and removed when the engine is dropped; `None` otherwise.
    pub fn grad_swap_path(&self) -> Option<&std::path::Path> {
        self.reducer.grad_swap().map(GradSwap::path)
    }

    /// The memory tracker (the trainer reports activations through it).
    pub fn tracker(&self) -> &MemoryTracker {
        &self.cx.tracker
    }

    /// The memory report of this rank.
    pub fn memory_report(&self) -> MemoryReport {
        self.cx.tracker.report()
    }

    /// Time and traffic counters since the start (or the last reset).
    pub fn stats(&self) -> &EngineStats {
        &self.meter.stats
    }

    /// Resets [`Engine::stats`] (the live-parameter peak included).
    pub fn reset_stats(&mut self) {
        let files = (&self.opt, self.poff.as_ref(), &self.reducer);
        self.meter.reset(files, self.s3.live());
    }

    /// The loss scale the trainer multiplies its loss by (1 unless fp16).
    pub fn loss_scale(&self) -> f32 {
        self.progress.loss_scale()
    }

    /// The learning rate of the next optimizer step.
    pub fn lr(&self) -> f64 {
        self.cx.cfg.scheduler.lr_at(self.progress.steps())
    }

    /// Optimizer steps applied so far (skipped steps not counted).
    pub fn steps(&self) -> u64 {
        self.progress.steps()
    }

    /// Optimizer-step boundaries so far, skipped steps included
    /// (DeepSpeed's `global_steps`): [`Engine::save_checkpoint`] names
    /// its directory after it.
    pub fn global_steps(&self) -> u64 {
        self.progress.global_steps()
    }

    /// What the last [`Engine::step`] did.
    pub fn last_step(&self) -> StepOutcome {
        self.progress.last()
    }

    /// Warnings given so far (each once; rank 0 also prints them), e.g.
    /// the config's (`ResolvedConfig::warnings`: unknown or unused keys of
    /// its JSON, prefixed `config: `) or a stage-3 gather order that
    /// differs from the recorded one.
    pub fn warnings(&self) -> &[String] {
        self.warnings.given()
    }

    /// Stage 3: `f` on the gatherer with what it needs from the engine for
    /// a call, and the warning it gave (nothing at stages 0–2).
    fn at_stage3(
        &mut self,
        f: impl FnOnce(&mut ParamGatherer<B>, GatherIo<'_, C, B>) -> Result<()>,
    ) -> Result<()> {
        if self.cx.stage != 3 {
            return Ok(());
        }
        let homes = (self.poff.as_mut(), &self.units);
        let io = unit::gather_io(&self.cx, homes, &mut self.meter.stats);
        let r = f(&mut self.s3, io);
        if let Some(w) = self.s3.take_warning() {
            self.warnings.give(w);
        }
        r
    }

    /// The units, and what their stage 1–2 all-gathers need.
    fn gather_parts(&mut self) -> (&mut Units<B>, AllGatherIo<'_, C, B>) {
        let (cx, stats) = (&self.cx, &mut self.meter.stats);
        (&mut self.units, AllGatherIo { cx, stats })
    }

    /// What reading the units' state needs (every stage 1–2 all-gather
    /// complete: [`Engine::finish_param_gathers`]).
    fn state_io(&mut self) -> StateIo<'_, C, B> {
        StateIo {
            cx: &self.cx,
            units: &mut self.units,
            s3: &mut self.s3,
            opt: &mut self.opt,
            poff: self.poff.as_mut(),
            health: &mut self.health,
        }
    }

    /// Runs a call that may run collectives. After a communication error
    /// the engine's buffers may still be held by the failed collective, so
    /// every later call fails with that error instead of touching them.
    fn guard<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        self.checked(self.health.check_comm())?;
        let r = self.take_back_dropped().and_then(|()| f(self));
        self.health.after(&r);
        r
    }

    /// Gradient buffers the trainer dropped (an error path) come home: their
    /// units have no gradient in this micro-batch.
    fn take_back_dropped(&mut self) -> Result<()> {
        for (i, buf) in self.returns.take() {
            self.reducer.take_back_unused(i, buf)?;
        }
        for i in self.releases.take() {
            self.release(i)?;
        }
        Ok(())
    }

    /// After a swap-file error only reading parameters works, and reading
    /// the whole state after a rescued write failure (see [`health`]).
    fn check_swap(&self, call: &str) -> Result<()> {
        self.checked(self.health.check_swap(call, self.progress.steps()))
    }

    /// A component's refusal (`Err(why)`) as a usage error of this rank.
    fn checked<T>(&self, r: std::result::Result<T, String>) -> Result<T> {
        self.cx.checked(r)
    }

    fn check(&self, unit: UnitId, call: &str) -> Result<usize> {
        let (id, n) = (self.cx.id, self.units.len());
        self.checked(unit.index_in(id, n, call))
    }

    fn name(&self, i: usize) -> &str {
        &self.units[i].layout.name
    }

    // ------------------------------------------------------------------
    // Parameters

    /// Makes a unit's full parameters available (stage 3: all-gathers
    /// them, or waits for the prefetch; stages 0–2 hold them anyway) and
    /// returns them as a [`UnitGuard`], which releases the unit when it
    /// drops (stage 3 then frees the gathered buffer unless it is
    /// persistent or needed again soon). The guard borrows nothing from the
    /// engine: keep it while the unit's gradient is written. `step`
    /// refuses to run while a guard is alive.
    pub fn gather(&mut self, unit: UnitId) -> Result<UnitGuard<B>> {
        self.guard(|e| e.gather_inner(unit))
    }

    fn gather_inner(&mut self, unit: UnitId) -> Result<UnitGuard<B>> {
        let i = self.check(unit, "gather")?;
        self.checked(self.health.check_gather(self.name(i)))?;
        if self.cx.stage == 3 {
            let _span = self.cx.tracer.span(self.cx.rank, "gather", "comm");
            let t = Instant::now();
            let training = self.progress.training();
            self.at_stage3(|s3, io| s3.gather(i, training, io))?;
            self.meter.stats.gather_time += t.elapsed();
        } else {
            // Stages 1–2 with overlap_comm: the all-gather of this unit's
            // updated parameters may still be in flight.
            let (units, mut io) = self.gather_parts();
            units.wait_for(i, &mut io)?;
        }
        let s3 = (self.cx.stage == 3).then_some(&self.s3);
        let on = (&self.cx.backend, self.cx.rank);
        self.cx.checked(self.units.lend(i, s3, on, &self.releases))
    }

    /// Ends one use of unit `i`'s parameters (its guard dropped). (The
    /// stage-3 schedule counts the gathers too: the last release frees or
    /// keeps the unit.)
    fn release(&mut self, i: usize) -> Result<()> {
        self.cx.checked(self.units.unlend(i))?;
        let training = self.progress.training();
        self.at_stage3(|s3, io| s3.release(i, training, io))
    }

    /// Whether the engine is in training mode (the default; see
    /// [`Engine::eval`]).
    pub fn is_training(&self) -> bool {
        self.progress.training()
    }

    /// Switches to evaluation: forward passes only. Gathers work as in
    /// training but are not recorded into the stage-3 gather order (so an
    /// evaluation in another order neither warns nor changes what training
    /// prefetches) and free each unit when its guard drops;
    /// `grad_buffer`, `grad_ready`, `step` and `zero_grad` are refused
    /// until [`Engine::train`]. No unit may be gathered and no gradient
    /// buffer out when switching; the gradients of an unfinished
    /// accumulation window are kept.
    pub fn eval(&mut self) -> Result<()> {
        self.guard(|e| e.switch_mode(false, "eval"))
    }

    /// Switches back to training (see [`Engine::eval`]).
    pub fn train(&mut self) -> Result<()> {
        self.guard(|e| e.switch_mode(true, "train"))
    }

    fn switch_mode(&mut self, training: bool, call: &str) -> Result<()> {
        self.checked(self.units.check_none_gathered(call))?;
        self.checked(self.reducer.check_none_lent(call, |j| self.name(j)))?;
        self.progress.set_training(training);
        Ok(())
    }

    /// A training call: refused in evaluation mode, and after a swap-file
    /// error.
    fn check_training(&self, call: &str) -> Result<()> {
        self.checked(self.progress.check_training(call))?;
        self.check_swap(call)
    }

    /// The full state of a unit (parameters, fp32 master, m, v), real
    /// elements only. A collective in stages 1–3: every rank must call it.
    /// With nvme offload it reads the unit's tiles from the swap file.
    /// After a swap-file error it returns an error (the optimizer state is
    /// lost; read the parameters with [`Engine::gather`] and
    /// [`UnitGuard::params`] instead), except after a failed swap write,
    /// which loses nothing: then it returns the state after that step.
    pub fn unit_state(&mut self, unit: UnitId) -> Result<UnitState> {
        self.guard(|e| e.unit_state_inner(unit, StateRead::All))
    }

    /// A unit's parameters and fp32 master ([`UnitState::params`] and
    /// [`UnitState::master`]; `m` and `v` empty), as [`Engine::unit_state`]
    /// reads them (a collective in stages 1–3) without gathering the
    /// moments: what an export of the trained weights needs, the master
    /// of trainable tensors (a bf16 run's parameters are its rounding)
    /// and the parameters of frozen ones.
    pub fn unit_master(&mut self, unit: UnitId) -> Result<UnitState> {
        self.guard(|e| e.unit_state_inner(unit, StateRead::Master))
    }

    /// A unit's parameters alone ([`UnitState::params`]: the training
    /// dtype's values as f32, trainable then frozen real elements), as
    /// [`Engine::unit_state`] reads them (a collective in stages 1–3; no
    /// gather, so stage 3's gather order is left alone) without reading
    /// or gathering the master and the moments: a third of the memory
    /// and traffic, what an export of the weights needs.
    pub fn unit_params(&mut self, unit: UnitId) -> Result<Vec<f32>> {
        self.guard(|e| e.unit_state_inner(unit, StateRead::Params))
            .map(|s| s.params)
    }

    /// [`Engine::unit_state`], reading what `what` says (the fields not
    /// read are empty).
    fn unit_state_inner(&mut self, unit: UnitId, what: StateRead) -> Result<UnitState> {
        let i = self.check(unit, what.call())?;
        self.check_swap(what.call())?;
        self.finish_param_gathers()?;
        self.state_io().read(i, what)
    }

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
        self.guard(|e| {
            e.check_swap("save_checkpoint")?;
            e.checked(checkpoint::at_boundary(&e.progress, &e.reducer, &e.units))?;
            let how = e.saving;
            let run = e.checked(how.run(&e.progress, &e.cx, client_state))?;
            let (dest, warnings) = checkpoint::save(&mut e.state_io(), root, run, how)?;
            warnings.into_iter().for_each(|w| e.warnings.give(w));
            Ok(dest)
        })
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
        mut builder: EngineBuilder<C, B>,
        path: &Path,
    ) -> Result<(Engine<C, B>, Value)> {
        let opened = checkpoint::open(&mut builder, path)?;
        let (tracer, rank) = (builder.s.tracer.clone(), builder.comm().rank());
        let t0 = Instant::now();
        let built = builder.build();
        tracer.record(rank, "checkpoint build", "checkpoint", t0, Instant::now());
        let mut engine = built?;
        engine.meter.stats.checkpoint_read_bytes =
            checkpoint::load(&mut engine.state_io(), &opened)?;
        // Every rank resumes at the same step, with the same loss scale.
        let schedule = &engine.cx.cfg.scheduler;
        engine.progress.resume(&opened.manifest, schedule);
        // Collectives only once every rank has its part: stages 1–2
        // all-gather the parameters each rank cast from its master range,
        // stage 3 gathers its persistent units.
        {
            let _span = tracer.span(rank, "checkpoint gather", "checkpoint");
            engine.gather_updated_params()?;
            engine.finish_param_gathers()?;
        }
        Ok((engine, opened.manifest.client_state))
    }

    /// Writes the current weights of every unit to the safetensors file
    /// `path` as `dtype`: a collective (every rank calls it; rank 0
    /// writes). The values are the fp32 master (`F32` exactly; `Bf16` and
    /// `F16` rounded to nearest even, i.e. the parameters of a run in that
    /// dtype), named as described in `src/format/safetensors.rs`: the
    /// registered tensor names when they are unique across units (the
    /// Llama example's HF names), `<unit>.<tensor>` otherwise.
    ///
    /// One unit is gathered at a time (host memory: the largest unit), and
    /// the file is written to `path.tmp`, fsynced and renamed, so a failed
    /// export leaves nothing behind. Every rank returns `Ok` only if rank 0
    /// wrote the file. [`export_checkpoint`] writes the same bytes offline
    /// from a saved checkpoint.
    pub fn export_safetensors(&mut self, path: &Path, dtype: ExportDtype) -> Result<()> {
        self.guard(|e| {
            e.check_swap("export_safetensors")?;
            export::export_live(&mut e.state_io(), path, dtype).map(|_| ())
        })
    }

    // ------------------------------------------------------------------
    // Gradients

    /// The buffer for a unit's gradient in this micro-batch: the unit's
    /// trainable segment (`layout.padded_numel` elements, each trainable
    /// tensor at its [`UnitLayout`] offset, padding included; frozen
    /// tensors have no gradient), zeroed, in the training dtype. A unit
    /// with only frozen tensors has none (an error naming it). The
    /// trainer writes (or accumulates) the gradient of its micro-batch loss
    /// — multiplied by [`Engine::loss_scale`] — and hands it back with
    /// [`Engine::grad_ready`].
    pub fn grad_buffer<T: Element>(&mut self, unit: UnitId) -> Result<GradBuffer<T, B>> {
        self.guard(|e| e.grad_buffer_inner(unit))
    }

    fn grad_buffer_inner<T: Element>(&mut self, unit: UnitId) -> Result<GradBuffer<T, B>> {
        let i = self.check(unit, "grad_buffer")?;
        self.check_training("grad_buffer")?;
        let (unit, add) = ((i, &self.units[i].layout), self.progress.micro() > 0);
        self.reducer.lend_as(&self.cx, unit, add, &self.returns)
    }

    /// Hands a unit's gradient back: it joins the current bucket, which is
    /// reduced as soon as it is full (stages 0, 2, 3 while backward goes
    /// on; stage 1 after backward, in [`Engine::step`]).
    pub fn grad_ready<T: Element>(&mut self, unit: UnitId, grad: GradBuffer<T, B>) -> Result<()> {
        self.guard(|e| e.grad_ready_inner(unit, grad))
    }

    fn grad_ready_inner<T: Element>(&mut self, unit: UnitId, grad: GradBuffer<T, B>) -> Result<()> {
        let i = self.check(unit, "grad_ready")?;
        self.check_training("grad_ready")?;
        self.checked(grad.check_for((i, &self.units[i].layout), self.cx.pdt))?;
        self.checked(self.reducer.state(i).check_hand_back(self.name(i)))?;
        let buf = DynBuf::from_lent::<T>(grad.into_inner());
        let position = self.progress.position();
        let io = (&self.cx.comm, &self.cx.tracer, &mut self.meter.stats);
        self.reducer.hand_back(io, i, buf, position)
    }

    // ------------------------------------------------------------------
    // The step

    /// Ends a micro-batch: finishes its gradient reductions and, every
    /// `gradient_accumulation_steps` calls, runs the optimizer step
    /// (global norm, clipping, fp16 overflow check and loss-scale update,
    /// AdamW on this rank's shard, then the parameter all-gather where the
    /// stage needs it).
    pub fn step(&mut self) -> Result<StepOutcome> {
        self.guard(Self::step_inner)
    }

    fn step_inner(&mut self) -> Result<StepOutcome> {
        let r = self.step_counted();
        self.meter
            .refresh((&self.opt, self.poff.as_ref(), &self.reducer));
        r
    }

    fn step_counted(&mut self) -> Result<StepOutcome> {
        self.check_training("step")?;
        self.checked(self.units.check_none_gathered("step"))?;
        self.checked(self.reducer.check_complete(|j| self.name(j)))?;
        self.finish_param_gathers()?;
        let position = self.progress.position();
        let io = (&self.cx.comm, &self.cx.tracer, &mut self.meter.stats);
        self.reducer.finish(io, position)?;
        self.at_stage3(|s3, io| s3.end_micro_batch(io))?;
        if let Some(po) = self.poff.as_mut() {
            let number = self.progress.steps() + 1;
            po.micro_batch_verdict(&self.cx.comm, &mut self.health, number)?;
        }
        if let Some(gs) = self.reducer.grad_swap_mut() {
            gs.verdict(&self.cx.comm, self.cx.rank)?;
        }
        if !self.progress.end_micro_batch() {
            self.at_stage3(|s3, io| s3.prefetch_next(io))?;
            return Ok(self.progress.between(self.lr()));
        }
        let span = self.cx.tracer.span(self.cx.rank, "optimizer", "optimizer");
        let t = Instant::now();
        let mut io = StepIo {
            cx: &self.cx,
            units: &mut self.units,
            opt: &mut self.opt,
            reducer: &mut self.reducer,
            poff: self.poff.as_mut(),
            health: &mut self.health,
            rescued: None,
            number: self.progress.steps() + 1,
            s3: &mut self.s3,
            stats: &mut self.meter.stats,
        };
        let (progress, warnings) = (&mut self.progress, &mut self.warnings);
        let outcome = self.optimizer.at_boundary(&mut io, progress, warnings);
        // A failed swap write that every rank rescued: the step finishes
        // (parameter all-gather included), and then it fails.
        let (outcome, rescued) = (outcome?, io.rescued);
        self.meter.stats.optimizer_time += t.elapsed();
        drop(span);
        if !outcome.skipped {
            let _span = self.cx.tracer.span(self.cx.rank, "gather", "comm");
            let t = Instant::now();
            // The all-gathers of stages 1–2 start after AdamW on the
            // communication stream (see `Units::advance`) …
            self.gather_updated_params()?;
            // … and what reads the updated parameters or state from the
            // host (the trainer through its guards, offload, saving) is
            // ordered after it here.
            let updated = self.cx.backend.record(Stream::Compute)?;
            self.cx.backend.sync(&updated)?;
            self.meter.stats.gather_time += t.elapsed();
        }
        self.at_stage3(|s3, io| s3.prefetch_next(io))?;
        self.progress.finish(outcome);
        match rescued {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }

    /// After a step every rank applied: stages 1–2 all-gather the updated
    /// parameters ([`Units::gather_all`]), stage 3 refreshes its
    /// persistent units.
    fn gather_updated_params(&mut self) -> Result<()> {
        match self.cx.stage {
            0 => Ok(()),
            3 => self.at_stage3(|s3, io| s3.gather_persistent(io)),
            _ => {
                let overlap = self.cx.cfg.zero.overlap_comm;
                let (units, mut io) = self.gather_parts();
                units.gather_all(overlap, &mut io)
            }
        }
    }

    /// Completes every parameter all-gather still queued or in flight
    /// (before anything reads or writes the parameters as a whole).
    pub(crate) fn finish_param_gathers(&mut self) -> Result<()> {
        let (units, mut io) = self.gather_parts();
        units.finish(&mut io)
    }

    /// Drops the gradients accumulated since the last optimizer step,
    /// those of the current micro-batch included (all ranks must call it
    /// at the same point: it counts as a micro-batch, and a rank that
    /// calls it alone is refused at the next optimizer step on every
    /// rank). After an error in a micro-batch (a gradient buffer dropped
    /// on the way out, `step` refusing a missing gradient) this starts
    /// over: the reductions already in flight are waited for and
    /// discarded. Every gradient buffer must be back (handed back or
    /// dropped).
    pub fn zero_grad(&mut self) -> Result<()> {
        self.guard(Self::zero_grad_inner)
    }

    fn zero_grad_inner(&mut self) -> Result<()> {
        self.check_training("zero_grad")?;
        self.checked(self.reducer.check_none_lent("zero_grad", |j| self.name(j)))?;
        self.progress.drop_micro_batch();
        self.reducer.abort(&self.cx.tracer)
    }
}

impl<C: EngineComm<B>, B: EngineBackend> std::fmt::Debug for Engine<C, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.cx.rank)
            .field("world_size", &self.cx.world)
            .field("stage", &self.cx.stage)
            .field("units", &self.units.len())
            .field("param_dtype", &self.cx.pdt)
            .field("steps", &self.progress.steps())
            .finish()
    }
}
