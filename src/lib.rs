//! `zero`: ZeRO-style sharded data-parallel training in Rust.
//!
//! The facade re-exports the workspace crates:
//! - [`core`] (`zero-core`): dtypes, devices, buffers, errors;
//! - [`comm`] (`zero-comm`): the [`comm::Communicator`] trait and its threads
//!   and MPI backends, bucketing, timeouts;
//! - [`offload`] (`zero-offload`): memory tiers (lands with the offload issue).

pub use zero_comm as comm;
pub use zero_core as core;
pub use zero_offload as offload;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
