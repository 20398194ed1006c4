//! Collective bandwidth: all-reduce, reduce-scatter and all-gather on
//! 1 MiB … 256 MiB of f32, in the NCCL-tests convention:
//!
//! - algbw = S / t, where S is the size of the full buffer (all-reduce: the
//!   buffer; reduce-scatter: the input; all-gather: the output);
//! - busbw = algbw × 2(n−1)/n for all-reduce, × (n−1)/n for the others.
//!
//! Each figure has its baseline measured in the same run, on the same
//! threads or processes, because these machines are shared and noisy:
//!
//! - threads backend (`cargo bench --bench collectives`): a plain memcpy of
//!   S bytes on every rank's thread at once; target: all-reduce busbw ≥ 80%
//!   of memcpy bandwidth.
//! - MPI backend (`scripts/mpirun.sh -n 2 cargo bench --bench collectives`):
//!   OpenMPI's own MPI_Allreduce / MPI_Reduce_scatter_block / MPI_Allgather
//!   on the same registered buffers; target: ≥ 3× their busbw at ≥ 16 MiB
//!   and never slower.
//!
//! Options (after `--`): `--sizes 1,4,16` (MiB), `--ranks N` (threads
//! backend; default: the number of cores), `--reps R` (timed repetitions,
//! the median is reported; default 5).

use std::time::{Duration, Instant};

use zero_comm::{even_counts, Communicator, ReduceOp, ThreadGroup};
use zero_core::HostBuffer;

const MIB: usize = 1 << 20;

struct Args {
    sizes_mib: Vec<usize>,
    ranks: usize,
    reps: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        sizes_mib: vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
        ranks: std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .max(2),
        reps: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--sizes" => {
                a.sizes_mib = it
                    .next()
                    .expect("--sizes needs a list like 1,16,256")
                    .split(',')
                    .map(|s| s.trim().parse().expect("--sizes: MiB as integers"))
                    .collect()
            }
            "--ranks" => a.ranks = it.next().and_then(|s| s.parse().ok()).expect("--ranks N"),
            "--reps" => a.reps = it.next().and_then(|s| s.parse().ok()).expect("--reps R"),
            _ => {} // cargo passes --bench; ignore what we do not know
        }
    }
    a
}

