//! The MPI backend, end to end (`harness = false`, feature `mpi`).
//!
//! Run directly (`cargo test -p zero-comm --test mpi`), this binary is the
//! *driver*: it starts itself under `mpirun` several times and sums up what
//! the ranks report:
//!
//! - `-n 2` and `-n 3` on one node (shared memory only),
//! - `-n 4` with `ZERO_MPI_SIMULATE_NODES=2` (hierarchical all-reduce, MPI
//!   collectives between the two pseudo-nodes, validation over MPI),
//! - `-n 3` with `ZERO_MPI_SIMULATE_NODES=2` (nodes of 2 and 1 ranks: the
//!   flat MPI all-reduce),
//! - `-n 2` where rank 1's process dies (rank 0 must see `PeerFailed`).
//!
//! Each run has a wall-clock limit, so a hang fails the test; a missing
//! `mpirun` is a failure, not a skip. Started by `mpirun` (as a *worker*),
//! every rank checks every collective x dtype x reduction against
//! [`reference_reduce`] and sequential references, on registered (pool),
//! unregistered (heap) and mixed buffers, the byte all-gather and the
//! agreements built on it (exact bytes and u64 words, per-rank lengths,
//! the first failing rank), then the failure behaviour
//! (mismatch, timeout, peers that leave or fail), each failure on a
//! communicator of its own. The last line is `mpi: N passed, M failed`.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zero_comm::agree::{exchange_bytes, exchange_u64, first_failure};
use zero_comm::{
    even_counts, launch, launched_by_mpi, offsets, reference_reduce, Comm, CommOptions,
    Communicator, Error, MpiComm, ReduceOp,
};
use zero_core::{bf16, f16, Element, HostBuffer};

static_assertions::assert_impl_all!(MpiComm: Send, Sync);
static_assertions::assert_impl_all!(Comm: Send, Sync);

const PHASE_ENV: &str = "ZERO_MPI_TEST_PHASE";

fn main() {
    let code = if launched_by_mpi() {
        worker()
    } else {
        driver()
    };
    std::process::exit(code);
}

// ───────────────────────────── driver ─────────────────────────────

struct Run {
    name: &'static str,
    ranks: usize,
    env: &'static [(&'static str, &'static str)],
    phase: &'static str,
    limit: Duration,
}

const RUNS: &[Run] = &[
    Run {
        name: "2 ranks, one node, 64M pool",
        ranks: 2,
        env: &[("ZERO_MPI_SHM_POOL", "64M")],
        phase: "main",
        limit: Duration::from_secs(90),
    },
    Run {
        name: "3 ranks, one node, default pool",
        ranks: 3,
        env: &[],
        phase: "main",
        limit: Duration::from_secs(90),
    },
    Run {
        name: "4 ranks, 2 simulated nodes, 64M pool",
        ranks: 4,
        env: &[
            ("ZERO_MPI_SIMULATE_NODES", "2"),
            ("ZERO_MPI_SHM_POOL", "64M"),
        ],
        phase: "main",
        limit: Duration::from_secs(120),
    },
    Run {
        name: "3 ranks, 2 simulated nodes of 2 and 1 ranks (flat MPI all-reduce)",
        ranks: 3,
        env: &[
            ("ZERO_MPI_SIMULATE_NODES", "2"),
            ("ZERO_MPI_SHM_POOL", "64M"),
        ],
        phase: "main",
        limit: Duration::from_secs(120),
    },
    Run {
        name: "2 ranks, rank 1's process dies",
        ranks: 2,
        env: &[],
        phase: "crash",
        limit: Duration::from_secs(60),
    },
];

fn find_mpirun() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("mpirun"))
        .find(|p| p.is_file())
}

