//! The MPI backend ([`MpiComm`], feature `mpi`): ranks as processes
//! started by `mpirun`/`srun`.
//!
//! # Architecture
//!
//! ```text
//!  node A                                              node B
//!  ┌───────────────────────────────────────────┐       ┌──────────────────┐
//!  │ rank 0 process        rank 1 process      │       │ rank 2   rank 3  │
//!  │  user thread ─┐        user thread ─┐     │       │   ...            │
//!  │  progress ◀───┘ Work   progress ◀───┘     │       │                  │
//!  │  thread: all MPI calls, shm rounds        │       │                  │
//!  │      │                    │              │  MPI  │                  │
//!  │  ┌───▼────────────────────▼───────────┐  │◀─────▶│  (same layout)   │
//!  │  │ MPI-3 shared window (/dev/shm):    │  │       │                  │
//!  │  │ control slots | pool 0 | pool 1    │  │       │                  │
//!  │  └────────────────────────────────────┘  │       │                  │
//!  └───────────────────────────────────────────┘       └──────────────────┘
//! ```
//!
//! - Within a node (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`), MPI's
//!   collectives are not used: the ranks run the shared-memory protocol of
//!   [`crate::shm`] over control slots in one shared window, reading and
//!   writing each other's buffers directly with the algorithms the threads
//!   backend uses ([`window`] maps addresses between processes).
//! - Buffers from [`Communicator::alloc`](crate::Communicator::alloc) are
//!   carved out of this rank's segment of a second shared window ([`pool`]),
//!   so collectives on them copy nothing. Other buffers are staged through
//!   a bounded bounce region, chunk by chunk ([`staged`]).
//! - Across nodes, all-reduce is hierarchical ([`hier`]) when every node
//!   has the same number of ranks; everything else uses MPI's non-blocking
//!   collectives with a timeout ([`net`]).
//! - Every MPI call after set-up happens on the rank's progress thread
//!   ([`engine`] runs there), so `MPI_THREAD_SERIALIZED` suffices; MPI's
//!   lifetime is in [`runtime`], the FFI in [`raw`].
//!
//! # Reduction order
//!
//! Within one node, results are bit-identical to
//! [`reference_reduce`](crate::reference_reduce) (f32 accumulation in rank
//! order), as with the threads backend. Across nodes, bf16/f16 are reduced
//! in f32 and rounded once, but the order differs: hierarchically, each
//! node's ranks first (in rank order), then the node partials in MPI's
//! order; on the flat MPI path, in MPI's order. For two nodes the node
//! partials meet in one f32 addition, whose result does not depend on the
//! order. Max never depends on the order.
//!
//! # Failures
//!
//! Within a node, as for threads: timeouts name the collective, its number
//! and the ranks that arrived; mismatches are always detected (descriptors
//! in the control slots); a peer that failed or left is seen in its slot,
//! and one whose process died (checked with `kill(pid, 0)`) turns into
//! [`Error::PeerFailed`](crate::Error::PeerFailed) within milliseconds.
//! Across nodes, MPI waits are bounded by the timeout, mismatches are
//! detected with [`CommOptions::validate`](crate::CommOptions::validate),
//! and failures are announced to the other nodes ([`net`]).
//!
//! # Environment
//!
//! - `ZERO_MPI_SHM_POOL`: pool bytes per rank (`512M`, `2G`, ...; default
//!   1 GiB of address space, backed by pages only as buffers use them).
//! - `ZERO_MPI_SIMULATE_NODES=k`: splits each node into k pseudo-nodes of
//!   consecutive ranks, to run the multi-node paths on one machine.

#[cfg(feature = "mpi")]
mod comm;
#[cfg(feature = "mpi")]
mod engine;
#[cfg(feature = "mpi")]
mod hier;
#[cfg(feature = "mpi")]
mod net;
#[cfg(feature = "mpi")]
mod pool;
#[cfg(feature = "mpi")]
mod raw;
#[cfg(feature = "mpi")]
mod runtime;
#[cfg(feature = "mpi")]
mod staged;
#[cfg(feature = "mpi")]
mod upcast;
#[cfg(feature = "mpi")]
mod window;

#[cfg(not(feature = "mpi"))]
mod dummy;

#[cfg(feature = "mpi")]
pub use comm::MpiComm;

/// The MPI library's version string (`MPI_Get_library_version`, which may
/// be called before `MPI_Init`), e.g. for `zero doctor`; empty when the
/// library reports an error.
#[cfg(feature = "mpi")]
pub fn library_version() -> String {
    raw::library_version()
}
#[cfg(not(feature = "mpi"))]
pub use dummy::MpiComm;
