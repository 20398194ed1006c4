//! Memory tiers of `zero`: host memory and NVMe for AdamW state and
//! stage-3 parameters (ZeRO-Offload / ZeRO-Infinity).
//!
//! Two storage tiers, which the engine builds at start-up from its memory
//! plan and then uses without allocating:
//!
//! - [`host`]: a [`HostPool`] of page-aligned, pre-faulted, huge-page advised
//!   buffers, optionally locked (`pin_memory`), lent out and given back
//!   (RAII). The CUDA backend will register them with the driver through a
//!   [`PinRegistrar`](host::PinRegistrar).
//! - [`nvme`]: a per-rank [`SwapFile`] of named, block-aligned regions (a
//!   sub-group tile's fp32 master, `m`, `v`; a parameter shard), read and
//!   written with `O_DIRECT` by a pool of I/O threads. Requests are
//!   asynchronous ([`IoTicket`]): buffers move into a request and come back
//!   when it is waited on, so a caller pipelines reads, compute and writes.
//!   Every block carries a CRC32; truncation, corruption, a foreign header, a
//!   deleted file and write failures are errors that name the file, the
//!   region and the offset, never garbage data.
//!
//! ```text
//!   device  <-- copies (engine) -->  HostPool buffers  <-- SwapFile (O_DIRECT) -->  NVMe
//!                                    (pinned, reused)       I/O threads, CRC32
//! ```
//!
//! The memory both tiers hold is reported for the engine's
//! [`MemoryTracker`](zero_core::memory::MemoryTracker):
//! [`HostPool::account`] and [`SwapFile::account`].
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
pub mod nvme;
pub mod space;

pub use host::{AlignedBuf, HostPool, HostPoolOptions, PooledBuffer};
#[cfg(feature = "testing")]
pub use nvme::FaultPlan;
pub use nvme::{IoBuffer, IoError, IoTicket, RegionId, RegionSpec, SwapFile, SwapOptions};
pub use space::{check_free_space, free_space, leftover_swap_files, DiskNeed, FreeSpace};
pub use zero_core::{Device, Error, Result};
