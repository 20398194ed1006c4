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
//! bits (AdamW is elementwise).

mod device;
mod param;
mod streamed;
mod tiles;

use zero_core::backend::HostAccess;
use zero_core::optim::AdamWStep;
use zero_core::{bf16, f16, DType, Element};

pub(super) use device::DeviceStep;
pub(super) use param::{ParamDeviceStep, ParamHostStep};
pub(super) use streamed::StreamedStep;
pub(super) use tiles::TilesStep;

use super::staging::{OffloadStage, ParamStepStage};
use super::{Engine, EngineBackend, EngineComm};
use crate::Result;

/// One tier's optimizer step: AdamW with the constants `k` (one per
/// parameter group) on this rank's part of every unit, gradients in `G`,
/// parameters written in `P`.
pub(super) trait TierStep<B: EngineBackend> {
    /// Runs the step on the engine `e`'s parts.
    fn run<C: EngineComm<B>, G: Element, P: Element>(
        &mut self,
        e: &mut Engine<C, B>,
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

    /// AdamW on this rank's part of every unit, writing the updated
    /// parameters in the parameter dtype (nothing without trainable
    /// tensors).
    pub(super) fn run<C: EngineComm<B>>(
        &mut self,
        e: &mut Engine<C, B>,
        k: &[AdamWStep],
    ) -> Result<()> {
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
    e: &mut Engine<C, B>,
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
    e: &mut Engine<C, B>,
    k: &[AdamWStep],
) -> Result<()> {
    match e.pdt {
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
