//! The optimizer step, one type per tier of the optimizer state and the
//! parameters, behind one interface ([`OptimizerStep::run`]) that the
//! coordinator calls once per step with the step's AdamW constants:
//!
//! | tier | type | file |
//! |---|---|---|
//! | state and parameters on the device | [`DeviceStep`] | `device.rs` |
//! | state on the device, parameter shards offloaded (`offload_param` without `offload_optimizer`), AdamW on the host | [`ParamHostStep`] | `param.rs` |
//! | the same, AdamW on a device (two slots down to the homes) | [`ParamDeviceStep`] | `param.rs` |
//! | state in host tiles or nvme tiles (`offload_optimizer` cpu or nvme) | [`TilesStep`] | `tiles.rs` |
//! | nvme tiles with `swap_gradients` (unit by unit) | [`StreamedStep`] | `streamed.rs` |
//!
//! Each type owns its buffers (the pinned staging of a device backend)
//! and its overlap schedule; its doc draws what overlaps what. The tier
//! is chosen once, at build, from the config; every tier gives the same
//! bits (AdamW is elementwise). A step borrows the engine's parts it needs
//! through [`StepIo`] (never the engine itself).
//! [`OptimizerStep::at_boundary`] takes the global norm first
//! ([`global_sum_squares`]: each rank's [`local_sum_squares`], summed over
//! ranks in rank order, once [`check_in_step`] found every rank at the
//! same micro-batch) and unscales and clips it ([`Progress::unscale`]),
//! which also decides whether the update is skipped.

mod device;
mod param;
mod streamed;
mod tiles;

use zero_comm::agree::exchange_u64;
use zero_core::backend::HostAccess;
use zero_core::optim::AdamWStep;
use zero_core::{bf16, f16, DType, Element};

pub(super) use device::DeviceStep;
pub(super) use param::{ParamDeviceStep, ParamHostStep};
pub(super) use streamed::StreamedStep;
pub(super) use tiles::TilesStep;

use super::backend::{EngineBackend, EngineComm};
use super::ctx::Ctx;
use super::gatherer::ParamGatherer;
use super::grad_swap::GradSwap;
use super::health::Health;
use super::optimizer::OptimizerShard;
use super::param_offload::ParamOffload;
use super::progress::{Progress, StepOutcome};
use super::reducer::GradReducer;
use super::staging::{OffloadStage, ParamStepStage};
use super::stats::EngineStats;
use super::unit::{gather_io, AllGatherIo, Units};
use super::warnings::Warnings;
use crate::{Error, Result};

/// What an optimizer step needs from the engine, borrowed for one step:
/// the rank's state and the units' parameters it updates, the parameter
/// offload it writes home, the health its verdicts change, and what the
/// all-gathers it starts need.
pub(super) struct StepIo<'a, C, B: EngineBackend> {
    /// The communicator, the device, the stage, the parameter dtype,
    /// `overlap_comm` (start the all-gathers while AdamW runs), what the
    /// all-gathers need, the tracker and the tracer.
    pub(super) cx: &'a Ctx<C, B>,
    pub(super) units: &'a mut Units<B>,
    pub(super) opt: &'a mut OptimizerShard<B>,
    pub(super) reducer: &'a mut GradReducer<B>,
    /// Stage 3 with `offload_param`: the shards' home.
    pub(super) poff: Option<&'a mut ParamOffload>,
    pub(super) health: &'a mut Health,
    /// The error of a failed swap write every rank rescued: the step
    /// completes and `step()` returns it afterwards.
    pub(super) rescued: Option<Error>,
    /// The number of this step (1 for the first), for errors.
    pub(super) number: u64,
    /// Stage 3: the gatherer whose prefetch starts during the step.
    pub(super) s3: &'a mut ParamGatherer<B>,
    pub(super) stats: &'a mut EngineStats,
}

impl<C: EngineComm<B>, B: EngineBackend> StepIo<'_, C, B> {
    /// Stages 1–2: queues the all-gather of unit `i`'s updated parameters
    /// and launches what fits in `allgather_bucket_size`.
    fn gather_updated(&mut self, i: usize) -> Result<()> {
        self.units.queue_gather(i);
        let mut io = AllGatherIo {
            cx: self.cx,
            stats: self.stats,
        };
        self.units.advance(None, &mut io)
    }

    /// Stage 3: prefetches the head of the recorded gather order.
    fn prefetch_next(&mut self) -> Result<()> {
        let io = gather_io(self.cx, (self.poff.as_deref_mut(), self.units), self.stats);
        self.s3.prefetch_next(io)
    }

    /// With nvme parameter offload, after the write-back of a step (`r`):
    /// every rank learns whether every rank's writes worked. On an error
    /// anywhere the engine is failed and the parameters are lost (some
    /// units were written, others not).
    fn param_write_verdict(&mut self, r: Result<()>) -> Result<()> {
        if !self.poff.as_deref().is_some_and(ParamOffload::is_nvme) {
            return r;
        }
        let number = self.number;
        self.health.params_verdict(&self.cx.comm, r, |bad, why| {
            format!(
                "the parameter swap file of rank {bad} failed in step {number} ({why}); the \
                 parameters are lost"
            )
        })
    }
}

