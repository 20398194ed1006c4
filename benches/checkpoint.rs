//! Sharded checkpoint throughput and host memory, against raw sequential
//! I/O of the same bytes in the same directory, measured in the same run.
//!
//! The model: `--params N` parameters (default 200M) in 20 units of equal
//! size, bf16, stage `--stage S` (default 3), 2 ranks on the threads
//! backend, optimizer state in memory (no offload), after one optimizer
//! step of a no-compute trainer (gradients filled with a fixed pattern), so
//! master, m and v are all non-zero and varied (weights drawn from
//! `Init::normal`: no zero pages, nothing a file system could compress).
//!
//! The config is what a ds_config with `"auto"` sizes gets for the hidden
//! size h = 1024 (the row length) by the HF integration's rule:
//! `reduce_bucket_size` h² (the engine raises it to the largest unit,
//! 10M elements at 200M), `stage3_prefetch_bucket_size` 0.9·h²,
//! `stage3_param_persistence_threshold` 10·h. With the library default
//! `reduce_bucket_size` 5e8, a model under 500M parameters gets bucket
//! buffers of the whole model: at 200M each rank built two fp32 buffers
//! of 800 MB (overlap_comm), half of the engine's memory, which no user
//! of a 200M model configures and which only made the load's engine
//! build (part of the load time) slower.
//!
//! Per repetition (`--reps R`, default 3), in this order, so that the
//! checkpoint and its baseline are measured next to each other:
//!
//! - **raw write**: each rank's thread writes its own file of the size of
//!   its rank file, sequentially through a 4 MiB buffer (the checkpoint's
//!   write buffer), then fsyncs it; twice: plain, and with write-behind
//!   (each write's writeback started at once with `sync_file_range`, the
//!   range 8 MiB behind waited for and dropped with `posix_fadvise
//!   (DONTNEED)`); then **raw read** of those files, each by its thread in
//!   4 MiB reads, after `posix_fadvise(DONTNEED)` evicted them from the
//!   page cache: plain, and with drop-behind (each range dropped once
//!   read). The baseline is the faster of the two. Why two: on a VM whose
//!   balloon reports free pages to the host (the development machines),
//!   a page the page cache takes from memory freed a while ago costs a
//!   host fault, and a plain stream of new pages ran at 0.23 GB/s (write)
//!   and 0.34–0.46 (read) while the same stream reusing its own pages
//!   (write-/drop-behind) ran at 1.2–1.5: a plain baseline measured that
//!   VM effect, not the disk (and a plain read right after an eviction
//!   reuses the pages just freed, so it was fast or slow depending on
//!   what ran before). The checkpoint streams the same way (see
//!   `src/format/checkpoint/mod.rs`, "Page cache");
//!   A diagnostic, not part of the baseline: the drop-behind read once
//!   more, into fresh memory (a buffer of the file's size no page of which
//!   was touched), which is what a load into a new engine pays at least
//!   (on the development VM the first touch of a page costs a host fault:
//!   1.2–2.6 GB/s for one thread);
//! - **save**: `Engine::save_checkpoint` (rank files, fsyncs, manifest,
//!   rename, `latest`); GB/s = the bytes of the rank files / time;
//! - **load**: the engine is dropped, the checkpoint's files are evicted
//!   from the page cache (`posix_fadvise(DONTNEED)` after fsync, checked
//!   with `mincore`), and `Engine::load_checkpoint` builds a new engine and
//!   reads the state back (each rank its own file; CRC of every block).
//!   Its time includes building the engine (allocation and initialisation
//!   of its buffers): that part, the shortest `checkpoint build` span of
//!   the ranks in the engine's tracer, is shown next to it, and the ratio
//!   also without it. The loaded state is compared with the saved one
//!   (the first and last units' parameters, master, m and v).
//!
//! At the end, a diagnostic: one more load of the last checkpoint with its
//! files in the page cache (what a load costs without the disk).
//!
//! Ratios: checkpoint GB/s ÷ the faster raw GB/s of the same repetition
//! (target ≥ 70%); min and median over the repetitions.
//!
//! Host memory: before each save and load, `5` is written to
//! `/proc/self/clear_refs`, which resets `VmHWM` to the current RSS; the
//! phase's figure is `VmHWM` after it − `VmRSS` before it. The ranks are
//! threads of this process, so the figure is for both; per rank is that ÷ 2.
//! The load builds a new engine whose state is not checkpoint overhead: its
//! extra is `VmHWM − VmRSS before − S`, with `S` the bytes the new engine
//! allocated (parameters, master, m, v, gradient shards, buckets: every
//! rank's memory tracker). Target: ≤ 2 × the 4 MiB write buffer per rank. glibc's mmap
//! threshold is fixed at 256 KiB for the run, so that large buffers are
//! mapped and unmapped when freed: with its default, dynamic threshold the
//! arenas keep freed blocks (e.g. the engine build's per-unit scratch) and
//! `VmHWM` mixes them into the figure.
//!
//! `cargo bench --bench checkpoint [-- --params N --dir DIR --stage S
//! --reps R]`; `--dir` defaults to the temporary directory; the files go to
//! a fresh subdirectory of it, removed at the end.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::json;
use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::bf16;
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::memory::Tier;
use zero::core::partition::{TensorSpec, UnitSpec};
use zero::{Engine, EngineBuilder, Init, Tracer, UnitId};

