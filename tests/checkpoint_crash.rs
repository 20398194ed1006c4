//! Crash safety of checkpoints: a process killed with SIGKILL at any instant
//! of `Engine::save_checkpoint` never leaves a torn checkpoint that loads.
//!
//! The test binary starts itself as a child (`crash_child`, an ignored test
//! that does nothing unless [`CHILD_ENV`] is set). The child trains a
//! 346k-parameter MLP (4.2 MB of fp32 master, m and v) on 2 thread ranks
//! and saves after each of [`STEPS`] steps into one root with `keep_last`
//! 2, printing `ckpt-crash: save-begin N` and `save-end N` around each
//! save. The parent kills it (SIGKILL) a random delay after the
//! `save-begin` of a random save, the delay spread over that save's
//! measured duration (half of the trials uniformly over 0–130 %, half over
//! 85–105 %, where the renames are), so kills land while rank files are
//! written, between the renames of the directory and of `latest`, while old
//! checkpoints are pruned, and after the save. Stage 2, stage 3, and stage 3
//! with nvme optimizer offload (tiles written out of order), and stage 3
//! with everything on nvme (ZeRO-Infinity: parameters and swapped
//! gradients too) take turns.
//!
//! After each kill the parent checks the root:
//!
//! - entries are `latest`, `latest.tmp`, `step{N:08}` directories and
//!   stray `.tmp-*` directories, which are ignored;
//! - if `latest` exists, loading the root succeeds and gives the state an
//!   uninterrupted run has after step N (every unit's parameters, master,
//!   m and v bit for bit), the step count and the client state, with the
//!   stray `.tmp-*` directories in place;
//! - every `step*` directory either loads and equals the reference at its
//!   step, or fails to load, and the latter only for a directory older than
//!   the one `latest` names (a checkpoint whose pruning was cut short): a
//!   torn checkpoint never loads, `latest` never names one;
//! - without `latest` (killed during the first save), there is no `step*`
//!   directory, or only a complete `step00000001` (killed between the
//!   rename of the directory and the first write of `latest`), which
//!   loading the root then finds.
//!
//! SIGKILL ends the process, not the machine: what was written but not
//! fsynced survives in the page cache, so this tests the ordering of the
//! renames, not the fsyncs.
//!
//! `ZERO_CKPT_CRASH_SEED` replays another sequence of kills;
//! `ZERO_CKPT_CRASH_TRIALS` sets their number (default [`TRIALS`]).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zero::comm::{Communicator, ThreadGroup};
use zero::core::bf16;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::optim::LrSchedule;
use zero::{Engine, UnitState};
use zero_testkit::mlp::{batch, Mlp};
use zero_testkit::runs::{assert_bits_eq, MB};
use zero_testkit::temp::TempDir;

/// Selects the child role: `<variant>:<root>:<swap dir>`.
const CHILD_ENV: &str = "ZERO_CKPT_CRASH_CHILD";
const SEED_ENV: &str = "ZERO_CKPT_CRASH_SEED";
const TRIALS_ENV: &str = "ZERO_CKPT_CRASH_TRIALS";
/// The name of the child's test function (run with `--exact --ignored`).
const CHILD_TEST: &str = "crash_child";
/// Prefix of the child's protocol lines on stdout.
const TAG: &str = "ckpt-crash:";

const WORLD: usize = 2;
/// 32·512+512 + 512·640+640 + 640+1 = 345,857 elements: 4.2 MB of master,
/// m and v, 2.1 MB per rank file.
const DIMS: &[usize] = &[32, 512, 640, 1];
/// Steps the child trains, saving after each.
const STEPS: usize = 4;
const KEEP_LAST: usize = 2;
const TRIALS: usize = 60;
const DEFAULT_SEED: u64 = 0x5eed_c4a5_4001;
/// A child that has not reached the save it should be killed in by then
/// is hung.
const CHILD_LIMIT: Duration = Duration::from_secs(30);

/// (name, stage, nvme optimizer offload, ZeRO-Infinity: parameters on
/// nvme too and the gradients swapped).
const VARIANTS: &[(&str, u8, bool, bool)] = &[
    ("stage 2", 2, false, false),
    ("stage 3", 3, false, false),
    ("stage 3 + nvme optimizer offload", 3, true, false),
    (
        "stage 3 + ZeRO-Infinity (everything on nvme)",
        3,
        true,
        true,
    ),
];

