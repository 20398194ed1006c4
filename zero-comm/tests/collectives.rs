//! Every collective of the threads backend against a sequential reference,
//! bit for bit: 1–8 ranks, 0 to millions of elements, even and uneven
//! counts (with zeros), f32/bf16/f16, sum/avg/max, in place and out of
//! place, broadcast from every root, several collectives in flight, and
//! independence from thread timing.
//!
//! The reference is [`reference_reduce`] (f32 accumulation in rank order)
//! for reductions, concatenation for all-gather and the root's input for
//! broadcast. Comparisons are on bit patterns, so ±0 and NaN are exact.

use std::time::Duration;

use proptest::prelude::*;
use zero_comm::{
    even_counts, offsets, reference_reduce, Communicator, ReduceOp, ThreadComm, ThreadGroup,
};
use zero_core::{bf16, f16, DType, Element, HostBuffer};

// ---------------------------------------------------------------------------
// Inputs

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Random finite values for `rank` of a collective seeded with `seed`:
/// signed, magnitudes 2^-12..2^9 with full mantissas (so additions round),
/// some +0 and -0, and a few tiny values (f16 subnormals). Sums of 8 ranks
/// stay well inside f16's range.
fn input<T: Element>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    let mut s = seed ^ (rank as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93);
    (0..len)
        .map(|_| {
            let r = splitmix(&mut s);
            let x = match r & 31 {
                0 => 0.0,
                1 => -0.0,
                2 => {
                    let e = -24 + ((r >> 8) % 10) as i32;
                    2f32.powi(e) * (1.0 + ((r >> 16) & 0xff) as f32 / 256.0)
                }
                _ => {
                    let e = -12 + ((r >> 8) % 21) as i32;
                    let m = 1.0 + ((r >> 16) & 0xff_ffff) as f32 / (1u32 << 24) as f32;
                    m * 2f32.powi(e)
                }
            };
            let x = if r >> 63 == 1 { -x } else { x };
            T::from_f32(x)
        })
        .collect()
}

fn bytes<T: Element>(x: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(x).to_vec()
}

/// `Ok` if `got` has exactly the bit patterns in `want`; otherwise the
/// first differing element.
fn compare<T: Element>(what: &str, got: &[T], want: &[u8]) -> Result<(), String> {
    let g: &[u8] = bytemuck::cast_slice(got);
    if g == want {
        return Ok(());
    }
    let size = std::mem::size_of::<T>();
    if g.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len() / size
        ));
    }
    let i = g.iter().zip(want).position(|(a, b)| a != b).unwrap() / size;
    let w: T = bytemuck::pod_read_unaligned(&want[i * size..(i + 1) * size]);
    Err(format!(
        "{what}: element {i} of {} is {:?} ({:?}), expected {:?} ({:?})",
        got.len(),
        got[i],
        &g[i * size..(i + 1) * size],
        w,
        &want[i * size..(i + 1) * size]
    ))
}

// ---------------------------------------------------------------------------
// Collectives as data

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    AllReduce(ReduceOp),
    /// (op, in place)
    ReduceScatter(ReduceOp, bool),
    /// in place
    AllGather(bool),
    /// root
    Broadcast(usize),
    Barrier,
}

/// One collective: for all-reduce and broadcast the length is
/// `sum(counts)`; reduce-scatter and all-gather use the counts per rank.
#[derive(Debug, Clone)]
struct Spec {
    kind: Kind,
    dtype: DType,
    counts: Vec<usize>,
    seed: u64,
}

impl Spec {
    fn total(&self) -> usize {
        self.counts.iter().sum()
    }
}

/// The reference result in bytes: the whole reduced buffer (all-reduce,
/// reduce-scatter), the concatenation (all-gather), the root's input
/// (broadcast).
fn expected(s: &Spec, world: usize) -> Vec<u8> {
    match s.dtype {
        DType::F32 => expected_t::<f32>(s, world),
        DType::BF16 => expected_t::<bf16>(s, world),
        DType::F16 => expected_t::<f16>(s, world),
    }
}