fn driver() -> i32 {
    let (mut passed, mut failed) = (0usize, 0usize);
    let started = Instant::now();

    // Without mpirun: `launch` runs threads, and MpiComm is usable as a type.
    match launch(2, &CommOptions::default(), |c| {
        let b = c.alloc::<f32>(3).unwrap();
        let ok = c.all_reduce(b, ReduceOp::Sum).wait().is_ok();
        (c.backend(), ok, c.ranks_on_host())
    }) {
        Ok(v) if v == vec![("threads", true, 2); 2] => passed += 1,
        other => {
            failed += 1;
            println!("FAIL driver: launch without mpirun should run 2 thread ranks: {other:?}");
        }
    }

    let Some(mpirun) = find_mpirun() else {
        println!("FAIL driver: `mpirun` not found in PATH; the MPI tests need Open MPI or MPICH");
        println!("mpi: {passed} passed, {} failed", failed + 1);
        return 1;
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    for run in RUNS {
        let t = Instant::now();
        let (p, f, notes) = run_mpirun(&mpirun, &exe, run);
        passed += p;
        failed += f;
        println!(
            "{} run `{}` (-n {}): {p} passed, {f} failed in {:.1?}",
            if f == 0 { "ok  " } else { "FAIL" },
            run.name,
            run.ranks,
            t.elapsed()
        );
        for n in notes {
            println!("    {n}");
        }
    }
    println!("(total {:.1?})", started.elapsed());
    println!("mpi: {passed} passed, {failed} failed");
    i32::from(failed > 0)
}

/// Runs one mpirun; returns (passed, failed, lines worth showing).
fn run_mpirun(
    mpirun: &std::path::Path,
    exe: &std::path::Path,
    run: &Run,
) -> (usize, usize, Vec<String>) {
    let mut cmd = Command::new(mpirun);
    cmd.args(["-n", &run.ranks.to_string()])
        .args(["--oversubscribe", "--allow-run-as-root"]);
    if run.phase == "crash" {
        // Rank 0 must outlive rank 1's exit to report what it saw.
        cmd.args(["--mca", "orte_abort_on_non_zero_status", "0"]);
    }
    cmd.arg(exe)
        .env(PHASE_ENV, run.phase)
        .env_remove("ZERO_MPI_SIMULATE_NODES")
        .env_remove("ZERO_MPI_SHM_POOL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in run.env {
        cmd.env(k, v);
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return (0, 1, vec![format!("cannot start mpirun: {e}")]),
    };
    let out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        BufReader::new(out)
            .lines()
            .map_while(|l| l.ok())
            .collect::<Vec<_>>()
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + run.limit;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                timed_out = true;
                // SIGTERM lets mpirun take its ranks down; then SIGKILL.
                // SAFETY: signalling our own child process by its pid.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                let grace = Instant::now() + Duration::from_secs(5);
                while Instant::now() < grace {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = child.kill();
                break child.wait().ok();
            }
            Err(_) => break None,
        }
    };
    let lines = reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();

    let (mut passed, mut failed) = (0usize, 0usize);
    let mut notes = Vec::new();
    let mut reported = Vec::new();
    for l in &lines {
        if let Some(rest) = l.strip_prefix("RESULT rank ") {
            // "RESULT rank R passed P failed F"
            let w: Vec<&str> = rest.split_whitespace().collect();
            if let [r, "passed", p, "failed", f] = w[..] {
                reported.push(r.parse::<usize>().unwrap_or(usize::MAX));
                passed += p.parse::<usize>().unwrap_or(0);
                failed += f.parse::<usize>().unwrap_or(1);
            }
        } else if l.starts_with("FAIL") || l.starts_with("note") {
            notes.push(l.clone());
        }
    }
    let expected: Vec<usize> = if run.phase == "crash" {
        vec![0]
    } else {
        (0..run.ranks).collect()
    };
    reported.sort_unstable();
    if reported != expected {
        failed += 1;
        notes.push(format!(
            "FAIL ranks that reported: {reported:?}, expected {expected:?}"
        ));
    }
    if timed_out {
        failed += 1;
        notes.push(format!("FAIL mpirun did not finish within {:?}", run.limit));
    } else if run.phase != "crash" && !status.is_some_and(|s| s.success()) {
        failed += 1;
        notes.push(format!("FAIL mpirun exited with {status:?}"));
    }
    if failed > 0 {
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        for l in tail.into_iter().rev() {
            notes.push(format!("stderr: {l}"));
        }
    }
    (passed, failed, notes)
}

// ───────────────────────────── worker ─────────────────────────────

/// Checks of one rank.
struct Report {
    rank: usize,
    passed: usize,
    failed: usize,
    lines: String,
}

impl Report {
    fn check(&mut self, name: &str, ok: bool, detail: impl FnOnce() -> String) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
            let d = detail();
            self.lines
                .push_str(&format!("FAIL rank {}: {name}: {d}\n", self.rank));
        }
    }

    fn result(&mut self, name: &str, r: Result<(), String>) {
        self.check(name, r.is_ok(), || r.err().unwrap_or_default());
    }

    fn finish(self) -> i32 {
        print!("{}", self.lines);
        println!(
            "RESULT rank {} passed {} failed {}",
            self.rank, self.passed, self.failed
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        i32::from(self.failed > 0)
    }
}