/// The squared global gradient norm of step `number` (1 for the first,
/// skipped steps counted): every rank's [`local_sum_squares`], summed in
/// rank order, exchanged with each rank's count of micro-batches
/// (`micro_batches`), which [`check_in_step`] finds equal first.
fn global_sum_squares<B: EngineBackend, C: EngineComm<B>>(
    comm: &C,
    backend: &B,
    opt: &OptimizerShard<B>,
    reducer: &GradReducer<B>,
    number: u64,
    micro_batches: u64,
) -> Result<f64> {
    let local = local_sum_squares(opt, backend, reducer)?;
    let parts = exchange_u64(comm, &[local.to_bits(), micro_batches])?;
    check_in_step(&parts, comm.rank(), number)?;
    Ok(parts.iter().fold(0f64, |a, w| a + f64::from_bits(w[0])))
}

/// This rank's part of the squared gradient norm: its shard of every
/// unit, in unit order (stage 0 too, so that every stage adds the same
/// terms); 0 without trainable tensors.
fn local_sum_squares<B: EngineBackend>(
    opt: &OptimizerShard<B>,
    backend: &B,
    reducer: &GradReducer<B>,
) -> Result<f64> {
    match reducer.home_dtype() {
        None => Ok(0.0),
        Some(_) if reducer.grad_swap().is_some() => {
            Ok(reducer.grad_swap().map_or(0.0, GradSwap::sum_squares))
        }
        Some(DType::F32) => opt.local_sum_squares::<f32>(backend, reducer),
        Some(DType::BF16) => opt.local_sum_squares::<bf16>(backend, reducer),
        Some(DType::F16) => opt.local_sum_squares::<f16>(backend, reducer),
    }
}

/// Every rank is at the same micro-batch (word 1 of each rank's part of
/// the norm exchange, `parts`): a rank that failed a micro-batch,
/// dropped it with `zero_grad` and went on alone has paired its
/// reductions with the other ranks' previous micro-batch. Then every
/// rank refuses the update with the same error, naming the first rank
/// off the majority (ties: rank 0's count) and both counts; the counts
/// stay apart, so every later step is refused too.
fn check_in_step(parts: &[Vec<u64>], rank: usize, step: u64) -> Result<()> {
    let count = |v: u64| parts.iter().filter(|w| w[1] == v).count();
    let mut common = parts[0][1];
    for w in parts {
        if count(w[1]) > count(common) {
            common = w[1];
        }
    }
    let Some(off) = parts.iter().position(|w| w[1] != common) else {
        return Ok(());
    };
    let at = parts.iter().position(|w| w[1] == common).unwrap_or(0);
    Err(Error::Disagreement {
        rank,
        what: format!(
            "step {}: rank {off} is at micro-batch {} and rank {at} at micro-batch {common} \
             (micro-batches ended by step() or dropped by zero_grad()): rank {off} went on \
             alone after a failed micro-batch, so this step's reductions paired gradients \
             of different micro-batches and its update was not applied; every rank must \
             drop a failed micro-batch together (zero_grad() on every rank), so restart \
             from the last checkpoint",
            step, parts[off][1]
        ),
    })
}

/// One tier's optimizer step: AdamW with the constants `k` (one per
/// parameter group) on this rank's part of every unit, gradients in `G`,
/// parameters written in `P`.
pub(super) trait TierStep<B: EngineBackend> {
    /// Runs the step on the engine's parts `io`.
    fn run<C: EngineComm<B>, G: Element, P: Element>(
        &mut self,
        io: &mut StepIo<'_, C, B>,
        k: &[AdamWStep],
    ) -> Result<()>;
}

/// The optimizer step of an engine: the tier its config chose.
pub(super) enum OptimizerStep<B: HostAccess> {
    /// See [`DeviceStep`].
    Device(DeviceStep),
    /// See [`ParamHostStep`].
    ParamHost(ParamHostStep),
    /// See [`ParamDeviceStep`].
    ParamDevice(ParamDeviceStep<B>),
    /// See [`TilesStep`].
    Tiles(TilesStep<B>),
    /// See [`StreamedStep`].
    Streamed(StreamedStep),
}

