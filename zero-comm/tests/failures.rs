//! Failure behaviour of the threads backend: every failure is the exact
//! error variant with a message that says what happened, and nothing hangs
//! (each test measures its time and asserts a bound far below the default
//! timeout).
//!
//! - timeout: a rank that never arrives;
//! - mismatch: ranks that call different collectives (op, dtype, count,
//!   counts, reduce op, root, order);
//! - peer failure: a rank that panics or drops its communicator;
//! - poisoning: after any error, the next collective is refused at once;
//! - invalid arguments: reported on the rank, its peers fail fast;
//! - dropped `Work` and `Work::wait_timeout`: the collective goes on.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use zero_comm::{
    even_counts, CommOptions, Communicator, Error, ReduceOp, ThreadComm, ThreadGroup, Work,
};
use zero_core::{bf16, HostBuffer};

/// Bound on every test's wall time (the timeouts below are far longer
/// wherever a test expects a failure *not* to wait for them).
const BOUND: Duration = Duration::from_secs(10);

/// Options with a timeout no test should ever reach unless it means to.
fn long() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(30))
}

fn buf(len: usize, v: f32) -> HostBuffer<f32> {
    HostBuffer::from_slice(&vec![v; len]).unwrap()
}

/// Runs `f` and asserts that it finished within [`BOUND`].
fn bounded<R>(f: impl FnOnce() -> R) -> R {
    let t = Instant::now();
    let r = f();
    let e = t.elapsed();
    assert!(e < BOUND, "took {e:?}");
    r
}

fn unwrap_all<R>(r: zero_comm::Result<Vec<R>>) -> Vec<R> {
    r.unwrap_or_else(|e| panic!("a rank failed: {e}"))
}

const FAILED: &str = "failed (it reported an error or panicked)";
const LEFT: &str = "has left the group (its communicator was dropped)";

#[track_caller]
fn assert_peer_failed(e: &Error, me: usize, op: &str, seq: u64, peer: usize, reason: &str) {
    match e {
        Error::PeerFailed {
            rank,
            op: o,
            seq: s,
            peer: p,
            reason: r,
        } => {
            assert_eq!((*rank, *o, *s, *p, r.as_str()), (me, op, seq, peer, reason));
            assert_eq!(
                e.to_string(),
                format!("rank {me}: {op} #{seq} cannot complete: rank {peer} {reason}")
            );
        }
        e => panic!("rank {me}: expected PeerFailed, got {e}"),
    }
}

#[track_caller]
fn assert_poisoned(e: &Error, me: usize, op: &str, seq: u64, first_contains: &str) {
    match e {
        Error::Poisoned {
            rank,
            op: o,
            seq: s,
            first,
        } => {
            assert_eq!((*rank, *o, *s), (me, op, seq), "{e}");
            assert!(first.contains(first_contains), "{e}");
            assert!(
                e.to_string().starts_with(&format!(
                    "rank {me}: {op} #{seq} refused: the communicator failed earlier: "
                )),
                "{e}"
            );
        }
        e => panic!("rank {me}: expected Poisoned, got {e}"),
    }
}

// ---------------------------------------------------------------------------
// (a) timeout, (d) poisoned afterwards

#[test]
fn missing_rank_times_out_naming_op_seq_and_ranks() {
    let timeout = Duration::from_millis(500);
    let opts = CommOptions::default().with_timeout(timeout);
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(3, &opts, |comm| {
            comm.barrier().wait().unwrap(); // #1
            if comm.rank() == 1 {
                std::thread::sleep(3 * timeout);
            }
            let first = comm.all_reduce(buf(8, 1.0), ReduceOp::Sum).wait(); // #2
            let t = Instant::now();
            let next = comm.broadcast(buf(8, 1.0), 0).wait(); // #3
            (first.unwrap_err(), next.unwrap_err(), t.elapsed())
        }))
    });
    for rank in [0, 2] {
        let e = &out[rank].0;
        match e {
            Error::Timeout {
                rank: r,
                op,
                seq,
                phase,
                waited,
                arrived,
                missing,
            } => {
                assert_eq!((*r, *op, *seq, *phase), (rank, "all_reduce", 2, "entry"));
                assert_eq!((&arrived[..], &missing[..]), (&[0, 2][..], &[1][..]));
                assert!(*waited >= timeout && *waited < timeout * 2, "{waited:?}");
                assert_eq!(
                    e.to_string(),
                    format!(
                        "rank {rank}: all_reduce #2 timed out after {waited:?} waiting for \
                         ranks [1] (entry); ranks that arrived: [0, 2]"
                    )
                );
            }
            e => panic!("rank {rank}: expected Timeout, got {e}"),
        }
    }
    // The late rank finds its peers gone when it finally arrives.
    assert_peer_failed(&out[1].0, 1, "all_reduce", 2, 0, FAILED);
    for (rank, (first, next, t)) in out.iter().enumerate() {
        let want = if rank == 1 {
            "cannot complete"
        } else {
            "timed out"
        };
        assert!(first.to_string().contains(want));
        assert_poisoned(next, rank, "broadcast", 3, &first.to_string());
        // At once: far below the 500 ms timeout.
        assert!(*t < Duration::from_millis(400), "refusal took {t:?}");
    }
}