fn worker() -> i32 {
    let phase = std::env::var(PHASE_ENV).unwrap_or_else(|_| "main".into());
    let opts = CommOptions {
        timeout: Duration::from_secs(60),
        validate: true,
    };
    let r = launch(1, &opts, |comm| {
        let mut rep = Report {
            rank: comm.rank(),
            passed: 0,
            failed: 0,
            lines: String::new(),
        };
        match phase.as_str() {
            "crash" => {
                crash_phase(&comm, &mut rep);
                // A peer died: MPI_Finalize could wait for it forever, so
                // report and leave without finalising.
                let code = rep.finish();
                std::process::exit(code);
            }
            _ => {
                let t = Instant::now();
                main_checks(&comm, &mut rep);
                let t_main = t.elapsed();
                failure_checks(&comm, &mut rep);
                if comm.rank() == 0 {
                    rep.lines.push_str(&format!(
                        "note: correctness checks {t_main:.1?}, failure checks {:.1?}\n",
                        t.elapsed() - t_main
                    ));
                }
            }
        }
        rep
    });
    match r {
        Ok(mut v) => v.pop().map_or(1, Report::finish),
        Err(e) => {
            println!("FAIL rank ?: MPI set-up: {e}");
            println!("RESULT rank 999 passed 0 failed 1");
            1
        }
    }
}

fn mpi(comm: &Comm) -> &MpiComm {
    match comm {
        Comm::Mpi(m) => m,
        Comm::Threads(_) => panic!("the worker runs under mpirun"),
    }
}

// ───────────────────────── data and references ─────────────────────────

/// Where results must equal the reference bit for bit whatever MPI's
/// reduction order: values k/8 with |k| <= 64 are exact in bf16 and f16,
/// and sums of up to 4 of them are exact in f32.
struct Data {
    exact: bool,
}

impl Data {
    fn value(&self, rank: usize, i: usize, salt: usize) -> f32 {
        let h = (rank * 7919 + i * 104_729 + salt * 15_485_863) % 1_000_003;
        if self.exact {
            ((h % 129) as f32 - 64.0) / 8.0
        } else {
            (h as f32 / 1_000_003.0 - 0.5) * 3.7
        }
    }

    fn vec<T: Element>(
        &self,
        rank: usize,
        len: usize,
        salt: usize,
        op: Option<ReduceOp>,
    ) -> Vec<T> {
        (0..len)
            .map(|i| {
                if op == Some(ReduceOp::Max) && i == 3 && rank == 1 {
                    T::from_f32(f32::NAN)
                } else {
                    T::from_f32(self.value(rank, i, salt))
                }
            })
            .collect()
    }
}

