//! [`CommOptions::validate`](crate::CommOptions::validate) for NCCL: before
//! a launch, every rank publishes what it is about to run, so ranks that
//! call different collectives get [`Error::Mismatch`] instead of a hang.
//!
//! ```text
//!  rank r: [ ops | header | len | hash ]  ──htod──▶ scratch[r]
//!          ncclAllGather (in place, 4 × u64 per rank)  ──▶ scratch[0..w]
//!          ──dtoh──▶ every rank compares all w rows with its own
//! ```
//!
//! Each step's wait is bounded: the stream is drained with a timeout
//! before the copies (a copy from pageable memory may wait for the stream
//! without one), and the all-gather is waited for like any collective.

use cudarc::driver::CudaSlice;
use cudarc::nccl::sys;

use super::comm::{call_failure_of, NcclComm, State};
use super::describe::{compare, words, WORDS};
use super::enqueue::{grouped, ok_or, Launch};
use super::ffi::api;
use crate::{Error, Result};

/// Exchanges the descriptors of `ops` and compares them (under the
/// communicator's lock `st`).
pub(crate) fn exchange(
    comm: &NcclComm,
    st: &mut State,
    ops: &[Launch],
    op: &'static str,
    seq: u64,
) -> Result<()> {
    let Some(mut scratch) = st.scratch.take() else {
        return Ok(());
    };
    let r = run(comm, st, &mut scratch, ops, op, seq);
    st.scratch = Some(scratch);
    if let Err(e) = &r {
        // A failed copy leaves the peers inside the exchange: fail (and
        // abort) so that no rank waits for this one.
        comm.fail_locked(st, &e.to_string());
    }
    r
}

fn run(
    comm: &NcclComm,
    st: &mut State,
    scratch: &mut CudaSlice<u64>,
    ops: &[Launch],
    op: &'static str,
    seq: u64,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    let drain = |st: &mut State| -> Result<()> {
        let ev = stream
            .record_event(None)
            .map_err(|e| comm.cuda_error(op, "cuEventRecord", e))?;
        comm.wait_event(Some(st), &ev, op, seq)
    };
    drain(st)?;
    let mine = words(ops);
    {
        let mut slot = scratch.slice_mut(rank * WORDS..(rank + 1) * WORDS);
        stream
            .memcpy_htod(&mine[..], &mut slot)
            .map_err(|e| comm.cuda_error(op, "cuMemcpyHtoDAsync", e))?;
    }
    {
        use cudarc::driver::DevicePtrMut;
        let (base, _record) = scratch.device_ptr_mut(&stream);
        let own = base + (rank * WORDS * std::mem::size_of::<u64>()) as u64;
        let raw = st.raw;
        let r = grouped(|| {
            // SAFETY: `raw` is live (the drain's look checked it under the
            // lock we hold); `scratch` holds WORDS × world u64 on this GPU
            // and the in-place send pointer is this rank's row inside it;
            // the stream is this communicator's.
            let r = unsafe {
                api::ncclAllGather(
                    own as *const std::ffi::c_void,
                    base as *mut std::ffi::c_void,
                    WORDS,
                    sys::ncclDataType_t::ncclUint64,
                    raw,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            };
            ok_or("ncclAllGather (validate)", r)
        });
        if let Err((call, r)) = r {
            let e = comm.nccl_error(op, call_failure_of(st, call, r));
            comm.fail_locked(st, &e.to_string());
            return Err(e.into());
        }
        comm.wait_enqueued_locked(st, op, seq)?;
    }
    drain(st)?;
    let rows = stream
        .clone_dtoh(&*scratch)
        .map_err(|e| comm.cuda_error(op, "cuMemcpyDtoHAsync", e))?;
    debug_assert_eq!(rows.len(), WORDS * world);
    match compare(rank, &rows) {
        None => Ok(()),
        Some(detail) => {
            let e = Error::Mismatch { rank, seq, detail };
            comm.fail_locked(st, &e.to_string());
            Err(e)
        }
    }
}
