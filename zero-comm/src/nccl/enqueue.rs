//! [`Launch`]: one checked collective with its device addresses, and the
//! raw NCCL calls that enqueue launches: results mapped to `Ok` or the
//! failing call, and `ncclGroupStart`/`ncclGroupEnd` around a group.
//!
//! ```text
//!  Launch { coll, plan (counts, dtype), reduce, send, recv }
//!     │ enqueue: ncclAllReduce / ncclReduceScatter / ncclAllGather
//!     ▼
//!  grouped(|| ncclGroupStart ─ enqueue(l1) ─ enqueue(l2) ... ─ ncclGroupEnd)
//!     ──▶ Ok, or Err((call, result)) of the first failing call
//! ```
//!
//! The batch (`batch.rs`) and the validation exchange (`validate.rs`) both
//! enqueue through here; neither knows the other's internals.

use std::ffi::c_void;

use cudarc::nccl::sys;

use super::check::{Coll, Plan};
use super::ffi::{self, api};
use crate::ReduceOp;

/// One checked collective, with device addresses, ready to enqueue.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub name: &'static str,
    pub plan: Plan,
    pub reduce: Option<ReduceOp>,
    /// Device address NCCL reads from (offset applied).
    pub send: u64,
    /// Device address NCCL writes to (offset applied).
    pub recv: u64,
}

/// A failed NCCL call: its name and result.
pub(crate) type CallError = (&'static str, sys::ncclResult_t);

/// `Ok` for `ncclSuccess` and `ncclInProgress` (a non-blocking
/// communicator goes on in NCCL's threads: poll it).
pub(crate) fn ok_or(
    call: &'static str,
    r: sys::ncclResult_t,
) -> std::result::Result<(), CallError> {
    match r {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        _ => Err((call, r)),
    }
}

/// Runs `enqueue` between `ncclGroupStart` and `ncclGroupEnd` (the end
/// always runs, so this thread's group is closed whatever happens); the
/// first failing call.
pub(crate) fn grouped(
    enqueue: impl FnOnce() -> std::result::Result<(), CallError>,
) -> std::result::Result<(), CallError> {
    // SAFETY: ncclGroupStart takes no arguments and opens a group on this
    // thread; the library and symbol are present (a communicator exists).
    ok_or("ncclGroupStart", unsafe { api::ncclGroupStart() })?;
    let r = enqueue();
    // SAFETY: closes the group opened above, on the same thread.
    let end = ok_or("ncclGroupEnd", unsafe { api::ncclGroupEnd() });
    r.and(end)
}

/// Enqueues one collective.
///
/// # Safety
/// `raw` is a live communicator whose lock the caller holds; `l.send` and
/// `l.recv` are device addresses on its GPU valid for the counts of
/// `l.plan`, and stay valid until the collective completes; `stream`
/// belongs to that GPU.
pub(crate) unsafe fn enqueue(
    l: &Launch,
    raw: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> std::result::Result<(), CallError> {
    let dt = ffi::data_type(l.plan.dtype);
    let op = ffi::red_op(l.reduce.unwrap_or(ReduceOp::Sum));
    let (send, recv) = (l.send as *const c_void, l.recv as *mut c_void);
    let n = l.plan.count;
    // SAFETY: forwarded from the caller.
    unsafe {
        match l.plan.coll {
            Coll::AllReduce => ok_or(
                "ncclAllReduce",
                api::ncclAllReduce(send, recv, n, dt, op, raw, stream),
            ),
            Coll::ReduceScatter => ok_or(
                "ncclReduceScatter",
                api::ncclReduceScatter(send, recv, n, dt, op, raw, stream),
            ),
            Coll::AllGather => ok_or(
                "ncclAllGather",
                api::ncclAllGather(send, recv, n, dt, raw, stream),
            ),
        }
    }
}