// ---------------------------------------------------------------------------
// (b) mismatch

/// Runs `f` on `world` ranks (after one barrier, so the mismatch is #2)
/// and returns each rank's error.
fn mismatch(world: usize, f: impl Fn(&ThreadComm) -> Work<()> + Sync) -> Vec<Error> {
    bounded(|| {
        unwrap_all(ThreadGroup::run_with(world, &long(), |comm| {
            comm.barrier().wait().unwrap();
            let e = f(&comm).wait().unwrap_err();
            let next = comm.barrier().wait().unwrap_err();
            assert_poisoned(&next, comm.rank(), "barrier", 3, &e.to_string());
            e
        }))
    })
}

#[track_caller]
fn assert_mismatch(errs: &[Error], seq: u64, detail: &str) {
    for (rank, e) in errs.iter().enumerate() {
        match e {
            Error::Mismatch {
                rank: r,
                seq: s,
                detail: d,
            } => {
                assert_eq!((*r, *s, d.as_str()), (rank, seq, detail));
                assert_eq!(
                    e.to_string(),
                    format!("rank {rank}: collective #{seq} does not match across ranks: {detail}")
                );
            }
            e => panic!("rank {rank}: expected Mismatch, got {e}"),
        }
    }
}

#[test]
fn different_collectives_mismatch() {
    let errs = mismatch(2, |c| {
        if c.rank() == 0 {
            c.all_reduce(buf(8, 0.0), ReduceOp::Sum).map(drop)
        } else {
            c.broadcast(buf(8, 0.0), 1).map(drop)
        }
    });
    assert_mismatch(
        &errs,
        2,
        "rank 0 called all_reduce(sum, f32, 8 elements); \
         rank 1 called broadcast(f32, 8 elements, root 1)",
    );
}

#[test]
fn different_dtypes_mismatch() {
    let errs = mismatch(2, |c| {
        if c.rank() == 0 {
            c.all_reduce(buf(8, 0.0), ReduceOp::Sum).map(drop)
        } else {
            c.all_reduce(HostBuffer::<bf16>::zeros(8).unwrap(), ReduceOp::Sum)
                .map(drop)
        }
    });
    assert_mismatch(
        &errs,
        2,
        "rank 0 called all_reduce(sum, f32, 8 elements); \
         rank 1 called all_reduce(sum, bf16, 8 elements)",
    );
}

#[test]
fn different_lengths_mismatch() {
    let errs = mismatch(3, |c| {
        let len = if c.rank() == 2 { 9 } else { 8 };
        c.all_reduce(buf(len, 0.0), ReduceOp::Avg).map(drop)
    });
    assert_mismatch(
        &errs,
        2,
        "rank 0 called all_reduce(avg, f32, 8 elements); \
         rank 1 called all_reduce(avg, f32, 8 elements); \
         rank 2 called all_reduce(avg, f32, 9 elements)",
    );
}