const RANKS: usize = 2;
const UNITS: usize = 20;
const COLS: usize = 1024;
/// The checkpoint's write buffer (`WRITE_BUF` in `src/format/checkpoint/writer.rs`).
const BUF: usize = 4 << 20;
/// The checkpoint's write-behind distance (`WRITE_BEHIND` there).
const WRITE_BEHIND: u64 = 2 * BUF as u64;
const MIB: f64 = (1 << 20) as f64;

struct Args {
    params: usize,
    dir: PathBuf,
    stage: u8,
    reps: usize,
}

fn fail(msg: &str) -> ! {
    eprintln!("checkpoint bench: {msg}");
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        params: 200_000_000,
        dir: std::env::temp_dir(),
        stage: 3,
        reps: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| fail(&format!("{flag} needs a value")))
        };
        let mut num = |name: &str| -> usize {
            value()
                .replace('_', "")
                .parse()
                .unwrap_or_else(|e| fail(&format!("{name}: {e}")))
        };
        match flag.as_str() {
            "--params" => a.params = num("--params"),
            "--dir" => a.dir = PathBuf::from(value()),
            "--stage" => a.stage = num("--stage").min(3) as u8,
            "--reps" => a.reps = num("--reps"),
            "--bench" => {}
            other => fail(&format!(
                "unknown option {other}; options: --params N --dir DIR --stage S --reps R"
            )),
        }
    }
    if a.params < UNITS * COLS || a.reps == 0 {
        fail(&format!(
            "--params must be at least {} and --reps positive",
            UNITS * COLS
        ));
    }
    a
}

// ----------------------------------------------------------------------
// The engine

/// Rows of each unit's single `[rows, COLS]` weight.
fn rows(a: &Args) -> usize {
    (a.params / UNITS).div_ceil(COLS)
}

fn config(a: &Args) -> ResolvedConfig {
    let mut cfg = ResolvedConfig::simple(a.stage, RANKS, 1);
    cfg.precision = Precision::Bf16;
    // The sizes a ds_config with "auto" gets for hidden size h = COLS (the
    // HF integration's rule, `AutoValues::hidden_size`): see the header.
    let h = COLS;
    cfg.zero.reduce_bucket_size = h * h;
    cfg.zero.prefetch_bucket_size = h * h * 9 / 10;
    cfg.zero.param_persistence_threshold = 10 * h;
    cfg
}

fn builder(a: &Args, comm: ThreadComm, init: &Init) -> (EngineBuilder<ThreadComm>, Vec<UnitId>) {
    let mut b = Engine::builder(config(a), comm).seed(7);
    let units = (0..UNITS)
        .map(|u| {
            let spec = UnitSpec::new(
                format!("unit{u:02}"),
                vec![TensorSpec::new("weight", &[rows(a), COLS])],
            );
            b.register(spec, vec![init.clone()])
                .unwrap_or_else(|e| panic!("register: {e}"))
        })
        .collect();
    (b, units)
}

/// One optimizer step of a trainer that computes nothing: every gradient
/// is a fixed, varied pattern.
fn train_step(e: &mut Engine<ThreadComm>, units: &[UnitId]) {
    for (k, &u) in units.iter().enumerate().rev() {
        let numel = e.layout(u).expect("layout").numel;
        let p = e.gather(u).expect("gather");
        let mut g = e.grad_buffer::<bf16>(u).expect("grad buffer");
        for (i, x) in g[..numel].iter_mut().enumerate() {
            let t = ((i + 31 * k) % 997) as f32 / 498.0 - 1.0;
            *x = bf16::from_f32(1e-3 * t);
        }
        drop(p);
        e.grad_ready(u, g).expect("grad_ready");
    }
    e.step().expect("step");
}