fn same<T: Element>(a: &[T], b: &[T]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("length {} != expected {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let (x, y) = (x.to_f32(), y.to_f32());
        if !(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())) {
            return Err(format!(
                "element {i} of {}: got {x:e}, expected {y:e}",
                a.len()
            ));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Buffers from `alloc` on every rank.
    Registered,
    /// Heap buffers on every rank.
    Heap,
    /// Pool on even ranks, heap on odd ones.
    Mixed,
    /// Pool on the first half of the ranks (with two nodes: one node
    /// registered, the other not).
    FirstHalf,
}

fn make<T: Element>(comm: &Comm, mode: Mode, data: &[T]) -> HostBuffer<T> {
    let pool = match mode {
        Mode::Registered => true,
        Mode::Heap => false,
        Mode::Mixed => comm.rank().is_multiple_of(2),
        Mode::FirstHalf => comm.rank() < comm.world_size().div_ceil(2),
    };
    if pool {
        let mut b = comm.alloc::<T>(data.len()).expect("alloc");
        b.copy_from_slice(data);
        b
    } else {
        HostBuffer::from_slice(data).expect("heap buffer")
    }
}

fn zeros<T: Element>(comm: &Comm, mode: Mode, len: usize) -> HostBuffer<T> {
    make(comm, mode, &vec![T::from_f32(0.0); len])
}

// ───────────────────────────── checks ─────────────────────────────

/// Counts that are uneven on purpose: a zero, a big and small parts.
fn uneven(len: usize, n: usize) -> Vec<usize> {
    let mut c = vec![0; n];
    if n == 1 {
        c[0] = len;
        return c;
    }
    c[0] = len / 2;
    c[n - 1] = 0;
    let rest = len - c[0];
    let k = (n - 1).max(1);
    for (j, x) in c.iter_mut().enumerate().skip(1).take(k) {
        *x = rest / k + usize::from(j - 1 < rest % k);
    }
    if n > 2 {
        // Move the last share to the end: [big, .., small, 0] → [big, .., 0, small]
        c.swap(n - 1, n - 2);
    }
    c
}

fn all_reduce_check<T: Element>(
    comm: &Comm,
    rep: &mut Report,
    d: &Data,
    len: usize,
    op: ReduceOp,
    mode: Mode,
) {
    let (r, n) = (comm.rank(), comm.world_size());
    let inputs: Vec<Vec<T>> = (0..n).map(|p| d.vec::<T>(p, len, 1, Some(op))).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
    let want = reference_reduce(&refs, op);
    let buf = make(comm, mode, &inputs[r]);
    let got = comm.all_reduce(buf, op).wait();
    rep.result(
        &format!("all_reduce {} {op} len {len} {mode:?}", T::DTYPE),
        got.map_err(|e| e.to_string()).and_then(|b| same(&b, &want)),
    );
}

fn reduce_scatter_check<T: Element>(
    comm: &Comm,
    rep: &mut Report,
    d: &Data,
    counts: &[usize],
    op: ReduceOp,
    mode: Mode,
    in_place: bool,
) {
    let (r, n) = (comm.rank(), comm.world_size());
    let len: usize = counts.iter().sum();
    let offs = offsets(counts);
    let inputs: Vec<Vec<T>> = (0..n).map(|p| d.vec::<T>(p, len, 2, Some(op))).collect();
    let parts: Vec<&[T]> = inputs
        .iter()
        .map(|v| &v[offs[r]..offs[r] + counts[r]])
        .collect();
    let want = reference_reduce(&parts, op);
    let name = format!(
        "reduce_scatter{} {} {op} counts {counts:?} {mode:?}",
        if in_place { "_in_place" } else { "" },
        T::DTYPE
    );
    let send = make(comm, mode, &inputs[r]);
    let got = if in_place {
        comm.reduce_scatter_in_place(send, counts, op)
            .wait()
            .map(|b| {
                // The rest of the buffer is left as it was.
                let mut rest = b.to_vec();
                let mine = rest[offs[r]..offs[r] + counts[r]].to_vec();
                rest[offs[r]..offs[r] + counts[r]]
                    .copy_from_slice(&inputs[r][offs[r]..offs[r] + counts[r]]);
                (mine, same(&rest, &inputs[r]))
            })
    } else {
        comm.reduce_scatter(send, zeros::<T>(comm, mode, counts[r]), counts, op)
            .wait()
            .map(|(s, o)| (o.to_vec(), same(&s, &inputs[r])))
    };
    rep.result(
        &name,
        got.map_err(|e| e.to_string()).and_then(|(out, rest)| {
            same(&out, &want)?;
            rest.map_err(|e| format!("input changed: {e}"))
        }),
    );
}

fn all_gather_check<T: Element>(
    comm: &Comm,
    rep: &mut Report,
    d: &Data,
    counts: &[usize],
    mode: Mode,
    in_place: bool,
) {
    let (r, n) = (comm.rank(), comm.world_size());
    let len: usize = counts.iter().sum();
    let offs = offsets(counts);
    let parts: Vec<Vec<T>> = (0..n).map(|p| d.vec::<T>(p, counts[p], 3, None)).collect();
    let want: Vec<T> = parts.concat();
    let name = format!(
        "all_gather{} {} counts {counts:?} {mode:?}",
        if in_place { "_in_place" } else { "" },
        T::DTYPE
    );
    let got = if in_place {
        let mut init = vec![T::from_f32(-1.0); len];
        init[offs[r]..offs[r] + counts[r]].copy_from_slice(&parts[r]);
        let buf = make(comm, mode, &init);
        comm.all_gather_in_place(buf, counts)
            .wait()
            .map(|b| b.to_vec())
    } else {
        let send = make(comm, mode, &parts[r]);
        comm.all_gather(send, zeros::<T>(comm, mode, len), counts)
            .wait()
            .map(|(_, o)| o.to_vec())
    };
    rep.result(
        &name,
        got.map_err(|e| e.to_string()).and_then(|o| same(&o, &want)),
    );
}

fn broadcast_check<T: Element>(
    comm: &Comm,
    rep: &mut Report,
    d: &Data,
    len: usize,
    root: usize,
    mode: Mode,
) {
    let r = comm.rank();
    let want = d.vec::<T>(root, len, 4, None);
    let mine = if r == root {
        want.clone()
    } else {
        d.vec::<T>(r, len, 5, None)
    };
    let buf = make(comm, mode, &mine);
    let got = comm.broadcast(buf, root).wait();
    rep.result(
        &format!("broadcast {} len {len} root {root} {mode:?}", T::DTYPE),
        got.map_err(|e| e.to_string()).and_then(|b| same(&b, &want)),
    );
}

fn dtype_suite<T: Element>(comm: &Comm, rep: &mut Report, d: &Data, big: usize) {
    let n = comm.world_size();
    for mode in [Mode::Registered, Mode::Heap, Mode::Mixed, Mode::FirstHalf] {
        for len in [0, 1, 7, 1001] {
            for op in ReduceOp::ALL {
                all_reduce_check::<T>(comm, rep, d, len, op, mode);
                for in_place in [false, true] {
                    reduce_scatter_check::<T>(
                        comm,
                        rep,
                        d,
                        &even_counts(len, n),
                        op,
                        mode,
                        in_place,
                    );
                }
            }
            reduce_scatter_check::<T>(comm, rep, d, &uneven(len, n), ReduceOp::Sum, mode, false);
            for in_place in [false, true] {
                all_gather_check::<T>(comm, rep, d, &even_counts(len, n), mode, in_place);
                all_gather_check::<T>(comm, rep, d, &uneven(len, n), mode, in_place);
            }
            broadcast_check::<T>(comm, rep, d, len, n - 1, mode);
        }
        // Large: more than one bounce chunk with a 64M pool.
        all_reduce_check::<T>(comm, rep, d, big, ReduceOp::Sum, mode);
        reduce_scatter_check::<T>(comm, rep, d, &uneven(big, n), ReduceOp::Sum, mode, false);
        all_gather_check::<T>(comm, rep, d, &uneven(big, n), mode, mode == Mode::Heap);
        if T::DTYPE == zero_core::DType::F32 {
            all_reduce_check::<T>(comm, rep, d, big, ReduceOp::Max, mode);
            reduce_scatter_check::<T>(
                comm,
                rep,
                d,
                &even_counts(big, n),
                ReduceOp::Avg,
                mode,
                true,
            );
            broadcast_check::<T>(comm, rep, d, big, 0, mode);
        }
    }
}

fn main_checks(comm: &Comm, rep: &mut Report) {
    let m = mpi(comm);
    let (r, n) = (comm.rank(), comm.world_size());
    let nodes: usize = std::env::var("ZERO_MPI_SIMULATE_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let world: usize = std::env::var("OMPI_COMM_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    rep.check(
        "backend and sizes",
        comm.backend() == "mpi" && n == world,
        || format!("backend {} world {n}, mpirun says {world}", comm.backend()),
    );
    // Pseudo-nodes are blocks of consecutive ranks: rank q is on block q*k/n.
    let block = |q: usize| q * nodes / n;
    let mates: Vec<usize> = (0..n).filter(|&q| block(q) == block(r)).collect();
    rep.check(
        "node_count / local_size / local_rank",
        m.node_count() == nodes
            && m.local_size() == mates.len()
            && mates.get(m.local_rank()) == Some(&r),
        || format!("{m:?}, expected {nodes} node(s), node mates {mates:?}"),
    );

    // Registered buffers: zeroed, aligned, recognised; reuse is zeroed too.
    let mut b = comm.alloc::<f32>(1000).expect("alloc");
    rep.check(
        "alloc: registered, zeroed, 64-byte aligned",
        m.is_registered(&b)
            && b.iter().all(|&x| x == 0.0)
            && (b.as_ptr() as usize).is_multiple_of(64),
        || {
            format!(
                "registered {} aligned {}",
                m.is_registered(&b),
                b.as_ptr() as usize % 64
            )
        },
    );
    b.fill(7.0);
    drop(b);
    let b = comm.alloc::<bf16>(1500).expect("alloc");
    rep.check(
        "alloc: reused memory is zeroed",
        b.iter().all(|x| x.to_f32() == 0.0),
        || "old values visible".into(),
    );
    drop(b);
    let heap = HostBuffer::<f32>::zeros(10).unwrap();
    rep.check(
        "heap buffers are not registered",
        !m.is_registered(&heap),
        String::new,
    );
    let too_big = comm.alloc::<f32>(1 << 40);
    rep.check(
        "alloc beyond the pool names ZERO_MPI_SHM_POOL and its size",
        matches!(&too_big, Err(Error::Config { msg, .. }) if msg.contains("ZERO_MPI_SHM_POOL") && msg.contains("bytes per rank")),
        || format!("{too_big:?}"),
    );

    let d = Data { exact: nodes > 1 };
    let big = (1 << 21) + 3; // 2M + 3: not divisible by 2, 3 or 4
    dtype_suite::<f32>(comm, rep, &d, big);
    dtype_suite::<bf16>(comm, rep, &d, big);
    dtype_suite::<f16>(comm, rep, &d, 100_003);

    // Several collectives in flight before any wait, waited in reverse.
    {
        let counts = even_counts(4099, n);
        let a_in: Vec<Vec<f32>> = (0..n).map(|p| d.vec(p, 5000, 6, None)).collect();
        let want_a = reference_reduce(
            &a_in.iter().map(|v| &v[..]).collect::<Vec<_>>(),
            ReduceOp::Sum,
        );
        let s_in: Vec<Vec<bf16>> = (0..n).map(|p| d.vec(p, 4099, 7, None)).collect();
        let offs = offsets(&counts);
        let want_s = reference_reduce(
            &s_in
                .iter()
                .map(|v| &v[offs[r]..offs[r] + counts[r]])
                .collect::<Vec<_>>(),
            ReduceOp::Avg,
        );
        let g_in: Vec<Vec<f16>> = (0..n).map(|p| d.vec(p, counts[p], 8, None)).collect();
        let w1 = comm.all_reduce(make(comm, Mode::Registered, &a_in[r]), ReduceOp::Sum);
        let w2 = comm.reduce_scatter(
            make(comm, Mode::Heap, &s_in[r]),
            zeros::<bf16>(comm, Mode::Registered, counts[r]),
            &counts,
            ReduceOp::Avg,
        );
        let w3 = comm.all_gather(
            make(comm, Mode::Mixed, &g_in[r]),
            zeros::<f16>(comm, Mode::Mixed, 4099),
            &counts,
        );
        let w4 = comm.barrier();
        let w5 = comm.broadcast(make(comm, Mode::Registered, &a_in[r]), 0);
        let seqs = [w1.seq(), w2.seq(), w3.seq(), w4.seq(), w5.seq()];
        let r5 = w5
            .wait()
            .map_err(|e| e.to_string())
            .and_then(|b| same(&b, &a_in[0]));
        let r4 = w4.wait().map_err(|e| e.to_string());
        let r3 = w3
            .wait()
            .map_err(|e| e.to_string())
            .and_then(|(_, o)| same(&o, &g_in.concat()));
        let r2 = w2
            .wait()
            .map_err(|e| e.to_string())
            .and_then(|(_, o)| same(&o, &want_s));
        let r1 = w1
            .wait()
            .map_err(|e| e.to_string())
            .and_then(|b| same(&b, &want_a));
        let all = [r1, r2, r3, r4, r5];
        rep.check(
            "five collectives in flight, waited in reverse",
            all.iter().all(|x| x.is_ok()) && seqs.windows(2).all(|w| w[1] == w[0] + 1),
            || format!("{all:?}, seqs {seqs:?}"),
        );
    }

    // The native MPI baselines compute the same sums.
    {
        let per = 1000;
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|p| Data { exact: true }.vec(p, per * n, 9, None))
            .collect();
        let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
        let sum = reference_reduce(&refs, ReduceOp::Sum);
        let mut buf = make(comm, Mode::Registered, &inputs[r]);
        let res = m
            .native_all_reduce(&mut buf)
            .map_err(|e| e.to_string())
            .and_then(|_| same(&buf, &sum));
        rep.result("native_all_reduce", res);
        let send = make(comm, Mode::Registered, &inputs[r]);
        let mut recv = zeros::<f32>(comm, Mode::Registered, per);
        let res = m
            .native_reduce_scatter_block(&send, &mut recv)
            .map_err(|e| e.to_string())
            .and_then(|_| same(&recv, &sum[r * per..(r + 1) * per]));
        rep.result("native_reduce_scatter_block", res);
        let mut all = zeros::<f32>(comm, Mode::Heap, per * n);
        let mine = make(comm, Mode::Heap, &inputs[r][..per]);
        let want: Vec<f32> = inputs.iter().flat_map(|v| v[..per].to_vec()).collect();
        let res = m
            .native_all_gather(&mine, &mut all)
            .map_err(|e| e.to_string())
            .and_then(|_| same(&all, &want));
        rep.result("native_all_gather", res);
        let bad = m.native_all_gather(&mine, &mut recv);
        rep.check(
            "native_all_gather rejects wrong sizes",
            matches!(bad, Err(Error::InvalidArgument { .. })),
            || format!("{bad:?}"),
        );
    }
    byte_checks(comm, rep);
    let b = comm.barrier().wait();
    rep.check("barrier", b.is_ok(), || format!("{b:?}"));
}

/// Bytes of rank `rank`: every value 0..=255, in an order of its own.
fn noise(rank: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + rank * 61 + (i >> 8)) % 256) as u8)
        .collect()
}