#[test]
fn different_counts_with_the_same_total_mismatch() {
    let errs = mismatch(2, |c| {
        let counts = if c.rank() == 0 { [4, 6] } else { [6, 4] };
        let r = c.rank();
        c.reduce_scatter(buf(10, 0.0), buf(counts[r], 0.0), &counts, ReduceOp::Sum)
            .map(drop)
    });
    // The counts travel as a hash; the detail shows that they differ.
    let Error::Mismatch { detail, .. } = &errs[0] else {
        panic!("{}", errs[0])
    };
    let parts: Vec<&str> = detail.split("; ").collect();
    assert_eq!(parts.len(), 2, "{detail}");
    for (rank, p) in parts.iter().enumerate() {
        let prefix = format!("rank {rank} called reduce_scatter(sum, f32, 10 elements, counts ");
        assert!(p.starts_with(&prefix), "{detail}");
    }
    assert_ne!(parts[0]["rank 0".len()..], parts[1]["rank 1".len()..]);
    assert_mismatch(&errs, 2, detail);
}

#[test]
fn different_reduce_ops_mismatch() {
    let errs = mismatch(2, |c| {
        let op = if c.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        let counts = even_counts(6, 2);
        c.reduce_scatter_in_place(buf(6, 0.0), &counts, op)
            .map(drop)
    });
    let Error::Mismatch { detail, .. } = &errs[0] else {
        panic!("{}", errs[0])
    };
    assert!(
        detail.starts_with("rank 0 called reduce_scatter(sum, f32, 6 elements, counts ")
            && detail.contains("; rank 1 called reduce_scatter(max, f32, 6 elements, counts "),
        "{detail}"
    );
    assert_mismatch(&errs, 2, detail);
}

#[test]
fn different_roots_mismatch() {
    let errs = mismatch(3, |c| {
        let root = if c.rank() == 2 { 2 } else { 0 };
        c.broadcast(buf(4, 0.0), root).map(drop)
    });
    assert_mismatch(
        &errs,
        2,
        "rank 0 called broadcast(f32, 4 elements, root 0); \
         rank 1 called broadcast(f32, 4 elements, root 0); \
         rank 2 called broadcast(f32, 4 elements, root 2)",
    );
}

/// Ranks that issue the same collectives in different orders fail at the
/// first position; what they queued behind it is refused.
#[test]
fn different_order_mismatches_at_the_first_difference() {
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(2, &long(), |c| {
            let ar = || c.all_reduce(buf(8, 0.0), ReduceOp::Sum).map(drop);
            let bc = || c.broadcast(buf(8, 0.0), 0).map(drop);
            let (a, b) = if c.rank() == 0 {
                (ar(), bc())
            } else {
                (bc(), ar())
            };
            (a.wait().unwrap_err(), b.wait().unwrap_err())
        }))
    });
    let firsts: Vec<Error> = out.iter().map(|(a, _)| clone_mismatch(a)).collect();
    assert_mismatch(
        &firsts,
        1,
        "rank 0 called all_reduce(sum, f32, 8 elements); \
         rank 1 called broadcast(f32, 8 elements, root 0)",
    );
    assert_poisoned(&out[0].1, 0, "broadcast", 2, "does not match");
    assert_poisoned(&out[1].1, 1, "all_reduce", 2, "does not match");
}

fn clone_mismatch(e: &Error) -> Error {
    match e {
        Error::Mismatch { rank, seq, detail } => Error::Mismatch {
            rank: *rank,
            seq: *seq,
            detail: detail.clone(),
        },
        e => panic!("expected Mismatch, got {e}"),
    }
}

// ---------------------------------------------------------------------------
// (c) peer failure

/// A rank that panics fails its peers' collective at once (long before
/// the timeout), and `ThreadGroup::run` reports the panic.
#[test]
fn panicking_rank_fails_peers_fast() {
    let seen = Mutex::new(Vec::new());
    let r = bounded(|| {
        ThreadGroup::run_with(3, &long(), |comm| {
            if comm.rank() == 2 {
                panic!("rank 2 exploded");
            }
            let t = Instant::now();
            let e = comm
                .all_reduce(buf(8, 1.0), ReduceOp::Sum)
                .wait()
                .unwrap_err();
            seen.lock().unwrap().push((comm.rank(), e, t.elapsed()));
        })
    });
    match r {
        Err(Error::RankPanicked { rank: 2, msg }) => assert_eq!(msg, "rank 2 exploded"),
        r => panic!("expected RankPanicked for rank 2, got {r:?}"),
    }
    let mut seen = seen.into_inner().unwrap();
    seen.sort_by_key(|s| s.0);
    assert_eq!(seen.len(), 2);
    for (rank, e, t) in &seen {
        assert_peer_failed(e, *rank, "all_reduce", 1, 2, FAILED);
        assert!(*t < Duration::from_secs(5), "rank {rank} waited {t:?}");
    }
}