/// The size of this rank's checkpoint file: a 16-byte header, then master,
/// m and v (f32) of the real elements of its shard of every unit.
fn rank_file_bytes(e: &Engine<ThreadComm>, units: &[UnitId]) -> u64 {
    let rank = e.rank();
    16 + units
        .iter()
        .map(|&u| 12 * e.layout(u).expect("layout").real_range(rank).len() as u64)
        .sum::<u64>()
}

/// CRC32 of the first and last units' parameters, master, m and v: a
/// collective.
fn digest(e: &mut Engine<ThreadComm>, units: &[UnitId]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for &u in [units[0], units[units.len() - 1]].iter() {
        let s = e.unit_state(u).expect("unit_state");
        for x in [&s.params, &s.master, &s.m, &s.v] {
            h.update(bytemuck::cast_slice(x));
        }
    }
    h.finalize()
}

/// Bytes this rank's engine allocated (its memory tracker, both tiers:
/// all host memory here): parameters, master, m, v, gradient shards and
/// buckets. The load builds and fills them; they are not checkpoint
/// overhead.
fn engine_bytes(e: &Engine<ThreadComm>) -> u64 {
    let t = e.tracker();
    t.tier_current(Tier::Host) + t.tier_current(Tier::Device)
}

fn barrier(c: &impl Communicator) {
    c.barrier().wait().expect("barrier");
}

// ----------------------------------------------------------------------
// Files, page cache, memory

/// Evicts `path` from the page cache: fsync (so every page is clean), then
/// `posix_fadvise(DONTNEED)`.
fn evict(path: &Path) {
    let f = File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.sync_all()
        .unwrap_or_else(|e| panic!("{}: fsync: {e}", path.display()));
    // SAFETY: `f` owns an open descriptor for the duration of the call;
    // fadvise only reads its arguments.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "{}: posix_fadvise(DONTNEED) failed", path.display());
}

/// Fraction of `path`'s pages in the page cache (`mincore`); NaN if the
/// file cannot be mapped.
fn resident(path: &Path) -> f64 {
    let Ok(f) = File::open(path) else {
        return f64::NAN;
    };
    let len = f.metadata().map_or(0, |m| m.len()) as usize;
    if len == 0 {
        return 0.0;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: a fresh read-only shared mapping of `len` bytes of a file
    // open for reading; nothing reads through it (mincore does not fault
    // pages in) and it is unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return f64::NAN;
    }
    // SAFETY: `p` is a page-aligned mapping of `len` bytes and `vec` has
    // one byte per page of it.
    let rc = unsafe { libc::mincore(p, len, vec.as_mut_ptr()) };
    // SAFETY: `p`/`len` is the mapping made above, unmapped once.
    unsafe { libc::munmap(p, len) };
    if rc != 0 {
        return f64::NAN;
    }
    vec.iter().filter(|&&b| b & 1 != 0).count() as f64 / vec.len() as f64
}

/// The regular files directly under `dir`.
fn files_in(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect()
}

/// `(VmRSS, VmHWM)` of this process, in bytes.
fn vm() -> (u64, u64) {
    let s = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib << 10)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets `VmHWM` to the current RSS; false if not permitted.
fn reset_peak() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Free bytes of the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let c = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain data; all-zero is a valid value.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a valid out-pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    (rc == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
}

/// Fixes glibc's mmap threshold (and so turns off its dynamic raise) so
/// that freed large buffers leave the RSS at once.
fn fix_mmap_threshold() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets an allocator parameter; it is called
        // before any other thread exists.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// A pattern that no file system compresses or skips.
fn pattern() -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..BUF)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `posix_fadvise(DONTNEED)` over `off..off + len` (a hint).
fn drop_range(f: &File, off: u64, len: u64) {
    // SAFETY: `f` owns an open descriptor for the duration of the call;
    // fadvise only reads its arguments.
    unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            off as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
}

/// `sync_file_range` over `off..off + len` (a hint; fsync follows).
fn sync_range(f: &File, off: u64, len: u64, flags: libc::c_uint) {
    // SAFETY: as in `drop_range`: an open descriptor and integers.
    unsafe { libc::sync_file_range(f.as_raw_fd(), off as i64, len as i64, flags) };
}

