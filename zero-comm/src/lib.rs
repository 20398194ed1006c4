//! Collective communication for `zero`.
//!
//! One small trait, [`Communicator`], with asynchronous collectives
//! (all-reduce, reduce-scatter, all-gather, broadcast, barrier) on f32,
//! bf16 and f16 [`HostBuffer`](zero_core::HostBuffer)s, an all-gather of
//! raw bytes ([`Communicator::all_gather_bytes`]) for the small agreements
//! among ranks in [`agree`] (every rank's bytes or u64 words, the first
//! rank that failed), and backends:
//!
//! - [`ThreadGroup`] / [`ThreadComm`]: N ranks as threads of one process
//!   (the embedded default). Collectives read the peers' memory directly.
//! - MPI (feature `mpi`): ranks as processes started by `mpirun`/`srun`.
//!   Within a node they use the same shared-memory algorithms through an
//!   MPI-3 shared window; between nodes, MPI's own collectives.
//! - [`NcclComm`] (feature `cuda`): collectives on device buffers through
//!   NCCL, one rank per GPU; the NCCL id is shared in memory
//!   ([`NcclGroup`]) or broadcast over a host communicator such as MPI's.
//!   See [`nccl`].
//!
//! [`DeviceCollectives`] runs the same collectives on a device backend's
//! buffers, ordered by its events (see [`device`]): over the CPU backend
//! through any host communicator, and over any backend (several ranks on
//! one GPU) through pinned host staging buffers ([`HostStaged`]).
//!
//! How a collective runs within a node (both backends): [`shm`] describes
//! the two-phase protocol, and each algorithm has its own file with a
//! diagram of its data movement.
//!
//! Failure behaviour: every wait has a timeout ([`CommOptions::timeout`]);
//! a missing rank gives [`Error::Timeout`] naming the collective, its
//! sequence number and the ranks that arrived; ranks that call different
//! collectives get [`Error::Mismatch`] saying what each called; a failed or
//! departed peer gives [`Error::PeerFailed`]. None of them hangs.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod agree;
pub mod bucket;
mod communicator;
mod counts;
pub mod device;
mod error;
mod exec;
mod launch;
mod mpi;
pub mod nccl;
mod op;
mod options;
pub mod paired;
mod reduce;
pub mod shm;
pub mod staged;
mod threads;
mod work;

pub use bucket::{shard_len, shard_range, Bucket, BucketLayout, BucketPlan, Bucketer};
pub use communicator::{Communicator, RawOp};
pub use counts::{even_counts, offsets};
pub use device::{DeviceCollectives, DeviceWork};
pub use error::{Error, Result};
pub use launch::{launch, launched_by_mpi, Comm};
#[cfg(feature = "mpi")]
pub use mpi::library_version as mpi_library_version;
pub use mpi::MpiComm;
pub use nccl::{NcclComm, NcclGroup, NcclId};
pub use options::CommOptions;
pub use paired::Paired;
pub use reduce::{reference_reduce, ReduceOp};
pub use staged::HostStaged;
pub use threads::{ThreadComm, ThreadGroup};
pub use work::{OpTiming, Work};