/// The byte all-gather (never in the pool: always staged within a node,
/// MPI between nodes) and the agreements on it.
fn byte_checks(comm: &Comm, rep: &mut Report) {
    let (r, n) = (comm.rank(), comm.world_size());
    // Per-rank lengths: a zero, odd sizes, and more than one 4 MiB bounce
    // round (64M pool).
    for big in [false, true] {
        let counts: Vec<usize> = (0..n)
            .map(|p| match p % 3 {
                0 if big => (5 << 20) + 3,
                0 => 1001,
                1 => 0,
                _ => 7,
            })
            .collect();
        let want: Vec<u8> = (0..n).flat_map(|p| noise(p, counts[p])).collect();
        let got = comm
            .all_gather_bytes(noise(r, counts[r]), vec![0xa5; want.len()], &counts)
            .wait();
        rep.check(
            &format!("all_gather_bytes counts {counts:?}"),
            matches!(&got, Ok((s, o)) if *s == noise(r, counts[r]) && *o == want),
            || format!("{:?}", got.as_ref().map(|_| "other bytes")),
        );
        let parts = exchange_bytes(comm, &noise(r, counts[r]));
        let want: Vec<Vec<u8>> = (0..n).map(|p| noise(p, counts[p])).collect();
        rep.check(
            &format!("exchange_bytes lengths {counts:?}"),
            parts.as_ref().is_ok_and(|p| *p == want),
            || format!("{:?}", parts.as_ref().map(|_| "other bytes")),
        );
    }
    // Words whose bits a float transport could bend (NaNs of every width).
    let mine = |p: usize| {
        vec![
            0x7ff0_0000_0000_0001 ^ p as u64,
            0xfff8_dead_beef_0001,
            0x7fc1_ffff_7f81_0001,
            f64::NAN.to_bits(),
            (0.1f64 * (p + 1) as f64).to_bits(),
            u64::MAX - p as u64,
        ]
    };
    let words = exchange_u64(comm, &mine(r));
    let want: Vec<Vec<u64>> = (0..n).map(mine).collect();
    rep.check(
        "exchange_u64 keeps NaN-looking bit patterns",
        words.as_ref().is_ok_and(|w| *w == want),
        || format!("{words:x?}"),
    );
    let none = first_failure(comm, None::<&str>);
    rep.check(
        "first_failure: nobody failed",
        matches!(none, Ok(None)),
        || format!("{none:?}"),
    );
    let text = |p: usize| format!("rank {p}: ошибка ✗ {}", "y".repeat(p * 1000));
    let mine = (r + 1 >= n).then(|| text(r));
    let seen = first_failure(comm, mine.as_deref());
    rep.check(
        "first_failure: the lowest failing rank and its text",
        matches!(&seen, Ok(Some((p, t))) if *p == n - 1 && *t == text(n - 1)),
        || format!("{seen:?}"),
    );
}