/// Writes `bytes` bytes sequentially in `BUF` writes, then fsyncs. With
/// `behind` (write-behind), each write's writeback starts at once and a
/// range `WRITE_BEHIND` bytes behind the newest write is waited for and
/// dropped from the page cache.
fn raw_write(path: &Path, bytes: u64, buf: &[u8], behind: bool) {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut at = 0u64;
    let mut dropped = 0u64;
    while at < bytes {
        let n = (bytes - at).min(BUF as u64) as usize;
        f.write_all_at(&buf[..n], at)
            .unwrap_or_else(|e| panic!("raw write: {e}"));
        if behind {
            sync_range(&f, at, n as u64, libc::SYNC_FILE_RANGE_WRITE);
            let upto = (at + n as u64).saturating_sub(WRITE_BEHIND);
            if upto > dropped {
                sync_range(
                    &f,
                    dropped,
                    upto - dropped,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                );
                drop_range(&f, dropped, upto - dropped);
                dropped = upto;
            }
        }
        at += n as u64;
    }
    f.sync_all().unwrap_or_else(|e| panic!("raw fsync: {e}"));
}

/// Reads `bytes` bytes sequentially in `BUF` reads; with `behind`
/// (drop-behind), each range leaves the page cache once read.
fn raw_read(path: &Path, bytes: u64, buf: &mut [u8], behind: bool) {
    let f = File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(BUF as u64) as usize;
        f.read_exact_at(&mut buf[..n], at)
            .unwrap_or_else(|e| panic!("raw read: {e}"));
        if behind {
            drop_range(&f, at, n as u64);
        }
        at += n as u64;
    }
    std::hint::black_box(&buf[..]);
}

/// Reads the file into `dst` (`bytes` long, fresh memory: no page of it
/// touched yet), 4 MiB at a time, each range dropped from the page cache
/// once read: what any load into new memory costs at least.
fn raw_read_fresh(path: &Path, dst: &mut [u8]) {
    let f = File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for (k, chunk) in dst.chunks_mut(BUF).enumerate() {
        let at = (k * BUF) as u64;
        f.read_exact_at(chunk, at)
            .unwrap_or_else(|e| panic!("raw read: {e}"));
        drop_range(&f, at, chunk.len() as u64);
    }
    std::hint::black_box(&dst[..]);
}

// ----------------------------------------------------------------------
// One run: load the previous checkpoint (or build and step), raw I/O,
// save

/// Memory of one phase, for both ranks together.
#[derive(Clone, Copy, Default)]
struct Mem {
    before: u64,
    hwm: u64,
    after: u64,
    /// Model-state bytes the phase wrote into a new engine (load only).
    state: u64,
}

impl Mem {
    fn extra(&self) -> i64 {
        self.hwm as i64 - self.before as i64 - self.state as i64
    }
}

/// The raw baseline of one repetition: write and read times, plain and
/// with drop-behind, and the largest cached fraction before the reads.
#[derive(Clone, Copy)]
struct Raw {
    write: Duration,
    write_behind: Duration,
    read: Duration,
    read_behind: Duration,
    /// Drop-behind into fresh memory (a diagnostic, not the baseline).
    read_fresh: Duration,
    cached: f64,
}

impl Raw {
    /// The faster write: the baseline.
    fn best_write(&self) -> Duration {
        self.write.min(self.write_behind)
    }

    /// The faster read: the baseline.
    fn best_read(&self) -> Duration {
        self.read.min(self.read_behind)
    }
}

/// One load: its time, memory, cached fraction, and the building of its
/// engine (the shortest "checkpoint build" span of the ranks, from the
/// engine's tracer).
#[derive(Clone, Copy)]
struct Load {
    time: Duration,
    mem: Mem,
    cached: f64,
    build: Duration,
}

#[derive(Clone, Default)]
struct RunOut {
    load: Option<Load>,
    raw: Option<Raw>,
    save: Option<(Duration, Mem)>,
    saved: Option<PathBuf>,
    file_bytes: u64,
}

/// What every run shares.
struct Ctx<'a> {
    a: &'a Args,
    base: PathBuf,
    digest: Mutex<Option<u32>>,
    /// The loaded engines' bytes, summed over the ranks of one run.
    state: AtomicU64,
    /// The loads' tracer (their `checkpoint build` spans).
    tracer: Tracer,
}

