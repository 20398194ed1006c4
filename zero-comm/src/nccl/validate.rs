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

use super::batch::{grouped, ok_or, Launch};
use super::check::Coll;
use super::comm::{call_failure_of, NcclComm, State};
use crate::op::{Elem, OpDesc, OpKind};
use crate::{Error, Result};

/// Words per rank: number of ops, the first op's header and length, and a
/// hash of every op's descriptor.
pub(crate) const WORDS: usize = 4;

/// The descriptor of one launch, as compared across ranks.
pub(crate) fn words(ops: &[Launch]) -> [u64; WORDS] {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for l in ops {
        for w in desc(l).words() {
            for b in w.to_le_bytes() {
                hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    let first = ops.first().map_or([0; 3], |l| desc(l).words());
    [ops.len() as u64, first[0], first[1], hash]
}

fn desc(l: &Launch) -> OpDesc {
    OpDesc {
        kind: match l.plan.coll {
            Coll::AllReduce => OpKind::AllReduce,
            Coll::ReduceScatter => OpKind::ReduceScatter,
            Coll::AllGather => OpKind::AllGather,
        },
        reduce: l.reduce,
        elem: Elem::Num(l.plan.dtype),
        len: l.plan.total,
        counts_hash: 0,
        root: 0,
    }
}

/// What rank `r` published, for messages.
pub(crate) fn describe(w: &[u64]) -> String {
    match w[0] {
        0 => "an empty group".into(),
        1 => OpDesc::describe_words([w[1], w[2], 0]),
        n => format!(
            "a group of {n} collectives, first {}",
            OpDesc::describe_words([w[1], w[2], 0])
        ),
    }
}

/// Compares every rank's row with `rank`'s; the mismatch detail.
pub(crate) fn compare(rank: usize, rows: &[u64]) -> Option<String> {
    let mine = &rows[rank * WORDS..(rank + 1) * WORDS];
    let differ = rows.chunks_exact(WORDS).any(|r| r != mine);
    differ.then(|| {
        rows.chunks_exact(WORDS)
            .enumerate()
            .map(|(r, w)| format!("rank {r}: {}", describe(w)))
            .collect::<Vec<_>>()
            .join("; ")
    })
}

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
                sys::ncclAllGather(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::check::{Coll, Plan};
    use crate::ReduceOp;
    use zero_core::DType;

    fn launch(coll: Coll, reduce: Option<ReduceOp>, dtype: DType, total: usize) -> Launch {
        Launch {
            name: "x",
            plan: Plan {
                coll,
                dtype,
                count: total,
                total,
                send_offset: 0,
                recv_offset: 0,
            },
            reduce,
            send: 0,
            recv: 0,
        }
    }

    #[test]
    fn equal_launches_agree_and_different_ones_are_described() {
        let a = launch(Coll::AllReduce, Some(ReduceOp::Sum), DType::F32, 1024);
        let b = launch(Coll::AllGather, None, DType::BF16, 64);
        let same: Vec<u64> = [
            words(std::slice::from_ref(&a)),
            words(std::slice::from_ref(&a)),
        ]
        .concat();
        assert_eq!(compare(0, &same), None);
        assert_eq!(compare(1, &same), None);

        let rows: Vec<u64> = [
            words(std::slice::from_ref(&a)),
            words(std::slice::from_ref(&b)),
        ]
        .concat();
        let d = compare(1, &rows).unwrap();
        assert_eq!(
            d,
            "rank 0: all_reduce(sum, f32, 1024 elements); rank 1: all_gather(bf16, 64 elements)"
        );

        // Same first op, different second: caught by the hash.
        let g1 = words(&[a.clone(), b.clone()]);
        let g2 = words(&[a.clone(), launch(Coll::AllGather, None, DType::BF16, 65)]);
        let rows: Vec<u64> = [g1, g2].concat();
        let d = compare(0, &rows).unwrap();
        assert!(
            d.starts_with("rank 0: a group of 2 collectives, first all_reduce(sum, f32"),
            "{d}"
        );
        assert_eq!(describe(&words(&[])), "an empty group");
    }
}