/// A rank that panics with a collective in flight: the collective still
/// completes (the unwinding `Work` waits for it), then the peers' next
/// collective fails.
#[test]
fn panic_with_a_collective_in_flight() {
    let seen = Mutex::new(Vec::new());
    let r = bounded(|| {
        ThreadGroup::run_with(3, &long(), |comm| {
            let w = comm.all_reduce(buf(1000, comm.rank() as f32 + 1.0), ReduceOp::Sum);
            if comm.rank() == 1 {
                panic!("boom with work in flight");
            }
            let sum = w.wait().unwrap();
            assert!(sum.iter().all(|&x| x == 6.0));
            let e = comm.barrier().wait().unwrap_err();
            seen.lock().unwrap().push((comm.rank(), e));
        })
    });
    assert!(
        matches!(&r, Err(Error::RankPanicked { rank: 1, msg }) if msg == "boom with work in flight"),
        "{r:?}"
    );
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 2);
    for (rank, e) in &seen {
        assert_peer_failed(e, *rank, "barrier", 2, 1, FAILED);
    }
}

/// A rank that drops its communicator: the peers' next collective says it
/// left.
#[test]
fn departed_rank_fails_peers_fast() {
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(3, &long(), |comm| {
            comm.barrier().wait().unwrap();
            if comm.rank() == 0 {
                drop(comm);
                return None;
            }
            let t = Instant::now();
            let e = comm.all_gather(buf(2, 0.0), buf(6, 0.0), &[2, 2, 2]).wait();
            Some((e.unwrap_err(), t.elapsed()))
        }))
    });
    assert!(out[0].is_none());
    for (rank, o) in out.iter().enumerate().skip(1) {
        let (e, t) = o.as_ref().unwrap();
        assert_peer_failed(e, rank, "all_gather", 2, 0, LEFT);
        assert!(*t < Duration::from_secs(5), "rank {rank} waited {t:?}");
    }
}

/// A rank that leaves right after its last collective completed is not a
/// failure for peers still in that collective's exit phase (a race between
/// reading a peer's counter and its state word; CI once hit it with 7
/// ranks on 2 cores). Many short groups, more ranks than cores.
#[test]
fn leaving_after_the_last_collective_fails_nobody() {
    let counts = even_counts(1730, 7);
    for round in 0..400 {
        let out = ThreadGroup::run_with(7, &long(), |comm| {
            let b = HostBuffer::from_fn(1730, |i| bf16::from_f32((i % 97) as f32)).unwrap();
            comm.reduce_scatter_in_place(b, &counts, ReduceOp::Max)
                .wait()
                .map(|_| ())
        })
        .unwrap();
        for (rank, r) in out.into_iter().enumerate() {
            if let Err(e) = r {
                panic!("round {round}, rank {rank}: {e}");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// (d) poisoned

/// After an error, every collective is refused at once, including those
/// already queued behind the failed one; `first` is the original error.
#[test]
fn poisoned_after_any_error() {
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(2, &long(), |c| {
            let len = 4 + c.rank();
            // Queued before the failure is known: refused too.
            let a = c.all_reduce(buf(len, 0.0), ReduceOp::Max);
            let b = c.reduce_scatter_in_place(buf(4, 0.0), &[2, 2], ReduceOp::Sum);
            let e = a.wait().unwrap_err();
            let mut refused = vec![b.wait().unwrap_err()];
            let t = Instant::now();
            refused.push(c.all_reduce(buf(4, 0.0), ReduceOp::Sum).wait().unwrap_err());
            refused.push(
                c.all_gather_in_place(buf(4, 0.0), &[2, 2])
                    .wait()
                    .unwrap_err(),
            );
            refused.push(c.broadcast(buf(4, 0.0), 0).wait().unwrap_err());
            refused.push(c.barrier().wait().unwrap_err());
            (e, refused, t.elapsed())
        }))
    });
    for (rank, (e, refused, t)) in out.iter().enumerate() {
        assert!(matches!(e, Error::Mismatch { seq: 1, .. }), "{e}");
        let first = e.to_string();
        let ops = [
            "reduce_scatter",
            "all_reduce",
            "all_gather",
            "broadcast",
            "barrier",
        ];
        for (i, (r, op)) in refused.iter().zip(ops).enumerate() {
            assert_poisoned(r, rank, op, i as u64 + 2, &first);
        }
        assert!(*t < Duration::from_secs(1), "refusals took {t:?}");
    }
}

// ---------------------------------------------------------------------------
// (e) invalid arguments

/// Rank 1 of 3 makes a collective with `bad` arguments while ranks 0 and
/// 2 make it correctly with `good`: rank 1 gets `InvalidArgument` with
/// `msg`, the others `PeerFailed` naming rank 1, nobody waits for the
/// timeout, and rank 1 is poisoned afterwards.
fn invalid_case(
    op: &str,
    msg: &str,
    good: impl Fn(&ThreadComm) -> Work<()> + Sync,
    bad: impl Fn(&ThreadComm) -> Work<()> + Sync,
) {
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(3, &long(), |c| {
            let t = Instant::now();
            let w = if c.rank() == 1 { bad(&c) } else { good(&c) };
            let e = w.wait().unwrap_err();
            let next = c.barrier().wait().unwrap_err();
            (e, next, t.elapsed())
        }))
    });
    for (rank, (e, next, t)) in out.iter().enumerate() {
        assert!(*t < Duration::from_secs(5), "rank {rank} took {t:?}");
        if rank == 1 {
            match e {
                Error::InvalidArgument {
                    rank: 1,
                    op: o,
                    msg: m,
                } => {
                    assert_eq!((*o, m.as_str()), (op, msg));
                    assert_eq!(
                        e.to_string(),
                        format!("rank 1: invalid arguments to {op}: {msg}")
                    );
                }
                e => panic!("rank 1: expected InvalidArgument, got {e}"),
            }
            assert_poisoned(next, 1, "barrier", 2, msg);
        } else {
            let name = op.trim_end_matches("_in_place");
            assert_peer_failed(e, rank, name, 1, 1, FAILED);
        }
    }
}