/// Rank `comm.rank()` of run `k`: load the checkpoint `prev` (run 0:
/// build and step), then, unless this is the last run, raw I/O and a save
/// to `base/ckpt{k}`.
fn rank_run(comm: ThreadComm, ctx: &Ctx<'_>, k: usize, prev: Option<&Path>) -> RunOut {
    let a = ctx.a;
    let rank = comm.rank();
    let mut out = RunOut::default();
    let state = &ctx.state;
    let (mut e, units) = match prev {
        None => {
            let (b, units) = builder(a, comm, &Init::normal(0.02));
            let mut e = b.build().unwrap_or_else(|err| panic!("build: {err}"));
            train_step(&mut e, &units);
            let d = digest(&mut e, &units);
            if rank == 0 {
                *ctx.digest.lock().expect("lock") = Some(d);
            }
            (e, units)
        }
        Some(dir) => {
            let mut cached = 0.0f64;
            let mut before = 0;
            if rank == 0 {
                cached = files_in(dir)
                    .iter()
                    .map(|p| resident(p))
                    .fold(0.0, f64::max);
                before = vm().0;
                reset_peak();
            }
            barrier(&comm);
            let t0 = Instant::now();
            let (b, units) = builder(a, comm, &Init::Zeros);
            let (mut e, _client) = Engine::load_checkpoint(b.tracer(ctx.tracer.clone()), dir)
                .unwrap_or_else(|err| panic!("load_checkpoint: {err}"));
            barrier(e.comm());
            let t = t0.elapsed();
            state.fetch_add(engine_bytes(&e), Ordering::SeqCst);
            barrier(e.comm());
            if rank == 0 {
                let (after, hwm) = vm();
                let state = state.load(Ordering::SeqCst);
                let build = ctx
                    .tracer
                    .events()
                    .iter()
                    .filter(|ev| ev.name == "checkpoint build")
                    .map(|ev| Duration::from_secs_f64(ev.dur_us / 1e6))
                    .min()
                    .expect("load_checkpoint records a `checkpoint build` span per rank");
                ctx.tracer.clear();
                out.load = Some(Load {
                    time: t,
                    mem: Mem {
                        before,
                        hwm,
                        after,
                        state,
                    },
                    cached,
                    build,
                });
            }
            barrier(e.comm());
            let d = digest(&mut e, &units);
            if rank == 0 {
                let want = *ctx.digest.lock().expect("lock");
                assert_eq!(
                    Some(d),
                    want,
                    "the loaded state differs from the saved state (first and last units)"
                );
                // The last checkpoint stays for the warm load.
                if k < a.reps {
                    fs::remove_dir_all(dir.parent().expect("root"))
                        .unwrap_or_else(|err| panic!("remove {}: {err}", dir.display()));
                }
            }
            (e, units)
        }
    };
    if k == a.reps {
        return out;
    }

    // Raw baseline: each rank its own files of its rank file's size,
    // written and read plain and with drop-behind.
    let bytes = rank_file_bytes(&e, &units);
    let raw_dir = ctx.base.join(format!("raw{k}"));
    if rank == 0 {
        fs::create_dir_all(&raw_dir).expect("raw dir");
    }
    let tags = ["raw-plain", "raw-behind"];
    let paths = tags.map(|tag| raw_dir.join(format!("{tag}{rank}.bin")));
    let mut buf = pattern();
    let mut tw = [Duration::ZERO; 2];
    for (i, path) in paths.iter().enumerate() {
        barrier(e.comm());
        let t0 = Instant::now();
        raw_write(path, bytes, &buf, i == 1);
        barrier(e.comm());
        tw[i] = t0.elapsed();
    }
    let mut tr = [Duration::ZERO; 2];
    let mut cached = 0.0f64;
    for (i, path) in paths.iter().enumerate() {
        evict(path);
        barrier(e.comm());
        if rank == 0 {
            cached = files_in(&raw_dir)
                .iter()
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(tags[i]))
                })
                .map(|p| resident(p))
                .fold(cached, f64::max);
        }
        barrier(e.comm());
        let t0 = Instant::now();
        raw_read(path, bytes, &mut buf, i == 1);
        barrier(e.comm());
        tr[i] = t0.elapsed();
    }
    drop(buf);
    // Diagnostic: the drop-behind read again, into fresh memory.
    evict(&paths[1]);
    let mut fresh = vec![0u8; bytes as usize];
    barrier(e.comm());
    let t0 = Instant::now();
    raw_read_fresh(&paths[1], &mut fresh);
    barrier(e.comm());
    let read_fresh = t0.elapsed();
    drop(fresh);
    if rank == 0 {
        fs::remove_dir_all(&raw_dir).expect("remove raw files");
        out.raw = Some(Raw {
            write: tw[0],
            write_behind: tw[1],
            read: tr[0],
            read_behind: tr[1],
            read_fresh,
            cached,
        });
    }

    // Save.
    let root = ctx.base.join(format!("ckpt{k}"));
    let mut before = 0;
    if rank == 0 {
        before = vm().0;
        reset_peak();
    }
    barrier(e.comm());
    let t0 = Instant::now();
    let dest = e
        .save_checkpoint(&root, json!({ "rep": k }))
        .unwrap_or_else(|err| panic!("save_checkpoint: {err}"));
    barrier(e.comm());
    let t = t0.elapsed();
    if rank == 0 {
        let (after, hwm) = vm();
        out.save = Some((
            t,
            Mem {
                before,
                hwm,
                after,
                state: 0,
            },
        ));
    }
    barrier(e.comm());
    drop(e);
    if rank == 0 {
        let files = files_in(&dest);
        out.file_bytes = files
            .iter()
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .map(|p| fs::metadata(p).map_or(0, |m| m.len()))
            .sum();
        for p in &files {
            evict(p);
        }
        out.saved = Some(dest);
    }
    out
}