/// Repetitions of `iters` back-to-back calls, each repetition started
/// together on every rank; returns the median time of one call.
fn time_it<C: Communicator>(comm: &C, reps: usize, iters: usize, mut f: impl FnMut()) -> Duration {
    f(); // warm-up: page faults, caches
    let mut t: Vec<Duration> = (0..reps)
        .map(|_| {
            comm.barrier().wait().expect("barrier");
            let t0 = Instant::now();
            for _ in 0..iters {
                f();
            }
            comm.barrier().wait().expect("barrier");
            t0.elapsed() / iters as u32
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Iterations per repetition: about 512 MiB of traffic, at least 2.
fn iters_for(bytes: usize) -> usize {
    (512 * MIB / bytes).clamp(2, 64)
}

#[derive(Default)]
struct Row {
    mib: usize,
    base: [f64; 4],
    ours: [f64; 4],
}

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
const NAMES: [&str; 4] = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_gather_in_place",
];

fn bus_factor(kind: usize, n: usize) -> f64 {
    let n = n as f64;
    if kind == 0 {
        2.0 * (n - 1.0) / n
    } else {
        (n - 1.0) / n
    }
}

/// Our collectives on buffers from `comm.alloc`; busbw in GB/s: all_reduce,
/// reduce_scatter, all_gather, all_gather_in_place.
fn ours<C: Communicator>(comm: &C, bytes: usize, reps: usize) -> [f64; 4] {
    let n = comm.world_size();
    let len = bytes / 4;
    let counts = even_counts(len, n);
    let iters = iters_for(bytes);
    let mut out = [0.0; 4];

    let mut buf = Some(comm.alloc::<f32>(len).expect("alloc"));
    let t = time_it(comm, reps, iters, || {
        let b = buf.take().expect("buffer");
        buf = Some(
            comm.all_reduce(b, ReduceOp::Sum)
                .wait()
                .expect("all_reduce"),
        );
    });
    out[0] = gbps(bytes, t) * bus_factor(0, n);
    drop(buf);

    let mut bufs = Some((
        comm.alloc::<f32>(len).expect("alloc"),
        comm.alloc::<f32>(counts[comm.rank()]).expect("alloc"),
    ));
    let t = time_it(comm, reps, iters, || {
        let (s, r) = bufs.take().expect("buffers");
        bufs = Some(
            comm.reduce_scatter(s, r, &counts, ReduceOp::Sum)
                .wait()
                .expect("reduce_scatter"),
        );
    });
    out[1] = gbps(bytes, t) * bus_factor(1, n);
    let (big, small) = bufs.take().expect("buffers");

    let mut bufs = Some((small, big));
    let t = time_it(comm, reps, iters, || {
        let (s, r) = bufs.take().expect("buffers");
        bufs = Some(comm.all_gather(s, r, &counts).wait().expect("all_gather"));
    });
    out[2] = gbps(bytes, t) * bus_factor(2, n);
    let (small, big) = bufs.take().expect("buffers");
    drop(small);

    let mut buf = Some(big);
    let t = time_it(comm, reps, iters, || {
        let b = buf.take().expect("buffer");
        buf = Some(
            comm.all_gather_in_place(b, &counts)
                .wait()
                .expect("all_gather_in_place"),
        );
    });
    out[3] = gbps(bytes, t) * bus_factor(2, n);
    out
}

fn print_table(title: &str, base_name: &str, rows: &[Row]) {
    println!("\n{title}");
    let names = [
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "all_gather in place",
    ];
    let head = names.map(|n| format!("{n} busbw GB/s"));
    println!(
        "{:>9} | {}",
        "size",
        head.map(|h| format!("{h:>28}")).join(" | ")
    );
    let sub = format!("ours / {base_name} = ratio");
    println!(
        "{:>9} | {}",
        "",
        [(); 4].map(|_| format!("{sub:>28}")).join(" | ")
    );
    for r in rows {
        let cells = [0, 1, 2, 3].map(|k| {
            format!(
                "{:>7.2} / {:>7.2} = {:>5.2}x",
                r.ours[k],
                r.base[k],
                r.ours[k] / r.base[k]
            )
        });
        println!("{:>6} MiB | {}", r.mib, cells.join(" | "));
    }
}

fn threads_suite(a: &Args) {
    let n = a.ranks;
    println!(
        "backend: threads, {n} ranks in one process; algorithms: all_reduce = one-pass \
         direct read + write-back (shm/all_reduce.rs), reduce_scatter = pull-reduce, \
         all_gather = pull-copy"
    );
    let rows = ThreadGroup::run(n, |comm| {
        a.sizes_mib
            .iter()
            .map(|&mib| {
                let bytes = mib * MIB;
                // Baseline: every rank's thread copies `bytes` at the same time.
                let src = HostBuffer::<f32>::from_fn(bytes / 4, |i| i as f32).expect("alloc");
                let mut dst = HostBuffer::<f32>::zeros(bytes / 4).expect("alloc");
                let t = time_it(&comm, a.reps, iters_for(bytes), || {
                    dst.copy_from_slice(&src);
                    std::hint::black_box(&mut dst);
                });
                drop((src, dst));
                let memcpy = gbps(bytes, t);
                Row {
                    mib,
                    base: [memcpy; 4],
                    ours: ours(&comm, bytes, a.reps),
                }
            })
            .collect::<Vec<_>>()
    })
    .expect("thread group")
    .swap_remove(0);
    print_table(
        "busbw (NCCL-tests convention) vs memcpy bandwidth on the same threads",
        "memcpy",
        &rows,
    );
    let worst = rows
        .iter()
        .map(|r| (r.ours[0] / r.base[0], r.mib))
        .fold((f64::INFINITY, 0), |m, x| if x.0 < m.0 { x } else { m });
    println!(
        "\ntarget: threads all_reduce busbw >= 0.80 x memcpy at every size: worst {:.2}x at {} MiB -> {}",
        worst.0,
        worst.1,
        if worst.0 >= 0.80 { "met" } else { "NOT met" }
    );
}

#[cfg(feature = "mpi")]
fn mpi_suite(a: &Args) {
    use zero_comm::{CommOptions, MpiComm};
    let comm = MpiComm::init(&CommOptions::from_env().expect("options")).expect("MPI init");
    let n = comm.world_size();
    if comm.rank() == 0 {
        println!(
            "backend: mpi, {n} ranks on {} node(s), {} per node; algorithms: {}",
            comm.node_count(),
            comm.local_size(),
            if comm.node_count() == 1 {
                "intra-node shared window: all_reduce one-pass direct, reduce_scatter pull-reduce, all_gather pull-copy"
            } else {
                "hierarchical: shared window within nodes, MPI collectives between nodes"
            }
        );
    }
    let mut rows = Vec::new();
    for &mib in &a.sizes_mib {
        let bytes = mib * MIB;
        let len = bytes / 4;
        let iters = iters_for(bytes);
        let mut base = [0.0; 4];
        let mut buf = comm.alloc::<f32>(len).expect("alloc");
        let t = time_it(&comm, a.reps, iters, || {
            comm.native_all_reduce(&mut buf).expect("MPI_Allreduce")
        });
        base[0] = gbps(bytes, t) * bus_factor(0, n);
        if len.is_multiple_of(n) {
            let mut small = comm.alloc::<f32>(len / n).expect("alloc");
            let t = time_it(&comm, a.reps, iters, || {
                comm.native_reduce_scatter_block(&buf, &mut small)
                    .expect("MPI_Reduce_scatter_block")
            });
            base[1] = gbps(bytes, t) * bus_factor(1, n);
            let t = time_it(&comm, a.reps, iters, || {
                comm.native_all_gather(&small, &mut buf)
                    .expect("MPI_Allgather")
            });
            base[2] = gbps(bytes, t) * bus_factor(2, n);
            let t = time_it(&comm, a.reps, iters, || {
                comm.native_all_gather_in_place(&mut buf)
                    .expect("MPI_Allgather(MPI_IN_PLACE)")
            });
            base[3] = gbps(bytes, t) * bus_factor(2, n);
        }
        drop(buf);
        rows.push(Row {
            mib,
            base,
            ours: ours(&comm, bytes, a.reps),
        });
    }
    if comm.rank() == 0 {
        print_table(
            "busbw (NCCL-tests convention) vs OpenMPI's own collective on the same buffers",
            "MPI",
            &rows,
        );
        for (k, name) in NAMES.iter().enumerate() {
            let big = rows
                .iter()
                .filter(|r| r.mib >= 16)
                .map(|r| r.ours[k] / r.base[k])
                .fold(f64::INFINITY, f64::min);
            let all = rows
                .iter()
                .map(|r| r.ours[k] / r.base[k])
                .fold(f64::INFINITY, f64::min);
            println!(
                "target {:<14}: >= 3x MPI at >= 16 MiB: worst {:.2}x -> {}; never slower: worst {:.2}x -> {}",
                name,
                big,
                if big >= 3.0 { "met" } else { "NOT met" },
                all,
                if all >= 1.0 { "met" } else { "NOT met" }
            );
        }
    }
}

fn main() {
    let a = parse_args();
    if zero_comm::launched_by_mpi() {
        #[cfg(feature = "mpi")]
        mpi_suite(&a);
        #[cfg(not(feature = "mpi"))]
        panic!("started under mpirun, but this build has no `mpi` feature");
    } else {
        threads_suite(&a);
    }
}
