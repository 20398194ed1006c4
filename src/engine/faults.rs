//! Fault injection into the swap files, for tests of the error paths:
//! [`EngineBuilder::swap_faults`](super::EngineBuilder::swap_faults) and
//! [`EngineBuilder::param_swap_faults`](super::EngineBuilder::param_swap_faults),
//! with the feature `testing` only. Without it the builder's fault fields
//! hold an uninhabited [`FaultPlan`], so they are always `None` and no fault
//! path is compiled.

use zero_offload::SwapOptions;

#[cfg(feature = "testing")]
pub(crate) use zero_offload::FaultPlan;

/// Stands in for zero-offload's `FaultPlan` without the feature `testing`:
/// a type with no values.
#[cfg(not(feature = "testing"))]
#[derive(Clone, Debug)]
pub(crate) enum FaultPlan {}

/// Puts `faults`, if any, into a swap file's options.
#[cfg(feature = "testing")]
pub(crate) fn set_faults(options: &mut SwapOptions, faults: Option<FaultPlan>) {
    if let Some(f) = faults {
        options.faults = f;
    }
}

/// Puts `faults`, if any, into a swap file's options: there are none
/// without the feature `testing`.
#[cfg(not(feature = "testing"))]
pub(crate) fn set_faults(_: &mut SwapOptions, faults: Option<FaultPlan>) {
    if let Some(never) = faults {
        match never {}
    }
}