fn expected_t<T: Element>(s: &Spec, world: usize) -> Vec<u8> {
    let total = s.total();
    match s.kind {
        Kind::AllReduce(op) | Kind::ReduceScatter(op, _) => {
            let inputs: Vec<Vec<T>> = (0..world).map(|r| input(s.seed, r, total)).collect();
            let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
            bytes(&reference_reduce(&refs, op))
        }
        Kind::AllGather(_) => {
            let parts: Vec<T> = (0..world)
                .flat_map(|r| input::<T>(s.seed, r, s.counts[r]))
                .collect();
            bytes(&parts)
        }
        Kind::Broadcast(root) => bytes(&input::<T>(s.seed, root, total)),
        Kind::Barrier => Vec::new(),
    }
}

/// Checks a completed collective on one rank against the expected bytes.
type Check<'a> = Box<dyn FnOnce(&[u8]) -> Result<(), String> + 'a>;

fn err(e: zero_comm::Error) -> String {
    e.to_string()
}

/// Issues `s` on `comm` (without waiting) and returns its check.
fn issue<'a>(comm: &'a ThreadComm, s: &'a Spec) -> Check<'a> {
    match s.dtype {
        DType::F32 => issue_t::<f32>(comm, s),
        DType::BF16 => issue_t::<bf16>(comm, s),
        DType::F16 => issue_t::<f16>(comm, s),
    }
}

fn issue_t<'a, T: Element>(comm: &'a ThreadComm, s: &'a Spec) -> Check<'a> {
    let rank = comm.rank();
    let total = s.total();
    let counts = &s.counts[..];
    let own = offsets(counts)[rank]..offsets(counts)[rank] + counts[rank];
    match s.kind {
        Kind::AllReduce(op) => {
            // Registered buffer (alloc) for some, plain for others.
            let mut buf = comm.alloc::<T>(total).unwrap();
            buf.copy_from_slice(&input::<T>(s.seed, rank, total));
            let w = comm.all_reduce(buf, op);
            Box::new(move |want| compare("all_reduce", &w.wait().map_err(err)?, want))
        }
        Kind::ReduceScatter(op, false) => {
            let x = input::<T>(s.seed, rank, total);
            let send = HostBuffer::from_slice(&x).unwrap();
            let recv = HostBuffer::from_fn(counts[rank], |_| T::from_f32(7.0)).unwrap();
            let w = comm.reduce_scatter(send, recv, counts, op);
            Box::new(move |want| {
                let (send, recv) = w.wait().map_err(err)?;
                compare("reduce_scatter input (unchanged)", &send, &bytes(&x))?;
                compare("reduce_scatter output", &recv, &want[bytes_of::<T>(own)])
            })
        }
        Kind::ReduceScatter(op, true) => {
            let x = input::<T>(s.seed, rank, total);
            let buf = HostBuffer::from_slice(&x).unwrap();
            let w = comm.reduce_scatter_in_place(buf, counts, op);
            Box::new(move |want| {
                let buf = w.wait().map_err(err)?;
                let mut exp = bytes(&x);
                let b = bytes_of::<T>(own);
                exp[b.clone()].copy_from_slice(&want[b]);
                compare("reduce_scatter_in_place", &buf, &exp)
            })
        }
        Kind::AllGather(false) => {
            let x = input::<T>(s.seed, rank, counts[rank]);
            let send = HostBuffer::from_slice(&x).unwrap();
            let recv = HostBuffer::from_fn(total, |_| T::from_f32(7.0)).unwrap();
            let w = comm.all_gather(send, recv, counts);
            Box::new(move |want| {
                let (send, recv) = w.wait().map_err(err)?;
                compare("all_gather input (unchanged)", &send, &bytes(&x))?;
                compare("all_gather output", &recv, want)
            })
        }
        Kind::AllGather(true) => {
            // Own part in place; junk elsewhere, which must be overwritten.
            let mut buf: HostBuffer<T> =
                HostBuffer::from_slice(&input::<T>(s.seed ^ 0x5555, rank, total)).unwrap();
            buf[own.clone()].copy_from_slice(&input::<T>(s.seed, rank, counts[rank]));
            let w = comm.all_gather_in_place(buf, counts);
            Box::new(move |want| compare("all_gather_in_place", &w.wait().map_err(err)?, want))
        }
        Kind::Broadcast(root) => {
            let buf = HostBuffer::from_slice(&input::<T>(s.seed, rank, total)).unwrap();
            let w = comm.broadcast(buf, root);
            Box::new(move |want| {
                compare(
                    &format!("broadcast from {root}"),
                    &w.wait().map_err(err)?,
                    want,
                )
            })
        }
        Kind::Barrier => {
            let w = comm.barrier();
            Box::new(move |_| w.wait().map_err(err))
        }
    }
}

