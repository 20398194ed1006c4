//! Memory tiers of `zero`: pinned host memory and NVMe for AdamW state and
//! stage-3 parameters (ZeRO-Offload / ZeRO-Infinity).
//!
//! This crate is a member of the workspace so that the dependency graph of
//! `../DESIGN.md` holds from the start; its tiers land with the offload
//! issue and are not part of the documented API yet.

pub use zero_core::{Device, Error, Result};