#[test]
fn invalid_counts_length() {
    invalid_case(
        "reduce_scatter",
        "counts has 2 entries but there are 3 ranks (this is rank 1)",
        |c| {
            c.reduce_scatter(buf(6, 0.0), buf(2, 0.0), &[2, 2, 2], ReduceOp::Sum)
                .map(drop)
        },
        |c| {
            c.reduce_scatter(buf(6, 0.0), buf(2, 0.0), &[3, 3], ReduceOp::Sum)
                .map(drop)
        },
    );
    invalid_case(
        "all_gather_in_place",
        "counts has 4 entries but there are 3 ranks (this is rank 1)",
        |c| c.all_gather_in_place(buf(6, 0.0), &[2, 2, 2]).map(drop),
        |c| c.all_gather_in_place(buf(6, 0.0), &[2, 2, 2, 0]).map(drop),
    );
}

#[test]
fn invalid_buffer_lengths() {
    let counts = [3, 4, 3];
    let rs = |send: usize, recv: usize| {
        move |c: &ThreadComm| {
            c.reduce_scatter(buf(send, 0.0), buf(recv, 0.0), &counts, ReduceOp::Avg)
                .map(drop)
        }
    };
    let good_rs = |c: &ThreadComm| rs(10, counts[c.rank()])(c);
    invalid_case(
        "reduce_scatter",
        "input has 9 elements but counts sum to 10",
        good_rs,
        rs(9, 4),
    );
    invalid_case(
        "reduce_scatter",
        "output has 3 elements but counts[1] is 4",
        good_rs,
        rs(10, 3),
    );
    invalid_case(
        "reduce_scatter_in_place",
        "buffer has 11 elements but counts sum to 10",
        |c| {
            c.reduce_scatter_in_place(buf(10, 0.0), &counts, ReduceOp::Sum)
                .map(drop)
        },
        |c| {
            c.reduce_scatter_in_place(buf(11, 0.0), &counts, ReduceOp::Sum)
                .map(drop)
        },
    );
    let ag = |send: usize, recv: usize| {
        move |c: &ThreadComm| {
            c.all_gather(buf(send, 0.0), buf(recv, 0.0), &counts)
                .map(drop)
        }
    };
    let good_ag = |c: &ThreadComm| ag(counts[c.rank()], 10)(c);
    invalid_case(
        "all_gather",
        "input has 3 elements but counts[1] is 4",
        good_ag,
        ag(3, 10),
    );
    invalid_case(
        "all_gather",
        "output has 0 elements but counts sum to 10",
        good_ag,
        ag(4, 0),
    );
    invalid_case(
        "all_gather_in_place",
        "buffer has 9 elements but counts sum to 10",
        |c| c.all_gather_in_place(buf(10, 0.0), &counts).map(drop),
        |c| c.all_gather_in_place(buf(9, 0.0), &counts).map(drop),
    );
}