/// Byte range of an element range.
fn bytes_of<T>(r: std::ops::Range<usize>) -> std::ops::Range<usize> {
    let s = std::mem::size_of::<T>();
    r.start * s..r.end * s
}

/// Runs `specs` on `world` ranks: every rank issues all of them before
/// waiting on any, then waits (in reverse order if `reverse`) and checks
/// each against the reference.
fn run(world: usize, specs: &[Spec], reverse: bool) -> Result<(), String> {
    let want: Vec<Vec<u8>> = specs.iter().map(|s| expected(s, world)).collect();
    let out = ThreadGroup::run(world, |comm| {
        let mut checks: Vec<Option<Check<'_>>> =
            specs.iter().map(|s| Some(issue(&comm, s))).collect();
        let order: Vec<usize> = if reverse {
            (0..specs.len()).rev().collect()
        } else {
            (0..specs.len()).collect()
        };
        let mut first = Ok(());
        for i in order {
            let r = checks[i].take().unwrap()(&want[i]);
            if first.is_ok() {
                first = r.map_err(|e| format!("collective {i} ({:?}): {e}", specs[i]));
            }
        }
        first
    })
    .map_err(|e| e.to_string())?;
    for (rank, r) in out.into_iter().enumerate() {
        r.map_err(|e| format!("rank {rank} of {world}: {e}"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Strategies

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn reduce_op() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

/// Mostly small (edge cases around the chunking), sometimes tens of
/// thousands; 0 included.
fn len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0usize..40,
        3 => 0usize..3_000,
        1 => 0usize..60_000,
    ]
}

/// `world` counts: even splits of any length (often not divisible by the
/// world size) or explicit uneven counts with many zeros.
fn counts(world: usize) -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        len().prop_map(move |l| even_counts(l, world)),
        prop::collection::vec(
            prop_oneof![2 => Just(0usize), 2 => 0usize..20, 1 => 0usize..5_000],
            world
        ),
    ]
}

fn world_and_counts() -> impl Strategy<Value = (usize, Vec<usize>)> {
    (1usize..=8).prop_flat_map(|w| (Just(w), counts(w)))
}

fn kind(world: usize) -> impl Strategy<Value = Kind> {
    prop_oneof![
        reduce_op().prop_map(Kind::AllReduce),
        (reduce_op(), any::<bool>()).prop_map(|(o, p)| Kind::ReduceScatter(o, p)),
        any::<bool>().prop_map(Kind::AllGather),
        (0..world).prop_map(Kind::Broadcast),
        Just(Kind::Barrier),
    ]
}

fn spec(world: usize) -> impl Strategy<Value = Spec> {
    (kind(world), dtype(), counts(world), any::<u64>()).prop_map(|(kind, dtype, counts, seed)| {
        Spec {
            kind,
            dtype,
            counts,
            seed,
        }
    })
}

fn check(r: Result<(), String>) -> Result<(), TestCaseError> {
    r.map_err(TestCaseError::fail)
}