/// A fresh communicator for one failure scenario (MPI is initialised only
/// once per process; the main communicator keeps it alive).
fn fresh(timeout: Duration) -> MpiComm {
    MpiComm::init(&CommOptions {
        timeout,
        validate: true,
    })
    .expect("another communicator")
}

fn zeros_heap(len: usize) -> HostBuffer<f32> {
    HostBuffer::zeros(len).unwrap()
}

fn failure_checks(main: &Comm, rep: &mut Report) {
    let (r, n) = (main.rank(), main.world_size());
    let resync = |rep: &mut Report, what: &str| {
        let b = main.barrier().wait();
        rep.check(
            &format!("main communicator still works after {what}"),
            b.is_ok(),
            || format!("{b:?}"),
        );
    };

    // Mismatch: rank 0 all-reduces, the others broadcast.
    {
        let c = fresh(Duration::from_secs(20));
        let t = Instant::now();
        let e = if r == 0 {
            c.all_reduce(zeros_heap(8), ReduceOp::Sum)
                .wait()
                .map(|_| ())
        } else {
            c.broadcast(zeros_heap(8), 0).wait().map(|_| ())
        };
        let msg = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        rep.check(
            "mismatch: every rank gets Mismatch saying what each called",
            matches!(e, Err(Error::Mismatch { seq: 1, .. }))
                && msg.contains("rank 0 called all_reduce(sum, f32, 8 elements)")
                && msg.contains(&format!(
                    "rank {} called broadcast(f32, 8 elements, root 0)",
                    n - 1
                ))
                && t.elapsed() < Duration::from_secs(5),
            || format!("{e:?} after {:?}", t.elapsed()),
        );
        let next = c.barrier().wait();
        rep.check(
            "mismatch: the communicator is poisoned",
            matches!(next, Err(Error::Poisoned { .. })),
            || format!("{next:?}"),
        );
    }
    resync(rep, "a mismatch");

    // Mismatch in the size only.
    {
        let c = fresh(Duration::from_secs(20));
        let e = c
            .all_reduce(zeros_heap(8 + r), ReduceOp::Max)
            .wait()
            .map(|_| ());
        let msg = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        rep.check(
            "mismatch: sizes differ",
            matches!(e, Err(Error::Mismatch { .. }))
                && msg.contains("9 elements")
                && msg.contains("8 elements"),
            || format!("{e:?}"),
        );
    }
    resync(rep, "a size mismatch");

    // Mismatch of a byte agreement: rank 0 exchanges one word more.
    {
        let c = fresh(Duration::from_secs(20));
        let e = exchange_u64(&c, &vec![3; 1 + usize::from(r == 0)]);
        let msg = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        rep.check(
            "mismatch: byte agreements of different sizes",
            matches!(e, Err(Error::Mismatch { seq: 1, .. }))
                && msg.contains(&format!("rank 0 called all_gather(u8, {} elements", 16 * n))
                && msg.contains(&format!(
                    "rank {} called all_gather(u8, {} elements",
                    n - 1,
                    8 * n
                )),
            || format!("{e:?}"),
        );
    }
    resync(rep, "a byte agreement mismatch");

    // Timeout: rank 1 arrives long after the others gave up.
    {
        let timeout = Duration::from_millis(600);
        let c = fresh(timeout);
        if r == 1 {
            std::thread::sleep(Duration::from_millis(2000));
        }
        let t = Instant::now();
        let e = c
            .all_reduce(zeros_heap(1024), ReduceOp::Sum)
            .wait()
            .map(|_| ());
        let took = t.elapsed();
        let msg = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        if r == 0 {
            let node = mpi(main).local_size();
            let arrived: Vec<usize> = (0..node).filter(|&p| p != 1).collect();
            rep.check(
                "timeout: rank 0 names the collective, #seq and the arrived ranks",
                matches!(e, Err(Error::Timeout { seq: 1, .. }))
                    && msg.contains("all_reduce #1 timed out")
                    && msg.contains(&format!("ranks that arrived: {arrived:?}"))
                    && took >= timeout
                    && took < timeout + Duration::from_millis(1500),
                || format!("{msg} after {took:?}"),
            );
        } else if r == 1 {
            rep.check(
                "timeout: the late rank fails at once",
                e.is_err() && took < Duration::from_millis(500),
                || format!("{e:?} after {took:?}"),
            );
        } else {
            rep.check(
                "timeout: every waiting rank fails in time",
                matches!(e, Err(Error::Timeout { .. } | Error::PeerFailed { .. }))
                    && took < timeout + Duration::from_millis(1500),
                || format!("{e:?} after {took:?}"),
            );
        }
    }
    resync(rep, "a timeout");

    // A peer that left: rank 1 drops its communicator.
    {
        let c = fresh(Duration::from_secs(30));
        if r == 1 {
            drop(c);
        } else {
            let t = Instant::now();
            let e = c
                .all_reduce(zeros_heap(64), ReduceOp::Sum)
                .wait()
                .map(|_| ());
            let took = t.elapsed();
            rep.check(
                "peer left: PeerFailed at once, not a timeout",
                matches!(e, Err(Error::PeerFailed { .. })) && took < Duration::from_secs(3),
                || format!("{e:?} after {took:?}"),
            );
        }
    }
    resync(rep, "a peer left");

    // A peer that failed: rank 1 makes an invalid call.
    {
        let c = fresh(Duration::from_secs(30));
        let t = Instant::now();
        if r == 1 {
            let bad = c
                .reduce_scatter(zeros_heap(5), zeros_heap(1), &[1, 2], ReduceOp::Sum)
                .wait()
                .map(|_| ());
            let next = c
                .all_reduce(zeros_heap(64), ReduceOp::Sum)
                .wait()
                .map(|_| ());
            rep.check(
                "peer failed: the failing rank sees its error, then Poisoned",
                matches!(bad, Err(Error::InvalidArgument { .. }))
                    && matches!(next, Err(Error::Poisoned { .. })),
                || format!("{bad:?} / {next:?}"),
            );
        } else {
            let e = c
                .all_reduce(zeros_heap(64), ReduceOp::Sum)
                .wait()
                .map(|_| ());
            let took = t.elapsed();
            rep.check(
                "peer failed: PeerFailed at once, not a timeout",
                matches!(e, Err(Error::PeerFailed { .. })) && took < Duration::from_secs(3),
                || format!("{e:?} after {took:?}"),
            );
        }
    }
    resync(rep, "a peer failed");
}

fn crash_phase(comm: &Comm, rep: &mut Report) {
    let r = comm.rank();
    let c = fresh(Duration::from_secs(30));
    let ok = c.barrier().wait();
    rep.check("crash: set-up", ok.is_ok(), || format!("{ok:?}"));
    if r == 1 {
        // Die without a word: no LEFT/FAILED state, no MPI_Finalize.
        // SAFETY: ends this process at once, on purpose.
        unsafe { libc::_exit(3) };
    }
    let t = Instant::now();
    let e = c
        .all_reduce(zeros_heap(1 << 16), ReduceOp::Sum)
        .wait()
        .map(|_| ());
    let took = t.elapsed();
    let msg = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    rep.check(
        "crash: a dead peer process gives PeerFailed quickly",
        matches!(e, Err(Error::PeerFailed { peer: 1, .. }))
            && msg.contains("died")
            && took < Duration::from_secs(5),
        || format!("{msg} after {took:?}"),
    );
    // Neither communicator may be dropped normally (a peer is gone); the
    // caller exits without finalising.
    std::mem::forget(c);
}