fn cfg(variant: usize, swap: &Path) -> ResolvedConfig {
    let (_, stage, nvme, infinity) = VARIANTS[variant];
    let mut c = ResolvedConfig::simple(stage, WORLD, MB);
    c.precision = Precision::Bf16;
    c.optimizer.lr = 1e-2;
    c.scheduler = LrSchedule::Constant { lr: 1e-2 };
    c.gradient_clipping = 1.0;
    c.zero.param_persistence_threshold = 0;
    if nvme {
        // Tiles of 32k elements: the rank file is written tile by tile,
        // master, m and v at three places (its CRCs read back at the end).
        c.zero.offload_optimizer.device = OffloadDevice::Nvme;
        c.zero.offload_optimizer.nvme_path = Some(swap.to_path_buf());
        c.zero.offload_optimizer.buffer_count = 3;
        c.zero.sub_group_size = 1 << 15;
    }
    if infinity {
        c.zero.offload_optimizer.swap_gradients = true;
        c.zero.offload_param.device = OffloadDevice::Nvme;
        c.zero.offload_param.nvme_path = Some(swap.to_path_buf());
        c.zero.offload_param.max_in_cpu = 0;
    }
    c
}

/// Trains step `s` (0-based) of the data stream on this rank.
fn train_step<C: Communicator>(model: &Mlp, e: &mut Engine<C>, s: usize) -> zero::Result<()> {
    let (world, rank) = (e.world_size(), e.rank());
    let first = ((s * world + rank) * MB) as u64;
    let (x, y) = batch(first, MB, DIMS[0]);
    model.train_micro_batch::<bf16, C, _>(e, &x, &y)?;
    e.step()?;
    Ok(())
}

fn states<C: Communicator>(e: &mut Engine<C>) -> zero::Result<Vec<UnitState>> {
    e.unit_ids().into_iter().map(|u| e.unit_state(u)).collect()
}

/// Every unit's state after each of steps 1..=STEPS of an uninterrupted
/// run (rank 0's view; index 0 is step 1).
fn reference(variant: usize, swap: &Path) -> Vec<Vec<UnitState>> {
    let c = cfg(variant, swap);
    let mut out = ThreadGroup::run(WORLD, |comm| -> zero::Result<Vec<Vec<UnitState>>> {
        let mut b = Engine::builder(c.clone(), comm).seed(5);
        let model = Mlp::register(&mut b, DIMS)?;
        let mut e = b.build()?;
        let mut all = Vec::new();
        for s in 0..STEPS {
            train_step(&model, &mut e, s)?;
            all.push(states(&mut e)?);
        }
        Ok(all)
    })
    .expect("ranks ran");
    out.swap_remove(0)
        .unwrap_or_else(|e| panic!("reference run: {e}"))
}

// ───────────────────────────── the child ─────────────────────────────

/// The saving process; does nothing unless started by the parent test.
#[test]
#[ignore = "the child process of `sigkill_during_save_never_leaves_a_torn_checkpoint`"]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, ':');
    let variant: usize = parts.next().and_then(|v| v.parse().ok()).expect("variant");
    let root = PathBuf::from(parts.next().expect("root"));
    let swap = PathBuf::from(parts.next().expect("swap dir"));
    let c = cfg(variant, &swap);
    let out = ThreadGroup::run(WORLD, |comm| -> zero::Result<()> {
        let rank = comm.rank();
        let mut b = Engine::builder(c.clone(), comm)
            .seed(5)
            .keep_last_checkpoints(KEEP_LAST);
        let model = Mlp::register(&mut b, DIMS)?;
        let mut e = b.build()?;
        for s in 0..STEPS {
            train_step(&model, &mut e, s)?;
            let n = s + 1;
            if rank == 0 {
                println!("{TAG} save-begin {n}");
            }
            let t = Instant::now();
            e.save_checkpoint(&root, json!({ "step": n }))?;
            if rank == 0 {
                println!("{TAG} save-end {n} {}", t.elapsed().as_micros());
            }
        }
        Ok(())
    })
    .expect("ranks ran");
    for r in out {
        r.unwrap_or_else(|e| panic!("child: {e}"));
    }
}