// Case counts: each case starts a group of up to 16 threads; these keep
// the file at a few seconds on 2 cores (dev profile).
proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn all_reduce_matches_reference(
        world in 1usize..=8, len in len(), dtype in dtype(), op in reduce_op(), seed: u64,
    ) {
        let s = Spec { kind: Kind::AllReduce(op), dtype, counts: even_counts(len, world), seed };
        check(run(world, &[s], false))?;
    }

    #[test]
    fn reduce_scatter_matches_reference(
        (world, counts) in world_and_counts(), dtype in dtype(), op in reduce_op(),
        in_place: bool, seed: u64,
    ) {
        let s = Spec { kind: Kind::ReduceScatter(op, in_place), dtype, counts, seed };
        check(run(world, &[s], false))?;
    }

    #[test]
    fn all_gather_matches_reference(
        (world, counts) in world_and_counts(), dtype in dtype(), in_place: bool, seed: u64,
    ) {
        let s = Spec { kind: Kind::AllGather(in_place), dtype, counts, seed };
        check(run(world, &[s], false))?;
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// One broadcast from each root, all in flight at once.
    #[test]
    fn broadcast_from_every_root(world in 1usize..=8, len in len(), dtype in dtype(), seed: u64) {
        let specs: Vec<Spec> = (0..world)
            .map(|root| Spec {
                kind: Kind::Broadcast(root),
                dtype,
                counts: even_counts(len, world),
                seed: seed.wrapping_add(root as u64),
            })
            .collect();
        check(run(world, &specs, false))?;
    }

    /// Up to 8 collectives of mixed kinds, dtypes and sizes issued before
    /// any is waited on; waited in issue order or in reverse.
    #[test]
    fn mixed_collectives_in_flight(
        (world, specs) in (1usize..=8)
            .prop_flat_map(|w| (Just(w), prop::collection::vec(spec(w), 1..=8))),
        reverse: bool,
    ) {
        check(run(world, &specs, reverse))?;
    }
}

// ---------------------------------------------------------------------------
// Millions of elements: a few explicit cases.

fn spec_of(kind: Kind, dtype: DType, counts: Vec<usize>, seed: u64) -> Spec {
    Spec {
        kind,
        dtype,
        counts,
        seed,
    }
}

#[test]
fn all_reduce_millions() {
    let cases = [
        (8, 3_000_017, DType::F32, ReduceOp::Sum),
        (5, 2_000_003, DType::BF16, ReduceOp::Avg),
        (3, 4_000_000, DType::F16, ReduceOp::Max),
    ];
    for (world, len, dtype, op) in cases {
        let s = spec_of(Kind::AllReduce(op), dtype, even_counts(len, world), 11);
        run(world, &[s], false).unwrap();
    }
}

#[test]
fn reduce_scatter_millions_uneven() {
    let counts = vec![1_000_003, 0, 777_777, 1, 0, 1_234_567, 5];
    run(
        7,
        &[
            spec_of(
                Kind::ReduceScatter(ReduceOp::Max, true),
                DType::F16,
                counts.clone(),
                1,
            ),
            spec_of(
                Kind::ReduceScatter(ReduceOp::Sum, false),
                DType::BF16,
                counts,
                2,
            ),
        ],
        false,
    )
    .unwrap();
    let s = spec_of(
        Kind::ReduceScatter(ReduceOp::Avg, false),
        DType::F32,
        even_counts(3_000_001, 4),
        3,
    );
    run(4, &[s], false).unwrap();
}

#[test]
fn all_gather_millions_uneven() {
    let counts = vec![0, 1_500_000, 3, 0, 999_999, 250_001];
    run(
        6,
        &[
            spec_of(Kind::AllGather(true), DType::F32, counts.clone(), 4),
            spec_of(Kind::AllGather(false), DType::BF16, counts, 5),
        ],
        false,
    )
    .unwrap();
}

#[test]
fn broadcast_millions() {
    let specs: Vec<Spec> = [0, 3]
        .into_iter()
        .map(|root| {
            spec_of(
                Kind::Broadcast(root),
                DType::F32,
                even_counts(3_000_001, 4),
                root as u64,
            )
        })
        .collect();
    run(4, &specs, true).unwrap();
}

// ---------------------------------------------------------------------------
// NaN, and timing

