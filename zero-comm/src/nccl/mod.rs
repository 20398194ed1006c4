//! The NCCL backend ([`NcclComm`], feature `cuda`): collectives on device
//! buffers through `cudarc::nccl`.
//!
//! # Architecture
//!
//! ```text
//!  bootstrap (once)                         each collective
//!  ───────────────                          ───────────────
//!  rank 0: ncclGetUniqueId ─┐               user thread
//!                           │ 128 bytes       │ check arguments (no GPU work yet)
//!     threads: NcclGroup    │                 │ lock comm ─ [validate] ─ ncclGroupStart
//!     holds it for all      │                 │   ncclAllReduce / ReduceScatter / AllGather
//!     MPI: Communicator::   ▼                 │ ncclGroupEnd ─ poll until enqueued ─ unlock
//!     broadcast from 0 ──▶ every rank         │ record event on the communication stream
//!                           │                 ▼
//!  ncclCommInitRankConfig(blocking = 0)     NcclWork ──wait()──▶ poll event and
//!  poll ncclCommGetAsyncError ≤ timeout                        ncclCommGetAsyncError
//!  expired or failed: ncclCommAbort                            ≤ timeout, else abort
//! ```
//!
//! - One [`NcclComm`] per rank, each on its own GPU, with the rank's
//!   communication stream (a `cudarc::driver::CudaStream` of that GPU).
//!   Ranks are threads of one process ([`NcclGroup`] creates the NCCL id
//!   once and shares it) or processes under `mpirun`
//!   (`NcclComm::from_communicator` broadcasts the id from rank 0 with
//!   any host [`Communicator`](crate::Communicator), e.g. MPI's).
//! - Collectives (`NcclComm::all_reduce`, `NcclComm::reduce_scatter`,
//!   `NcclComm::all_gather` and their in-place forms; `collectives.rs`
//!   draws each one's data movement) borrow `CudaSlice`s or views of f32,
//!   bf16 or f16, are enqueued on the communication stream and return a
//!   `#[must_use]` `NcclWork`. cudarc's stream tracking orders them after
//!   the buffers' last writes on other streams and orders later users after
//!   them, so no stream needs to be synchronized by hand.
//! - `NcclComm::group` batches several bucket collectives into one
//!   `ncclGroupStart`/`ncclGroupEnd` (one launch, one event).
//! - On the CUDA backend's buffers, as the engine uses it: `NcclComm`
//!   implements [`DeviceCollectives`](crate::DeviceCollectives) over
//!   zero-core's `CudaBackend` on the backend's own
//!   communication stream (`NcclComm::for_backend`), ordered by its events
//!   with no cudarc tracking, in place, equal parts per rank; the host
//!   waits, bounded, with `NcclComm::sync_event` (`device.rs`). Several
//!   ranks on one GPU use [`HostStaged`](crate::HostStaged) instead.
//!
//! # One GPU per rank
//!
//! NCCL refuses two ranks of one communicator on the same GPU: up to 2.29
//! always ("Duplicate GPU detected", `ncclInvalidUsage`; NVIDIA/nccl#1241:
//! "launch multiple NCCL ranks on the same CUDA device, which NCCL doesn't
//! support"); from 2.30 only unless `NCCL_MULTI_RANK_GPU_ENABLE=1`
//! (experimental, "up to 2 ranks per GPU" with the default configuration,
//! a hang when the GPU lacks resources). [`NcclGroup::new`] checks this
//! before anything starts and says so. In-process tests therefore run one
//! rank per GPU: world size 1 on a single GPU.
//!
//! # Precision: the bf16 choice
//!
//! NCCL reduces in the buffer's own type: bf16 pairs are added with
//! `__hadd` on sm_80+ (and through f32 with a rounding per addition on
//! older GPUs), so a bf16 sum over N ranks is rounded N − 1 times, in an
//! order NCCL chooses (ring or tree), instead of once in rank order as on
//! the host backends ([`crate::reference_reduce`]).
//!
//! **zero's choice: gradients are reduced as fp32 buckets.** The engine
//! accumulates each bf16 gradient into its fp32 bucket on the compute
//! stream, and the bucket is reduce-scattered (or all-reduced) as f32:
//! twice the bytes of a bf16 reduction, but one accumulation precision on
//! every backend (DESIGN: "reductions of gradients run in fp32 by
//! default"), and no extra conversion pass on the communication stream.
//! bf16 and f16 collectives remain available: all-gathers of bf16
//! parameters (no arithmetic: exact) and reductions for users who opt into
//! bf16 communication (DeepSpeed's `communication_data_type: "bf16"`),
//! accepting the N − 1 roundings.
//!
//! Further differences from the host backends, all NCCL's semantics:
//! - Sums are bit-identical to [`crate::reference_reduce`] for 1 and 2
//!   ranks; beyond, f32 addition order follows NCCL's algorithm (the same
//!   from run to run for a fixed topology, message size and NCCL
//!   configuration).
//! - [`ReduceOp::Avg`](crate::ReduceOp::Avg) multiplies each input by
//!   1/N (rounded to the element type) before summing: exact for N a power
//!   of two, within a rounding otherwise.
//! - [`ReduceOp::Max`](crate::ReduceOp::Max) uses `fmaxf`: a NaN does *not*
//!   propagate when another rank has a number. Reduce overflow *flags*
//!   (0 or 1), not the values themselves.
//!
//! # Failures
//!
//! Every wait is bounded by [`CommOptions::timeout`](crate::CommOptions):
//! initialization is non-blocking (`ncclCommInitRankConfig` with
//! `blocking = 0`, then `ncclCommGetAsyncError` is polled), and so are
//! enqueueing and completion. When the time is up, or NCCL reports an
//! asynchronous error, the communicator is aborted (`ncclCommAbort`, which
//! also stops its kernels) and the call returns
//! [`Error::Timeout`](crate::Error::Timeout) (NCCL cannot tell which ranks
//! are missing: every other rank is listed) or an [`NcclError`] naming the
//! rank, the operation and NCCL's own message. Later calls get
//! [`Error::Poisoned`](crate::Error::Poisoned). Ranks that call different
//! collectives hang inside NCCL until the timeout; with
//! [`CommOptions::validate`](crate::CommOptions) each launch first
//! all-gathers a descriptor of what every rank is about to run and fails
//! with [`Error::Mismatch`](crate::Error::Mismatch) instead (one small
//! collective and a host round trip per launch: a debugging aid).
//!
//! A missing `libnccl` is an error, never a panic (cudarc panics when a
//! dynamically loaded library or symbol is missing, so the library, its
//! version (≥ 2.14) and every symbol used are checked first). cudarc looks
//! for `libnccl.so` (not `libnccl.so.2`, which the runtime packages ship):
//! install the development package or put a `libnccl.so` link on
//! `LD_LIBRARY_PATH`.
//!
//! Without the `cuda` feature the same names exist ([`NcclComm`],
//! [`NcclGroup`], [`NcclId`]) and creating them returns
//! [`zero_core::Error::NotCompiledWith`]`("cuda")`.

mod check;
mod error;
mod id;

#[cfg(feature = "cuda")]
mod batch;
#[cfg(feature = "cuda")]
mod collectives;
#[cfg(feature = "cuda")]
mod comm;
#[cfg(feature = "cuda")]
mod describe;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod enqueue;
#[cfg(feature = "cuda")]
mod ffi;
#[cfg(feature = "cuda")]
mod group;
#[cfg(feature = "cuda")]
mod validate;
#[cfg(feature = "cuda")]
mod work;

#[cfg(not(feature = "cuda"))]
mod dummy;

pub use error::{NcclError, NcclFailure};
pub use id::NcclId;

#[cfg(feature = "cuda")]
pub use batch::NcclBatch;
#[cfg(feature = "cuda")]
pub use comm::NcclComm;
#[cfg(feature = "cuda")]
pub use ffi::{opened, version};
#[cfg(feature = "cuda")]
pub use group::NcclGroup;
#[cfg(feature = "cuda")]
pub use work::NcclWork;

#[cfg(not(feature = "cuda"))]
pub use dummy::{opened, version, NcclComm, NcclGroup};