/// `load_checkpoint` of `dir` with its files in the page cache (a
/// diagnostic: the load's cost without the disk): the time, the
/// smallest cached fraction of a file, and the building of the engine
/// (the shortest `checkpoint build` span of the ranks).
fn warm_load(a: &Args, dir: &Path) -> (Duration, f64, Duration) {
    let tracer = Tracer::new();
    let t = ThreadGroup::run(RANKS, |comm| {
        let rank = comm.rank();
        // Read every file once so all of it is cached.
        if rank == 0 {
            for p in files_in(dir) {
                let mut buf = vec![0u8; BUF];
                let n = fs::metadata(&p).map_or(0, |m| m.len());
                raw_read(&p, n, &mut buf, false);
            }
        }
        let cached = if rank == 0 {
            files_in(dir)
                .iter()
                .map(|p| resident(p))
                .fold(1.0, f64::min)
        } else {
            0.0
        };
        barrier(&comm);
        let t0 = Instant::now();
        let (b, _) = builder(a, comm, &Init::Zeros);
        let (e, _) = Engine::load_checkpoint(b.tracer(tracer.clone()), dir)
            .unwrap_or_else(|err| panic!("load_checkpoint: {err}"));
        barrier(e.comm());
        (t0.elapsed(), cached)
    })
    .unwrap_or_else(|err| panic!("threads: {err}"));
    let build = tracer
        .events()
        .iter()
        .filter(|ev| ev.name == "checkpoint build")
        .map(|ev| Duration::from_secs_f64(ev.dur_us / 1e6))
        .min()
        .unwrap_or_default();
    (t[0].0, t[0].1, build)
}

// ----------------------------------------------------------------------
// Report

fn median<T: Copy + PartialOrd>(v: &[T]) -> T {
    let mut s = v.to_vec();
    s.sort_by(|x, y| x.partial_cmp(y).expect("no NaN"));
    s[s.len() / 2]
}