/// Max with NaNs (both signs, several payloads) among finite values gives
/// exactly the reference's bits, for every dtype and world size.
#[test]
fn max_with_nan_matches_reference_bits() {
    fn case<T: Element>(world: usize, len: usize) {
        let nans = [f32::NAN, -f32::NAN, f32::from_bits(0x7fc0_1234)];
        let inputs: Vec<Vec<T>> = (0..world)
            .map(|r| {
                let mut x = input::<T>(99, r, len);
                let mut s = r as u64 * 7 + 1;
                for _ in 0..len / 8 + 1 {
                    let i = (splitmix(&mut s) % len.max(1) as u64) as usize;
                    if i < len {
                        x[i] = T::from_f32(nans[i % 3]);
                    }
                }
                x
            })
            .collect();
        let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
        let want = bytes(&reference_reduce(&refs, ReduceOp::Max));
        assert!(reference_reduce(&refs, ReduceOp::Max)
            .iter()
            .any(|x| x.to_f32().is_nan()));
        let inputs = &inputs;
        let want = &want;
        let out = ThreadGroup::run(world, |comm| {
            let buf = HostBuffer::from_slice(&inputs[comm.rank()]).unwrap();
            let got = comm.all_reduce(buf, ReduceOp::Max).wait().unwrap();
            compare("all_reduce max", &got, want)?;
            let counts = even_counts(len, world);
            let own =
                offsets(&counts)[comm.rank()]..offsets(&counts)[comm.rank()] + counts[comm.rank()];
            let buf = HostBuffer::from_slice(&inputs[comm.rank()]).unwrap();
            let got = comm
                .reduce_scatter_in_place(buf, &counts, ReduceOp::Max)
                .wait()
                .unwrap();
            compare(
                "reduce_scatter max",
                &got[own.clone()],
                &want[bytes_of::<T>(own)],
            )
        })
        .unwrap();
        for (rank, r) in out.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("{} rank {rank} of {world}: {e}", T::DTYPE));
        }
    }
    for world in 1..=8 {
        case::<f32>(world, 1000 + world);
        case::<bf16>(world, 777);
        case::<f16>(world, 4099);
    }
}

/// Ranks that arrive at random moments (random sleeps before each
/// collective) get the same bits as the reference, run after run.
#[test]
fn results_do_not_depend_on_thread_timing() {
    let world = 5;
    let specs = [
        spec_of(
            Kind::AllReduce(ReduceOp::Sum),
            DType::BF16,
            even_counts(50_001, world),
            21,
        ),
        spec_of(
            Kind::ReduceScatter(ReduceOp::Avg, true),
            DType::F32,
            vec![0, 9_000, 17, 4_096, 1],
            22,
        ),
        spec_of(
            Kind::AllGather(false),
            DType::F16,
            vec![3, 0, 5_000, 1, 77],
            23,
        ),
        spec_of(
            Kind::AllReduce(ReduceOp::Max),
            DType::F16,
            even_counts(9_999, world),
            24,
        ),
    ];
    let want: Vec<Vec<u8>> = specs.iter().map(|s| expected(s, world)).collect();
    for trial in 0..6u64 {
        let out = ThreadGroup::run(world, |comm| {
            let mut rng = trial * 1000 + comm.rank() as u64;
            for (i, s) in specs.iter().enumerate() {
                let nap = splitmix(&mut rng) % 4_000;
                std::thread::sleep(Duration::from_micros(nap));
                issue(&comm, s)(&want[i]).map_err(|e| format!("collective {i}: {e}"))?;
            }
            Ok::<(), String>(())
        })
        .unwrap();
        for (rank, r) in out.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("trial {trial}, rank {rank}: {e}"));
        }
    }
}

/// `wait_timed` says when the collective ran on the progress thread: after
/// it was issued, before its result came back, and not before the last
/// rank arrived (a rank that starts late holds everyone's collective).
#[test]
fn wait_timed_reports_when_the_collective_ran() {
    let late = Duration::from_millis(30);
    let out = ThreadGroup::run(2, |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(late);
        }
        let issued = std::time::Instant::now();
        let buf = HostBuffer::from_slice(&[1.0f32; 1024]).unwrap();
        let (buf, timing) = comm
            .all_reduce(buf, ReduceOp::Sum)
            .wait_timed()
            .expect("all-reduce");
        let back = std::time::Instant::now();
        assert_eq!(buf[0], 2.0);
        let t = timing.expect("a collective that ran has its timing");
        assert!(issued <= t.started && t.started <= t.finished && t.finished <= back);
        (comm.rank(), t.finished.duration_since(t.started))
    })
    .unwrap();
    // Rank 0 issued at once and waited inside the collective for rank 1.
    let (_, waited) = out.iter().find(|(r, _)| *r == 0).copied().unwrap();
    assert!(waited >= late / 2, "rank 0's collective ran {waited:?}");
}
