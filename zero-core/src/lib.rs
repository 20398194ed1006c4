//! Foundations of `zero`, the ZeRO-style sharded data-parallel training library.
//!
//! This crate knows nothing about MPI, NCCL or files. It provides what every
//! other crate of the workspace builds on:
//!
//! - [`DType`] and the [`Element`] trait: the element types that parameters,
//!   gradients and communication buffers use (`f32`, `bf16`, `f16`), with the
//!   f32 conversions that reductions accumulate in.
//! - [`Device`]: `Cpu` and `Cuda`. Both variants exist in every build; without
//!   the `cuda` feature, or without a usable driver, creating a CUDA device
//!   returns [`Error::NotCompiledWith`] or [`Error::NoDevice`] instead of
//!   panicking.
//! - [`HostBuffer`]: an aligned host allocation that owns its elements, the
//!   unit of data that moves through collectives.
//! - [`backend`]: the device backend seam (typed buffers, four streams,
//!   events, the engine's primitives) and the CPU backend with its hazard
//!   checker.
//! - [`partition`]: the partition plan (units of named tensors, padded so
//!   that each splits into `world_size` equal, aligned shards).
//! - [`memory`]: the memory tracker (per tier and category, current and
//!   peak bytes).
//! - [`config`]: DeepSpeed-compatible configuration with validation.
//! - [`optim`]: the reference AdamW, learning-rate schedules, gradient-norm
//!   and clipping, and the dynamic loss scaler.
//! - [`Error`] and [`Result`]: the one error type of this crate.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod backend;
mod buffer;
pub mod config;
pub mod cuda;
mod device;
mod dtype;
mod error;
pub mod memory;
pub mod optim;
pub mod partition;

pub use buffer::{HostBuffer, BUFFER_ALIGN};
pub use device::{CudaDevice, Device};
pub use dtype::{convert, DType, Element};
pub use error::{Error, Result};

/// Re-exported so that users name `bf16`/`f16` through one path.
pub use half::{bf16, f16};
