//! `zero`: ZeRO-style sharded data-parallel training in Rust.
//!
//! The [`Engine`] partitions parameters, gradients and AdamW state across
//! the ranks of a [`comm::Communicator`] per ZeRO stage (0–3); see
//! [`engine`] for the data flow and the arithmetic every stage shares.
//!
//! The facade also re-exports the workspace crates:
//! - [`core`] (`zero-core`): dtypes, devices, buffers, partition plan,
//!   memory tracker, DeepSpeed-compatible config, reference AdamW;
//! - [`comm`] (`zero-comm`): the [`comm::Communicator`] trait and its threads
//!   and MPI backends, bucketing, timeouts;
//! - [`offload`] (`zero-offload`): memory tiers, a pinned host pool and NVMe
//!   swap files, which the engine uses for `offload_optimizer`.
#![deny(unsafe_op_in_unsafe_fn)]

mod agree;
pub mod doctor;
pub mod engine;
mod error;
pub mod estimate;
mod format;
mod host;
mod plan;
pub(crate) mod schedule;
pub mod trace;

pub use engine::{
    is_bias_norm_or_embedding, Engine, EngineBackend, EngineBuilder, EngineComm, EngineStats,
    GradBuffer, GroupPredicate, Init, ParamGroup, StepOutcome, SwapTraffic, TensorSource,
    UnitGuard, UnitId, UnitState,
};
pub use error::{Error, Result};
pub use trace::Tracer;
pub use zero_comm as comm;
pub use zero_core as core;
pub use zero_offload as offload;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
