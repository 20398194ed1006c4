//! Byte collectives and the agreements built on them, on the threads
//! backend with 1 to 4 ranks: [`Communicator::all_gather_bytes`] and
//! [`agree`]'s `exchange_bytes`, `exchange_u64` and `first_failure`.
//!
//! Every byte and word must arrive exactly (NaN-looking bit patterns,
//! per-rank lengths including zero, lengths past the streaming threshold
//! and not a multiple of anything); ranks that disagree on sizes get
//! `Mismatch`, bad arguments `InvalidArgument` on the rank that made them
//! and `PeerFailed` on its peers, and nothing hangs.

use std::time::{Duration, Instant};

use zero_comm::agree::{exchange_bytes, exchange_u64, first_failure};
use zero_comm::{CommOptions, Communicator, Error, ReduceOp, ThreadGroup};
use zero_core::{bf16, HostBuffer};

/// A timeout no test reaches unless it means to.
fn long() -> CommOptions {
    CommOptions::default().with_timeout(Duration::from_secs(30))
}

/// Runs `f` on `world` ranks, each result unwrapped, within 10 s.
fn run<R: Send>(world: usize, f: impl Fn(zero_comm::ThreadComm) -> R + Sync) -> Vec<R> {
    let t = Instant::now();
    let out = ThreadGroup::run_with(world, &long(), f).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    out
}