fn min<T: Copy + PartialOrd>(v: &[T]) -> T {
    v.iter()
        .copied()
        .fold(v[0], |m, x| if x < m { x } else { m })
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn mib(b: i64) -> f64 {
    b as f64 / MIB
}

/// Removes the bench's directory however the run ends.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn main() {
    let a = parse_args();
    let threshold = fix_mmap_threshold();
    let base = a
        .dir
        .join(format!("zero-ckpt-bench-{}", std::process::id()));
    fs::create_dir_all(&base)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", base.display())));
    let cleanup = Cleanup(base.clone());
    let params = UNITS * rows(&a) * COLS;
    let need = 2 * (12 * params as u64) + (256 << 20);
    let free = free_bytes(&base);
    if let Some(f) = free {
        if f < need {
            drop(cleanup);
            fail(&format!(
                "{}: {:.1} GB free, the run needs about {:.1} GB (a checkpoint and the raw files)",
                a.dir.display(),
                f as f64 / 1e9,
                need as f64 / 1e9
            ));
        }
    }
    let peak_resets = reset_peak();
    println!(
        "checkpoint: {params} parameters ({UNITS} units of {} x {COLS}), bf16, stage {}, {RANKS} ranks (threads), offload none, after 1 optimizer step; {} reps",
        rows(&a),
        a.stage,
        a.reps
    );
    println!(
        "dir {} ({:.1} GB free); write buffer {} MiB; raw baseline: one thread per rank, its own files of its rank file's size, {} MiB writes + fsync, {} MiB reads after fadvise(DONTNEED), plain and with write-/drop-behind; reduce_bucket_size {}; load average at start {}",
        base.display(),
        free.map_or(f64::NAN, |f| f as f64 / 1e9),
        BUF >> 20,
        BUF >> 20,
        BUF >> 20,
        config(&a).zero.reduce_bucket_size,
        loadavg()
    );
    let ctx = Ctx {
        a: &a,
        base: base.clone(),
        digest: Mutex::new(None),
        state: AtomicU64::new(0),
        tracer: Tracer::new(),
    };
    let mut outs: Vec<RunOut> = Vec::new();
    let mut prev: Option<PathBuf> = None;
    for k in 0..=a.reps {
        ctx.state.store(0, Ordering::SeqCst);
        let r = ThreadGroup::run(RANKS, |comm| rank_run(comm, &ctx, k, prev.as_deref()));
        let out = match r {
            Ok(mut v) => v.swap_remove(0),
            Err(err) => {
                drop(cleanup);
                fail(&format!("run {k}: {err}"));
            }
        };
        if out.saved.is_some() {
            prev = out.saved.clone();
        }
        outs.push(out);
    }
    let warm = prev.as_deref().map(|p| warm_load(&a, p));

    // Rep k: raw and save of run k, load of run k + 1.
    let bytes: Vec<u64> = outs[..a.reps].iter().map(|o| o.file_bytes).collect();
    let gb = |b: u64, d: Duration| b as f64 / d.as_secs_f64() / 1e9;
    println!();
    println!(
        "{:>3} {:>7} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>10}",
        "rep",
        "GB",
        "wr plain",
        "wr behind",
        "save s",
        "save/raw",
        "rd plain",
        "rd behind",
        "load s",
        "build s",
        "load/raw",
        "(-build)",
        "cached max"
    );
    let (mut sr, mut lr, mut lbr) = (Vec::new(), Vec::new(), Vec::new());
    let (mut sg, mut lg, mut lbg) = (Vec::new(), Vec::new(), Vec::new());
    let (mut rwg, mut rwbg, mut rrg, mut rrbg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut rfg, mut lfr) = (Vec::new(), Vec::new());
    for k in 0..a.reps {
        let raw = outs[k].raw.expect("raw");
        let (ts, _) = outs[k].save.expect("save");
        let load = outs[k + 1].load.expect("load");
        let (tl, tb) = (load.time, load.build);
        let fill = tl.saturating_sub(tb);
        let (tw, tr) = (raw.best_write(), raw.best_read());
        let b = bytes[k];
        let s = tw.as_secs_f64() / ts.as_secs_f64();
        let l = tr.as_secs_f64() / tl.as_secs_f64();
        let lb = tr.as_secs_f64() / fill.as_secs_f64();
        sr.push(s);
        lr.push(l);
        lbr.push(lb);
        sg.push(gb(b, ts));
        lg.push(gb(b, tl));
        lbg.push(gb(b, fill));
        rwg.push(gb(b, raw.write));
        rwbg.push(gb(b, raw.write_behind));
        rrg.push(gb(b, raw.read));
        rrbg.push(gb(b, raw.read_behind));
        rfg.push(gb(b, raw.read_fresh));
        lfr.push(raw.read_fresh.as_secs_f64() / fill.as_secs_f64());
        println!(
            "{k:>3} {:>7.3} {:>9.3} {:>9.3} {:>8.3} {:>7.1}% {:>9.3} {:>9.3} {:>9.3} {:>8.3} {:>7.1}% {:>8.1}% {:>9.1}%",
            b as f64 / 1e9,
            raw.write.as_secs_f64(),
            raw.write_behind.as_secs_f64(),
            ts.as_secs_f64(),
            100.0 * s,
            raw.read.as_secs_f64(),
            raw.read_behind.as_secs_f64(),
            tl.as_secs_f64(),
            tb.as_secs_f64(),
            100.0 * l,
            100.0 * lb,
            100.0 * raw.cached.max(load.cached)
        );
    }
    println!();
    println!(
        "{:<38} {:>11} {:>11} {:>11}",
        "GB/s (all ranks' files / time)", "min", "median", "max"
    );
    for (name, v) in [
        ("raw write + fsync, plain", &rwg),
        ("raw write + fsync, write-behind", &rwbg),
        ("save_checkpoint", &sg),
        ("raw read (cold), plain", &rrg),
        ("raw read (cold), drop-behind", &rrbg),
        ("  the same into new memory (diag.)", &rfg),
        ("load_checkpoint (incl. build)", &lg),
        ("load_checkpoint (excl. build)", &lbg),
    ] {
        println!(
            "{name:<38} {:>11.3} {:>11.3} {:>11.3}",
            min(v),
            median(v),
            v.iter().copied().fold(f64::MIN, f64::max)
        );
    }
    println!();
    println!(
        "{:<38} {:>11} {:>11} {:>11}",
        "ratio to the faster raw, same rep", "min", "median", "target"
    );
    for (name, v) in [
        ("save / raw write", &sr),
        ("load / raw read", &lr),
        ("load excl. build / raw read", &lbr),
    ] {
        println!(
            "{name:<38} {:>10.1}% {:>10.1}% {:>11}",
            100.0 * min(v),
            100.0 * median(v),
            ">= 70%"
        );
    }
    println!(
        "{:<38} {:>10.1}% {:>10.1}% {:>11}",
        "load excl. build / raw into new mem.",
        100.0 * min(&lfr),
        100.0 * median(&lfr),
        "(diag.)"
    );

    println!();
    if !peak_resets {
        println!(
            "NOTE: writing /proc/self/clear_refs is not permitted here, so VmHWM was not reset before each phase: the figures below are the process's raw VmHWM, which includes everything before the phase."
        );
    }
    if !threshold {
        println!("NOTE: glibc's mmap threshold could not be fixed: freed buffers may stay in the RSS (and in VmHWM).");
    }
    let target = 2 * BUF as i64;
    println!(
        "{:<6} {:>12} {:>12} {:>12} {:>13} {:>12} {:>12} {:>13}",
        "host",
        "RSS before",
        "VmHWM",
        "engine S",
        "extra total",
        "extra/rank",
        "target/rank",
        "RSS after-S"
    );
    println!(
        "{:<6} {:>12} {:>12} {:>12} {:>13} {:>12} {:>12} {:>13}",
        "MiB", "", "", "", "(max of reps)", "", "", "-before"
    );
    let saves: Vec<Mem> = outs[..a.reps]
        .iter()
        .map(|o| o.save.expect("save").1)
        .collect();
    let loads: Vec<Mem> = outs[1..]
        .iter()
        .map(|o| o.load.expect("load").mem)
        .collect();
    for (name, v) in [("save", &saves), ("load", &loads)] {
        let worst = v.iter().copied().max_by_key(|m| m.extra()).expect("reps");
        let extra = worst.extra();
        println!(
            "{name:<6} {:>12.1} {:>12.1} {:>12.1} {:>13.1} {:>12.1} {:>12.1} {:>13.1}  {}",
            mib(worst.before as i64),
            mib(worst.hwm as i64),
            mib(worst.state as i64),
            mib(extra),
            mib(extra / RANKS as i64),
            mib(target),
            mib(worst.after as i64 - worst.state as i64 - worst.before as i64),
            if extra / RANKS as i64 <= target {
                "ok"
            } else {
                "OVER"
            }
        );
        let all: Vec<String> = v.iter().map(|m| format!("{:.1}", mib(m.extra()))).collect();
        println!(
            "{:<6} extra per rep (MiB, both ranks): {}",
            "",
            all.join(", ")
        );
    }
    println!(
        "memory method: before each phase VmHWM is reset to the RSS (clear_refs 5); extra = VmHWM after the phase - VmRSS before it - S, both ranks together (threads of one process), per rank = / {RANKS}. S = 0 for save (the engine exists before it); for load S = every byte the new engine allocated (its memory trackers, summed over ranks: parameters, master, m, v, gradient shards, buckets), which load_checkpoint builds and which are not checkpoint overhead; RSS after-S-before is what stays resident beyond S once the load is done. glibc mmap threshold fixed at 256 KiB: {threshold}."
    );
    println!(
        "times in s. wr/rd plain: the raw baseline as plain buffered I/O; wr/rd behind: the same with write-behind (sync_file_range + fadvise DONTNEED {} MiB behind) or drop-behind (fadvise DONTNEED after each read), the checkpoint's own way of streaming; save/raw and load/raw are against the faster of the two. load s includes building the engine; build s is that build (the shortest `checkpoint build` span of the ranks, from the engine's tracer); (-build) is load/raw with it subtracted. cached max: the largest fraction of a file's pages in the page cache (mincore) after fadvise(DONTNEED), before a read. State verified after every load (first and last units). Load average at end {}.",
        WRITE_BEHIND >> 20,
        loadavg()
    );
    if let Some((t, cached, build)) = warm {
        let b = bytes[a.reps - 1];
        println!(
            "diagnostic: load_checkpoint of the last checkpoint with its files in the page cache (min {:.0}% cached): {:.3} s = {:.3} GB/s incl. build, build {:.3} s, {:.3} GB/s excl. build (the cost of a load without the disk).",
            100.0 * cached,
            t.as_secs_f64(),
            gb(b, t),
            build.as_secs_f64(),
            gb(b, t.saturating_sub(build))
        );
    }
    drop(cleanup);
}