#[test]
fn invalid_root() {
    invalid_case(
        "broadcast",
        "root 3 is not a rank of 3",
        |c| c.broadcast(buf(5, 0.0), 2).map(drop),
        |c| c.broadcast(buf(5, 0.0), 3).map(drop),
    );
    // Every rank wrong: each reports its own error, nobody hangs.
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(2, &long(), |c| {
            c.broadcast(buf(5, 0.0), 7).wait().unwrap_err()
        }))
    });
    for (rank, e) in out.iter().enumerate() {
        assert_eq!(
            e.to_string(),
            format!("rank {rank}: invalid arguments to broadcast: root 7 is not a rank of 2")
        );
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }
}

// ---------------------------------------------------------------------------
// (f) dropped Work, (g) wait_timeout

/// A `Work` dropped without waiting still runs its collective: the peers
/// get the full result and the dropping rank's next collective works.
#[test]
fn dropped_work_is_not_lost() {
    let nap = Duration::from_millis(200);
    let start = Instant::now();
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(3, &long(), |c| {
            if c.rank() != 0 {
                // Make rank 0 drop while the collective cannot have finished.
                std::thread::sleep(nap);
            }
            let w = c.all_reduce(buf(5000, c.rank() as f32 + 1.0), ReduceOp::Sum);
            let first = if c.rank() == 0 {
                drop(w);
                // The drop waited for the collective, which needed the peers.
                assert!(start.elapsed() >= nap, "{:?}", start.elapsed());
                None
            } else {
                Some(w.wait().unwrap().to_vec())
            };
            let next = c
                .all_reduce(buf(7, c.rank() as f32), ReduceOp::Max)
                .wait()
                .unwrap();
            (first, next.to_vec())
        }))
    });
    for (rank, (first, next)) in out.iter().enumerate() {
        if rank != 0 {
            assert_eq!(first.as_deref(), Some(&vec![6.0; 5000][..]));
        }
        assert_eq!(next, &vec![2.0; 7]);
    }
}

/// `wait_timeout` gives up with `WaitTimeout` while the collective goes on
/// (the late peer gets the full result), and the communicator stays usable.
#[test]
fn wait_timeout_expires_but_the_collective_continues() {
    let out = bounded(|| {
        unwrap_all(ThreadGroup::run_with(2, &long(), |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(1));
            }
            let w = c.all_reduce(buf(100, c.rank() as f32 + 1.0), ReduceOp::Sum);
            let first = if c.rank() == 0 {
                assert!(!w.is_completed());
                assert_eq!((w.op(), w.seq()), ("all_reduce", 1));
                let t = Instant::now();
                let e = w.wait_timeout(Duration::from_millis(50)).unwrap_err();
                let waited = t.elapsed();
                assert!(
                    waited >= Duration::from_millis(50) && waited < Duration::from_millis(900),
                    "{waited:?}"
                );
                Err(e)
            } else {
                Ok(w.wait().unwrap().to_vec())
            };
            // Still usable: the next collective (after the first) works.
            let next = c
                .all_reduce(buf(3, 1.0), ReduceOp::Sum)
                .wait_timeout(Duration::from_secs(5))
                .unwrap();
            (first, next.to_vec())
        }))
    });
    match &out[0].0 {
        Err(
            e @ Error::WaitTimeout {
                op: "all_reduce",
                seq: 1,
                waited,
            },
        ) => {
            assert_eq!(*waited, Duration::from_millis(50));
            assert_eq!(
                e.to_string(),
                "all_reduce #1 did not complete within 50ms (it continues in the background)"
            );
        }
        r => panic!("rank 0: expected WaitTimeout, got {r:?}"),
    }
    assert_eq!(out[1].0.as_ref().unwrap(), &vec![3.0; 100]);
    for (_, next) in &out {
        assert_eq!(next, &vec![2.0; 3]);
    }
}