impl<B: EngineBackend> OptimizerStep<B> {
    /// The tier for an engine with (or without) the optimizer state
    /// offloaded, `swap_gradients`, the parameter shards offloaded, and
    /// the staging a device backend needs for them.
    pub(super) fn new(
        optimizer_offload: bool,
        swap_gradients: bool,
        param_offload: bool,
        offload_stage: Option<OffloadStage<B>>,
        param_stage: Option<ParamStepStage<B>>,
    ) -> Self {
        if optimizer_offload {
            if swap_gradients {
                return Self::Streamed(StreamedStep);
            }
            return Self::Tiles(TilesStep {
                stage: offload_stage,
            });
        }
        if param_offload {
            return match param_stage {
                Some(stage) => Self::ParamDevice(ParamDeviceStep { stage }),
                None => Self::ParamHost(ParamHostStep),
            };
        }
        Self::Device(DeviceStep)
    }

    /// The optimizer step that ends `progress`'s window (update number
    /// `io.number` if applied): the global norm ([`global_sum_squares`]),
    /// unscaled and clipped ([`Progress::unscale`]), then AdamW at this
    /// step's learning rate unless the update is skipped (with a warning
    /// when no fp16 scaler skipped it). Returns what the step did; a
    /// failed swap write that every rank rescued is left in `io.rescued`.
    pub(super) fn at_boundary<C: EngineComm<B>>(
        &mut self,
        io: &mut StepIo<'_, C, B>,
        progress: &mut Progress,
        warnings: &mut Warnings,
    ) -> Result<StepOutcome> {
        let (number, counted) = (progress.global_steps() + 1, progress.micro_batches());
        let (cx, next) = (io.cx, io.number);
        let (comm, backend) = (&cx.comm, &cx.backend);
        let sumsq = global_sum_squares(comm, backend, io.opt, io.reducer, number, counted)?;
        let lr = cx.cfg.scheduler.lr_at(progress.steps());
        let norm = progress.unscale(sumsq, cx.world, cx.cfg.gradient_clipping);
        if norm.overflow && progress.scaler().is_none() {
            warnings.give(format!(
                "step {next}: the gradient norm is not finite; the update was skipped"
            ));
        }
        if let Some(grad_scale) = norm.grad_scale {
            let ks = io.opt.steps(&cx.cfg.optimizer, lr, next, grad_scale);
            self.run(io, &ks)?;
            progress.applied();
        }
        Ok(progress.boundary(&norm, lr))
    }

    /// AdamW on this rank's part of every unit, writing the updated
    /// parameters in the parameter dtype (nothing without trainable
    /// tensors).
    fn run<C: EngineComm<B>>(&mut self, e: &mut StepIo<'_, C, B>, k: &[AdamWStep]) -> Result<()> {
        let Some(gdt) = e.reducer.home_dtype() else {
            return Ok(());
        };
        match self {
            Self::Device(t) => for_dtypes(t, e, gdt, k),
            Self::ParamHost(t) => for_dtypes(t, e, gdt, k),
            Self::ParamDevice(t) => for_dtypes(t, e, gdt, k),
            Self::Tiles(t) => for_dtypes(t, e, gdt, k),
            Self::Streamed(t) => for_dtypes(t, e, gdt, k),
        }
    }
}

/// `t`'s step for gradient dtype `gdt` and the engine's parameter dtype.
fn for_dtypes<B: EngineBackend, C: EngineComm<B>, T: TierStep<B>>(
    t: &mut T,
    e: &mut StepIo<'_, C, B>,
    gdt: DType,
    k: &[AdamWStep],
) -> Result<()> {
    match gdt {
        DType::F32 => for_params::<B, C, T, f32>(t, e, k),
        DType::BF16 => for_params::<B, C, T, bf16>(t, e, k),
        DType::F16 => for_params::<B, C, T, f16>(t, e, k),
    }
}

fn for_params<B: EngineBackend, C: EngineComm<B>, T: TierStep<B>, G: Element>(
    t: &mut T,
    e: &mut StepIo<'_, C, B>,
    k: &[AdamWStep],
) -> Result<()> {
    match e.cx.pdt {
        DType::F32 => t.run::<C, G, f32>(e, k),
        DType::BF16 => t.run::<C, G, bf16>(e, k),
        DType::F16 => t.run::<C, G, f16>(e, k),
    }
}

/// Writes back host views of device buffers ([`HostAccess::commit`]).
fn commit_all<B: HostAccess, T: Element>(backend: &B, views: Vec<B::HostMut<'_, T>>) -> Result<()> {
    for v in views {
        backend.commit(v)?;
    }
    Ok(())
}