/// Pseudo-random bytes of rank `rank`, every value 0..=255 present.
fn noise(rank: usize, len: usize) -> Vec<u8> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ (rank as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// Bit patterns a float transport could bend: quiet, signalling and
/// negative NaNs (f64, f32 pairs, bf16 quads), infinities, -0, subnormals,
/// all ones.
const AWKWARD: [u64; 10] = [
    0x7ff8_0000_0000_0000,
    0x7ff0_0000_0000_0001,
    0xfff8_dead_beef_0001,
    0x7fc0_0001_ffc0_0001,
    0x7fc1_ffff_7f81_0001,
    0x7ff0_0000_0000_0000,
    0x8000_0000_0000_0000,
    0x0000_0000_0000_0001,
    u64::MAX,
    0,
];

/// Per-rank lengths: zeros, odd sizes, and one past the 4 MiB streaming
/// threshold of the copies (when `big`).
fn lens(world: usize, big: bool) -> Vec<usize> {
    (0..world)
        .map(|r| match r % 4 {
            0 => 13,
            1 => 0,
            2 if big => (4 << 20) + 5,
            2 => 1,
            _ => 1001,
        })
        .collect()
}

#[test]
fn all_gather_bytes_moves_every_byte_exactly() {
    for world in 1..=4 {
        for big in [false, true] {
            let counts = lens(world, big);
            let want: Vec<u8> = (0..world).flat_map(|p| noise(p, counts[p])).collect();
            let got = run(world, |comm| {
                let r = comm.rank();
                let send = noise(r, counts[r]);
                let (send, recv) = comm
                    .all_gather_bytes(send.clone(), vec![0xa5; want.len()], &counts)
                    .wait()
                    .unwrap();
                assert_eq!(send, noise(r, counts[r]), "the input comes back unchanged");
                recv
            });
            for (r, g) in got.iter().enumerate() {
                assert!(
                    g == &want,
                    "world {world} big {big}: rank {r} got other bytes"
                );
            }
        }
    }
}

#[test]
fn exchange_bytes_takes_a_length_per_rank() {
    for world in 1..=4 {
        let counts = lens(world, false);
        let got = run(world, |comm| {
            exchange_bytes(&comm, &noise(comm.rank(), counts[comm.rank()])).unwrap()
        });
        let want: Vec<Vec<u8>> = (0..world).map(|p| noise(p, counts[p])).collect();
        assert!(got.iter().all(|g| g == &want), "world {world}");
    }
    // Nothing anywhere: still one agreement, empty parts.
    let got = run(3, |comm| exchange_bytes(&comm, &[]).unwrap());
    assert_eq!(got, vec![vec![Vec::<u8>::new(); 3]; 3]);
}

#[test]
fn exchange_u64_keeps_every_bit_pattern() {
    for world in 1..=4 {
        let mine = |r: usize| -> Vec<u64> {
            let mut w = AWKWARD.to_vec();
            w.rotate_left(r);
            w.push(r as u64);
            w.push(f64::NAN.to_bits() ^ r as u64);
            w
        };
        let got = run(world, |comm| {
            exchange_u64(&comm, &mine(comm.rank())).unwrap()
        });
        let want: Vec<Vec<u64>> = (0..world).map(mine).collect();
        assert!(got.iter().all(|g| g == &want), "world {world}: {got:x?}");
        // An f64 sum over ranks (how the engine adds norms) is exact.
        let sums = run(world, |comm| {
            let parts = exchange_u64(&comm, &[(0.1f64 * (comm.rank() + 1) as f64).to_bits()]);
            parts
                .unwrap()
                .iter()
                .fold(0f64, |a, w| a + f64::from_bits(w[0]))
        });
        let want = (0..world).fold(0f64, |a, r| a + 0.1 * (r + 1) as f64);
        assert!(sums.iter().all(|s| s.to_bits() == want.to_bits()));
    }
    let got = run(2, |comm| exchange_u64(&comm, &[]).unwrap());
    assert_eq!(got, vec![vec![Vec::<u64>::new(); 2]; 2]);
}

#[test]
fn first_failure_names_the_lowest_failing_rank_and_its_text() {
    for world in 1..=4 {
        // Nobody failed.
        let got = run(world, |comm| first_failure(&comm, None::<&str>).unwrap());
        assert_eq!(got, vec![None; world]);
        // Every rank from the last one down to `from` failed, each with
        // its own text (UTF-8 of several widths).
        for from in 0..world {
            let text = |r: usize| format!("rank {r}: ошибка ✗ {}", "x".repeat(r * 37));
            let got = run(world, |comm| {
                let r = comm.rank();
                let mine = (r >= from).then(|| text(r));
                first_failure(&comm, mine.as_deref()).unwrap()
            });
            assert_eq!(got, vec![Some((from, text(from))); world], "world {world}");
        }
    }
    // An empty message is still a failure; any Display works.
    let got = run(2, |comm| {
        let e = (comm.rank() == 1).then(|| Error::Mpi(String::new()));
        first_failure(&comm, e.as_ref()).unwrap()
    });
    assert_eq!(got, vec![Some((1, "mpi: ".to_string())); 2]);
    let got = run(2, |comm| {
        first_failure(&comm, (comm.rank() == 0).then_some("")).unwrap()
    });
    assert_eq!(got, vec![Some((0, String::new())); 2]);
}

#[test]
fn agreements_keep_the_collective_sequence() {
    // Agreements between ordinary collectives: every rank stays in step.
    let got = run(3, |comm| {
        let b = HostBuffer::from_slice(&[comm.rank() as f32 + 1.0; 5]).unwrap();
        let w = comm.all_reduce(b, ReduceOp::Sum);
        let f = first_failure(&comm, (comm.rank() == 2).then_some("late")).unwrap();
        let s = w.wait().unwrap().to_vec();
        let x = exchange_bytes(&comm, &[comm.rank() as u8; 2]).unwrap();
        let after = comm.barrier();
        (s, f, x, after.seq(), after.wait().is_ok())
    });
    for (s, f, x, seq, ok) in got {
        assert_eq!(s, vec![6.0; 5]);
        assert_eq!(f, Some((2, "late".to_string())));
        assert_eq!(x, vec![vec![0, 0], vec![1, 1], vec![2, 2]]);
        // all_reduce, first_failure (2), exchange_bytes (2), barrier.
        assert_eq!((seq, ok), (6, true));
    }
}

/// Every rank's error from `f` (each rank expects one).
fn errors(world: usize, f: impl Fn(&zero_comm::ThreadComm) -> Option<Error> + Sync) -> Vec<Error> {
    run(world, |comm| f(&comm).expect("an error"))
}

#[test]
fn different_word_counts_mismatch_on_every_rank() {
    let errs = errors(2, |c| exchange_u64(c, &vec![7; 2 + c.rank()]).err());
    for (rank, e) in errs.iter().enumerate() {
        let Error::Mismatch {
            rank: r,
            seq: 1,
            detail,
        } = e
        else {
            panic!("rank {rank}: expected Mismatch, got {e}")
        };
        assert_eq!(*r, rank);
        let parts: Vec<&str> = detail.split("; ").collect();
        assert_eq!(parts.len(), 2, "{detail}");
        assert!(parts[0].starts_with("rank 0 called all_gather(u8, 32 elements, counts "));
        assert!(parts[1].starts_with("rank 1 called all_gather(u8, 48 elements, counts "));
    }
    // Bytes against numbers of the same size: the element types differ.
    let errs = errors(2, |c| {
        if c.rank() == 0 {
            exchange_u64(c, &[1]).err()
        } else {
            let send = HostBuffer::<bf16>::zeros(4).unwrap();
            let recv = HostBuffer::<bf16>::zeros(8).unwrap();
            c.all_gather(send, recv, &[4, 4]).wait().err()
        }
    });
    for e in &errs {
        let msg = e.to_string();
        assert!(matches!(e, Error::Mismatch { seq: 1, .. }), "{msg}");
        assert!(
            msg.contains("rank 0 called all_gather(u8, 16 elements, counts "),
            "{msg}"
        );
        assert!(
            msg.contains("rank 1 called all_gather(bf16, 8 elements, counts "),
            "{msg}"
        );
    }
}

#[test]
fn bad_byte_arguments_fail_the_caller_and_its_peers_at_once() {
    let counts = [2, 3, 4];
    let cases: [(&str, Vec<usize>, usize, usize); 3] = [
        (
            "counts has 2 entries but there are 3 ranks (this is rank 1)",
            vec![2, 3],
            3,
            9,
        ),
        (
            "input has 2 bytes but counts[1] is 3",
            counts.to_vec(),
            2,
            9,
        ),
        (
            "output has 10 bytes but counts sum to 9",
            counts.to_vec(),
            3,
            10,
        ),
    ];
    for (msg, bad_counts, send, recv) in cases {
        let errs = errors(3, |c| {
            let w = if c.rank() == 1 {
                c.all_gather_bytes(vec![1; send], vec![0; recv], &bad_counts)
            } else {
                c.all_gather_bytes(vec![1; counts[c.rank()]], vec![0; 9], &counts)
            };
            let e = w.wait().err();
            assert!(c.barrier().wait().is_err(), "the communicator is poisoned");
            e
        });
        for (rank, e) in errs.iter().enumerate() {
            if rank == 1 {
                assert_eq!(
                    e.to_string(),
                    format!("rank 1: invalid arguments to all_gather_bytes: {msg}")
                );
            } else {
                assert!(
                    matches!(
                        e,
                        Error::PeerFailed {
                            peer: 1,
                            seq: 1,
                            ..
                        }
                    ),
                    "rank {rank}: {e}"
                );
            }
        }
    }
}

#[test]
fn a_missing_rank_times_out_instead_of_hanging() {
    let opts = CommOptions::default().with_timeout(Duration::from_millis(300));
    let t = Instant::now();
    let out = ThreadGroup::run_with(2, &opts, |comm| {
        if comm.rank() == 0 {
            first_failure(&comm, Some("alone")).err()
        } else {
            std::thread::sleep(Duration::from_millis(900));
            None
        }
    })
    .unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    let e = out[0].as_ref().expect("rank 0 times out");
    assert!(
        matches!(
            e,
            Error::Timeout {
                op: "all_gather",
                seq: 1,
                ..
            }
        ),
        "{e}"
    );
}