// ───────────────────────────── the parent ─────────────────────────────

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A running child and its protocol lines, timestamped as they arrive.
struct Running {
    child: Child,
    lines: mpsc::Receiver<(String, Instant)>,
    stderr: std::thread::JoinHandle<String>,
}

fn spawn_child(variant: usize, root: &Path, swap: &Path) -> Running {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = Command::new(exe)
        .args([CHILD_TEST, "--exact", "--ignored", "--nocapture"])
        .env(
            CHILD_ENV,
            format!("{variant}:{}:{}", root.display(), swap.display()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the child");
    let out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            if let Some(rest) = line.strip_prefix(TAG) {
                let _ = tx.send((rest.trim().to_string(), Instant::now()));
            }
        }
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    Running {
        child,
        lines: rx,
        stderr,
    }
}

/// What the child said: the saves begun and ended (with their durations).
#[derive(Default)]
struct Said {
    begun: Vec<usize>,
    ended: Vec<(usize, Duration)>,
}

impl Said {
    fn take(&mut self, line: &str) {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w[..] {
            ["save-begin", n] => self.begun.push(n.parse().expect("step")),
            ["save-end", n, us] => self.ended.push((
                n.parse().expect("step"),
                Duration::from_micros(us.parse().expect("micros")),
            )),
            _ => panic!("unexpected line from the child: {line}"),
        }
    }

    /// The save in progress when the child died, if any.
    fn in_save(&self) -> Option<usize> {
        let last = *self.begun.last()?;
        (!self.ended.iter().any(|&(n, _)| n == last)).then_some(last)
    }
}

/// Runs a child to the end; its save durations.
fn run_uninterrupted(variant: usize, root: &Path, swap: &Path) -> Vec<Duration> {
    let mut r = spawn_child(variant, root, swap);
    let status = r.child.wait().expect("wait");
    let stderr = r.stderr.join().unwrap_or_default();
    assert!(status.success(), "the child failed: {status}\n{stderr}");
    let mut said = Said::default();
    for (l, _) in r.lines.try_iter() {
        said.take(&l);
    }
    assert_eq!(said.ended.len(), STEPS, "{stderr}");
    said.ended.iter().map(|&(_, d)| d).collect()
}

/// Loads `path` on [`WORLD`] thread ranks with `variant`'s configuration:
/// rank 0's states, step count and client state.
fn load(variant: usize, path: &Path, swap: &Path) -> zero::Result<(Vec<UnitState>, u64, Value)> {
    let c = cfg(variant, swap);
    let mut out = ThreadGroup::run(WORLD, |comm| {
        let mut b = Engine::builder(c.clone(), comm).seed(5);
        Mlp::register(&mut b, DIMS)?;
        let (mut e, client) = Engine::load_checkpoint(b, path)?;
        Ok((states(&mut e)?, e.steps(), client))
    })
    .expect("ranks ran");
    let first = out.remove(0);
    // Every rank agrees: all loaded or all failed.
    for r in &out {
        assert_eq!(r.is_ok(), first.is_ok(), "ranks disagree on loading");
    }
    first
}

fn step_of(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("step")?;
    (digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// What a root looked like after a kill.
#[derive(Debug, Default)]
struct Found {
    /// The step `latest` names.
    latest: Option<usize>,
    /// `step*` directories that load and verify.
    complete: Vec<usize>,
    /// `step*` directories that do not load (old ones, partly pruned).
    torn: Vec<usize>,
    /// Stray `.tmp-*` directories.
    stray: usize,
}

/// Checks the invariants of the module docs on `root`.
fn verify(
    variant: usize,
    root: &Path,
    swap: &Path,
    refs: &[Vec<UnitState>],
) -> Result<Found, String> {
    let mut found = Found::default();
    let mut steps = Vec::new();
    let mut has_latest = false;
    if !root.exists() {
        // Killed before rank 0 created it.
        return Ok(found);
    }
    for e in std::fs::read_dir(root).map_err(|e| format!("read_dir: {e}"))? {
        let e = e.map_err(|e| format!("read_dir: {e}"))?;
        let name = e.file_name().into_string().map_err(|n| format!("{n:?}"))?;
        if name == "latest" {
            has_latest = true;
        } else if name == "latest.tmp" {
        } else if name.starts_with(".tmp-") {
            found.stray += 1;
        } else if let Some(n) = step_of(&name) {
            steps.push(n);
        } else {
            return Err(format!("unexpected entry `{name}` in the root"));
        }
    }
    steps.sort_unstable();
    if has_latest {
        let text = std::fs::read_to_string(root.join("latest"))
            .map_err(|e| format!("reading latest: {e}"))?;
        let n = step_of(text.trim())
            .ok_or_else(|| format!("`latest` names `{text}`, not a step directory"))?;
        if !steps.contains(&n) {
            return Err(format!("`latest` names step {n}, which does not exist"));
        }
        found.latest = Some(n);
        // The root loads, stray `.tmp-*` directories and all.
        let (st, count, client) =
            load(variant, root, swap).map_err(|e| format!("loading the root (latest {n}): {e}"))?;
        let what = format!("the root (latest = step {n})");
        same_state(&refs[n - 1], &st, &what)?;
        if count != n as u64 || client != json!({ "step": n }) {
            return Err(format!(
                "{what}: {count} steps, client state {client}, expected {n}"
            ));
        }
    }
    for &n in &steps {
        let dir = root.join(format!("step{n:08}"));
        match load(variant, &dir, swap) {
            Ok((st, count, client)) => {
                let what = format!("step{n:08}");
                same_state(&refs[n - 1], &st, &what)?;
                if count != n as u64 || client != json!({ "step": n }) {
                    return Err(format!(
                        "{what}: {count} steps, client state {client}, expected {n}"
                    ));
                }
                found.complete.push(n);
            }
            Err(e) => match found.latest {
                Some(l) if n < l => found.torn.push(n),
                _ => {
                    return Err(format!(
                        "step{n:08} does not load, and it is not an old checkpoint being pruned \
                         (latest: {:?}): {e}",
                        found.latest
                    ))
                }
            },
        }
    }
    if found.latest.is_none() && !(found.complete.is_empty() || found.complete == [1]) {
        return Err(format!(
            "no `latest`, but complete checkpoints {:?} (only a first one just renamed into \
             place may lack it)",
            found.complete
        ));
    }
    if found.latest.is_none() && found.complete == [1] {
        // The root still loads: without `latest`, the newest step directory.
        let (st, count, client) =
            load(variant, root, swap).map_err(|e| format!("loading the root (no latest): {e}"))?;
        same_state(&refs[0], &st, "the root (no latest yet)")?;
        if count != 1 || client != json!({ "step": 1 }) {
            return Err(format!(
                "the root (no latest yet): {count} steps, client state {client}, expected 1"
            ));
        }
    }
    Ok(found)
}

fn same_state(want: &[UnitState], got: &[UnitState], what: &str) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        assert_bits_eq(want, got, what)
    }))
    .map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .unwrap_or_else(|| format!("{what}: state differs from the reference"))
    })
}

/// Where a kill landed, from what the child said and what the root holds.
fn phase(said: &Said, killed: bool, found: &Found) -> &'static str {
    if !killed {
        return "after the last save (the child had finished)";
    }
    let Some(n) = said.in_save() else {
        return "between saves (training)";
    };
    if !found.complete.contains(&n) {
        "in save: before the rename of the directory"
    } else if found.latest != Some(n) {
        "in save: directory renamed, `latest` not yet"
    } else if !found.torn.is_empty() || found.complete.len() > KEEP_LAST {
        "in save: `latest` written, pruning"
    } else {
        "in save: published, before returning"
    }
}

#[test]
fn sigkill_during_save_never_leaves_a_torn_checkpoint() {
    let started = Instant::now();
    let base = TempDir::new("ckpt-crash");
    let swap = base.join("swap");
    let load_swap = base.join("load-swap");
    let seed = std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    let trials = std::env::var(TRIALS_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(TRIALS);

    // References, and each variant's save time from an uninterrupted run
    // (whose root must verify too).
    let mut refs = Vec::new();
    // Per variant, the duration of each save of the uninterrupted run.
    let mut save_time: Vec<Vec<Duration>> = Vec::new();
    for v in 0..VARIANTS.len() {
        refs.push(reference(v, &load_swap));
        let root = base.join(format!("calibrate{v}"));
        let d = run_uninterrupted(v, &root, &swap);
        println!("{}: saves of {d:?}", VARIANTS[v].0);
        save_time.push(d);
        let found = verify(v, &root, &load_swap, &refs[v])
            .unwrap_or_else(|e| panic!("{} uninterrupted: {e}", VARIANTS[v].0));
        assert_eq!(found.latest, Some(STEPS), "{found:?}");
        assert_eq!(found.complete, [STEPS - 1, STEPS], "{found:?}");
        // The verification has teeth: a torn file in the checkpoint that
        // `latest` names fails it.
        let newest = root.join(format!("step{STEPS:08}")).join("rank00001.bin");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&newest)
            .expect("open a rank file");
        let len = f.metadata().expect("stat").len();
        f.set_len(len / 2).expect("truncate");
        drop(f);
        match verify(v, &root, &load_swap, &refs[v]) {
            Err(e) => assert!(e.contains("loading the root"), "{e}"),
            Ok(found) => panic!("a torn newest checkpoint passed: {found:?}"),
        }
        let _ = std::fs::remove_dir_all(&root);
    }

    let mut rng = Rng(seed);
    let mut phases: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut in_save, mut with_stray, mut with_torn) = (0, 0, 0);
    let (mut first_unnamed, mut failures) = (0, Vec::new());
    for t in 0..trials {
        let v = t % VARIANTS.len();
        let target = 1 + (rng.next() % STEPS as u64) as usize;
        let frac = if rng.next().is_multiple_of(2) {
            rng.uniform(0.0, 1.3)
        } else {
            rng.uniform(0.85, 1.05)
        };
        let window = save_time[v][target - 1];
        let delay = window.mul_f64(frac);
        let root = base.join(format!("trial{t}"));
        let mut r = spawn_child(v, &root, &swap);
        let mut said = Said::default();
        // Wait for `save-begin target`, then for the delay.
        let deadline = Instant::now() + CHILD_LIMIT;
        let mut kill_at = None;
        while kill_at.is_none() {
            match r
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok((l, at)) => {
                    said.take(&l);
                    if said.begun.last() == Some(&target) && said.ended.len() < target {
                        kill_at = Some(at + delay);
                    }
                }
                // The child ended before that save (it does, for kills
                // after the last one).
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                    panic!(
                        "trial {t} ({}): the child did not reach save {target} within \
                         {CHILD_LIMIT:?}",
                        VARIANTS[v].0
                    );
                }
            }
        }
        if let Some(at) = kill_at {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
        }
        // SIGKILL (a no-op on a child that has exited but is not reaped).
        let _ = r.child.kill();
        let status = r.child.wait().expect("wait");
        let stderr = r.stderr.join().unwrap_or_default();
        for (l, _) in r.lines.try_iter() {
            said.take(&l);
        }
        let killed = status.signal() == Some(libc::SIGKILL);
        if !killed && !status.success() {
            panic!(
                "trial {t} ({}): the child failed ({status}):\n{stderr}",
                VARIANTS[v].0
            );
        }
        match verify(v, &root, &load_swap, &refs[v]) {
            Ok(found) => {
                let p = phase(&said, killed, &found);
                in_save += usize::from(p.starts_with("in save"));
                with_stray += usize::from(found.stray > 0);
                with_torn += usize::from(!found.torn.is_empty());
                first_unnamed += usize::from(found.latest.is_none() && !found.complete.is_empty());
                *phases.entry(p).or_default() += 1;
            }
            Err(e) => failures.push(format!(
                "trial {t} ({}, save {target}, {:.0}% of {window:?}): {e}",
                VARIANTS[v].0,
                frac * 100.0,
            )),
        }
        let _ = std::fs::remove_dir_all(&root);
        // A killed child leaves its swap files behind.
        let _ = std::fs::remove_dir_all(&swap);
    }

    println!(
        "{trials} trials (seed {seed:#x}), {in_save} kills inside a save, in {:.1?}:",
        started.elapsed()
    );
    for (p, n) in &phases {
        println!("  {n:3}  {p}");
    }
    println!(
        "  roots with stray .tmp-* directories: {with_stray}; with partly pruned checkpoints: \
         {with_torn}; with a complete step00000001 but no `latest` yet: {first_unnamed}"
    );
    assert!(
        failures.is_empty(),
        "{} of {trials} trials failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The delays are sized from the measured save time: most kills land in
    // a save. Far fewer means the timing went wrong, not the checkpoint.
    assert!(
        in_save * 4 >= trials,
        "only {in_save} of {trials} kills landed inside a save"
    );
}
