//! Span tracing to a Chrome trace (JSON), to see per rank how forward,
//! backward, gradient reductions, parameter gathers, the optimizer step and
//! offload traffic overlap. The file opens in [Perfetto](https://ui.perfetto.dev)
//! or `chrome://tracing`; each rank is one process (`rank N`) with a track
//! per category: compute, optimizer, waits for communication, the
//! collectives themselves (when the progress thread ran them) and offload
//! (see [`write_chrome_trace`]).
//!
//! A [`Tracer`] is a cheap handle (an `Option<Arc<…>>`): clones record into
//! the same list. [`Tracer::disabled`] (the default) records nothing and
//! costs a branch per span: no clock read, no allocation, no lock.
//!
//! ```text
//!  trainer  span("forward layer0") ───────────┐
//!  Engine   span("gather" | "reduce" | …) ────┼──▶ Tracer ──events()──▶ write_chrome_trace
//!  offload  span("swap read" | …) ────────────┘      (clones share one list)
//! ```
//!
//! The engine records, with its rank as `rank`, when given a tracer by
//! [`EngineBuilder::tracer`](crate::EngineBuilder::tracer):
//!
//! | name | cat | where |
//! |---|---|---|
//! | `gather` | `comm` | parameter all-gathers the rank waits for (stage 3 `gather`; stages 1–2: after the step, or in `gather` with `overlap_comm`; stage 3's persistent units) |
//! | `reduce` | `comm` | adding a gradient to a bucket, waiting for and storing reductions |
//! | `optimizer` | `optimizer` | norm, clipping and AdamW (offload write-back included) |
//! | `grad to host` | `offload` | storing a reduced gradient into the host shard (optimizer offload) |
//! | `adam tile` | `optimizer` | AdamW on one offloaded tile |
//! | `param copy-out` | `offload` | updated parameters of an offloaded tile back to the parameters |
//! | `swap read`, `swap write` | `offload` | waiting for a swap-file read or write |
//! | `param fetch` | `offload` | a parameter shard from its offload home into the gathered unit |
//! | `param write back` | `offload` | an updated parameter shard to its offload home (nvme without optimizer offload: the unit's AdamW included) |
//! | `all_gather`, `reduce_scatter`, `all_reduce` | `collective` | when a parameter all-gather or gradient reduction ran on the communicator's progress thread (from its start, which may wait for peers, to its result), recorded when the engine collects it |
//!
//! `comm` spans are time the trainer's thread was blocked; `collective`
//! spans are when the transfer happened. Their difference against the
//! `compute` spans is the overlap: [`overlap`] computes it.
//!
//! Timestamps are microseconds since the UNIX epoch (the wall clock read
//! once when the tracer is made, advanced by the monotonic clock), so ranks
//! that are separate processes on one host line up in one trace.
//!
//! # Collecting the ranks' events
//!
//! - **Threads backend** (all ranks in one process): give every rank's
//!   engine a clone of one tracer; after the run any clone's
//!   [`Tracer::events`] holds every rank's spans.
//! - **MPI** (one process per rank): each rank has its own tracer; call
//!   the collective [`gather_events`] on every rank, and rank 0 writes the
//!   file.
//!
//! ```
//! use zero::comm::{Communicator, ThreadGroup};
//! use zero::trace::{gather_events, write_chrome_trace, Tracer};
//!
//! // Threads: one tracer, a clone per rank (for an engine:
//! // `Engine::builder(cfg, comm).tracer(tracer.clone())`).
//! let tracer = Tracer::new();
//! ThreadGroup::run(2, |comm| {
//!     let _span = tracer.span_with(comm.rank(), || format!("forward layer{}", 0), "compute");
//! })
//! .unwrap();
//! assert_eq!(tracer.events().len(), 2);
//!
//! // One process per rank (MPI): every rank its own tracer, gathered on
//! // rank 0, which writes the file.
//! fn finish<C: Communicator>(comm: &C, tracer: &Tracer) -> Result<(), Box<dyn std::error::Error>> {
//!     if let Some(all) = gather_events(comm, tracer.events())? {
//!         write_chrome_trace(&std::env::temp_dir().join("zero-trace-doc.json"), &all)?;
//!     }
//!     Ok(())
//! }
//! ThreadGroup::run(2, |comm| {
//!     let tracer = Tracer::new();
//!     drop(tracer.span(comm.rank(), "step", "optimizer"));
//!     finish(&comm, &tracer).map_err(|e| e.to_string())
//! })
//! .unwrap()
//! .into_iter()
//! .collect::<Result<(), String>>()
//! .unwrap();
//! ```

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use zero_comm::agree::exchange_bytes;
use zero_comm::{Communicator, Work};

use crate::{Error, Result};

/// One completed span.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// What ran: `"gather"`, `"forward layers.3"`.
    pub name: Cow<'static, str>,
    /// Its category (`"comm"`, `"optimizer"`, `"offload"`, `"compute"`):
    /// Perfetto can filter and colour by it.
    pub cat: Cow<'static, str>,
    /// The rank that ran it (the trace row).
    pub rank: usize,
    /// Start, in microseconds since the UNIX epoch.
    pub ts_us: f64,
    /// Duration in microseconds (≥ 0).
    pub dur_us: f64,
}

/// What an enabled tracer shares between its clones.
struct Inner {
    /// The monotonic clock at construction …
    origin: Instant,
    /// … and the wall clock then, in µs since the UNIX epoch.
    origin_us: f64,
    events: Mutex<Vec<Event>>,
}

impl Inner {
    fn us(&self, t: Instant) -> f64 {
        match t.checked_duration_since(self.origin) {
            Some(d) => self.origin_us + d.as_secs_f64() * 1e6,
            None => self.origin_us - (self.origin - t).as_secs_f64() * 1e6,
        }
    }

    /// The list, also after a panic elsewhere poisoned the lock (recording
    /// never panics: spans end in `Drop`).
    fn lock(&self) -> MutexGuard<'_, Vec<Event>> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(
        &self,
        rank: usize,
        name: Cow<'static, str>,
        cat: Cow<'static, str>,
        a: Instant,
        b: Instant,
    ) {
        let ts_us = self.us(a);
        let dur_us = b.saturating_duration_since(a).as_secs_f64() * 1e6;
        self.lock().push(Event {
            name,
            cat,
            rank,
            ts_us,
            dur_us,
        });
    }
}

/// Records spans; see the [module docs](self). Clones share one list.
#[derive(Clone, Default)]
pub struct Tracer {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Some(i) => f
                .debug_struct("Tracer")
                .field("events", &i.lock().len())
                .finish(),
            None => f.write_str("Tracer(disabled)"),
        }
    }
}

impl Tracer {
    /// A tracer that records.
    pub fn new() -> Self {
        let origin_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6);
        Self {
            inner: Some(Arc::new(Inner {
                origin: Instant::now(),
                origin_us,
                events: Mutex::new(Vec::new()),
            })),
        }
    }

    /// A tracer that records nothing (also [`Tracer::default`]).
    pub fn disabled() -> Self {
        Self { inner: None }
    }

    /// Whether this tracer records.
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Starts a span of `rank`, recorded when the guard drops. Bind it
    /// (`let _span = …`): `let _ = …` drops it at once. Pass a
    /// `&'static str` name where you can; for a computed one, use
    /// [`Tracer::span_with`], which builds it only when enabled.
    pub fn span(
        &self,
        rank: usize,
        name: impl Into<Cow<'static, str>>,
        cat: &'static str,
    ) -> SpanGuard {
        SpanGuard {
            active: self.inner.as_ref().map(|inner| Active {
                inner: Arc::clone(inner),
                rank,
                name: name.into(),
                cat,
                start: Instant::now(),
            }),
        }
    }

    /// [`Tracer::span`] with the name built by `name` only when the tracer
    /// records (e.g. `|| format!("forward {unit}")`).
    pub fn span_with(
        &self,
        rank: usize,
        name: impl FnOnce() -> String,
        cat: &'static str,
    ) -> SpanGuard {
        if self.inner.is_some() {
            self.span(rank, name(), cat)
        } else {
            SpanGuard { active: None }
        }
    }

    /// Records a span of `rank` from `start` to `end` (measured by the
    /// caller; an `end` before `start` gives duration 0).
    pub fn record(
        &self,
        rank: usize,
        name: impl Into<Cow<'static, str>>,
        cat: &'static str,
        start: Instant,
        end: Instant,
    ) {
        if let Some(inner) = &self.inner {
            inner.push(rank, name.into(), Cow::Borrowed(cat), start, end);
        }
    }

    /// A copy of every event recorded so far by this tracer and its clones,
    /// in the order they ended. Empty when disabled.
    pub fn events(&self) -> Vec<Event> {
        self.inner
            .as_ref()
            .map_or_else(Vec::new, |i| i.lock().clone())
    }

    /// Forgets the events recorded so far (e.g. the warm-up steps).
    pub fn clear(&self) {
        if let Some(i) = &self.inner {
            i.lock().clear();
        }
    }

    /// Waits for a collective and records, on the `collective` track of
    /// `rank`, when it ran on the communicator's progress thread (so that
    /// a trace shows how much of it overlapped compute).
    pub fn wait<R: 'static>(&self, rank: usize, work: Work<R>) -> Result<R> {
        let op = work.op();
        let (r, timing) = work.wait_timed()?;
        if let Some(t) = timing {
            self.record(rank, op, "collective", t.started, t.finished);
        }
        Ok(r)
    }
}

/// A span in progress: records it into its [`Tracer`] when dropped.
#[must_use = "a span ends when its guard drops: bind it with `let _span = …`"]
pub struct SpanGuard {
    active: Option<Active>,
}

struct Active {
    inner: Arc<Inner>,
    rank: usize,
    name: Cow<'static, str>,
    cat: &'static str,
    start: Instant,
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        if let Some(a) = self.active.take() {
            let end = Instant::now();
            a.inner
                .push(a.rank, a.name, Cow::Borrowed(a.cat), a.start, end);
        }
    }
}

impl std::fmt::Debug for SpanGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.active {
            Some(a) => f
                .debug_struct("SpanGuard")
                .field("rank", &a.rank)
                .field("name", &a.name)
                .field("cat", &a.cat)
                .finish(),
            None => f.write_str("SpanGuard(disabled)"),
        }
    }
}

/// A tracer bound to one rank: the engine's handle for its offload parts.
/// It also counts their swap-file traffic (always, traced or not).
#[derive(Clone, Default)]
pub(crate) struct RankTracer {
    tracer: Tracer,
    rank: usize,
    io: Arc<IoCounters>,
}

/// A direction of swap-file traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Io {
    Read,
    Write,
}

/// Swap-file bytes submitted and time spent waiting for them, per
/// direction.
#[derive(Debug, Default)]
struct IoCounters {
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    read_wait_ns: AtomicU64,
    write_wait_ns: AtomicU64,
}

/// A wait for swap I/O: a span of the trace (when tracing) and the time it
/// takes, counted when it is dropped.
pub(crate) struct IoWait {
    _span: SpanGuard,
    start: Instant,
    dir: Io,
    io: Arc<IoCounters>,
}

impl Drop for IoWait {
    fn drop(&mut self) {
        let ns = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let c = match self.dir {
            Io::Read => &self.io.read_wait_ns,
            Io::Write => &self.io.write_wait_ns,
        };
        c.fetch_add(ns, Ordering::Relaxed);
    }
}

impl RankTracer {
    pub(crate) fn new(tracer: Tracer, rank: usize) -> Self {
        Self {
            tracer,
            rank,
            io: Arc::default(),
        }
    }

    /// [`Tracer::span`] of this rank.
    pub(crate) fn span(&self, name: &'static str, cat: &'static str) -> SpanGuard {
        self.tracer.span(self.rank, name, cat)
    }

    /// A wait for swap I/O in direction `dir`: the span `name` (category
    /// `offload`) and its time, counted until the guard is dropped.
    pub(crate) fn io_wait(&self, dir: Io, name: &'static str) -> IoWait {
        IoWait {
            _span: self.span(name, "offload"),
            start: Instant::now(),
            dir,
            io: Arc::clone(&self.io),
        }
    }

    /// Counts `bytes` submitted to a swap file in direction `dir`.
    pub(crate) fn io_bytes(&self, dir: Io, bytes: u64) {
        let c = match dir {
            Io::Read => &self.io.read_bytes,
            Io::Write => &self.io.write_bytes,
        };
        c.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The traffic counted so far.
    pub(crate) fn traffic(&self) -> SwapTraffic {
        let ns = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed));
        SwapTraffic {
            read_bytes: self.io.read_bytes.load(Ordering::Relaxed),
            write_bytes: self.io.write_bytes.load(Ordering::Relaxed),
            read_wait: ns(&self.io.read_wait_ns),
            write_wait: ns(&self.io.write_wait_ns),
        }
    }
}

/// One swap file's traffic: bytes submitted (the regions read and
/// written) and the time the engine waited for them, since the engine was
/// built (the initial writes at build are not counted). Wait time is
/// what the I/O did not hide behind other work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwapTraffic {
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Time spent waiting for reads.
    pub read_wait: Duration,
    /// Time spent waiting for writes (or for a buffer a write held).
    pub write_wait: Duration,
}

impl std::ops::Sub for SwapTraffic {
    type Output = SwapTraffic;

    /// The traffic since `o` (an earlier reading of the same counters).
    fn sub(self, o: SwapTraffic) -> SwapTraffic {
        SwapTraffic {
            read_bytes: self.read_bytes.saturating_sub(o.read_bytes),
            write_bytes: self.write_bytes.saturating_sub(o.write_bytes),
            read_wait: self.read_wait.saturating_sub(o.read_wait),
            write_wait: self.write_wait.saturating_sub(o.write_wait),
        }
    }
}

impl std::ops::Add for SwapTraffic {
    type Output = SwapTraffic;

    fn add(self, o: SwapTraffic) -> SwapTraffic {
        SwapTraffic {
            read_bytes: self.read_bytes + o.read_bytes,
            write_bytes: self.write_bytes + o.write_bytes,
            read_wait: self.read_wait + o.read_wait,
            write_wait: self.write_wait + o.write_wait,
        }
    }
}

/// One `traceEvents` entry of the Chrome trace format.
#[derive(Serialize)]
struct ChromeEvent<'a> {
    name: &'a str,
    cat: &'a str,
    ph: &'static str,
    ts: f64,
    dur: f64,
    pid: usize,
    tid: usize,
}

/// A metadata (`"ph": "M"`) entry: names a process or thread row.
#[derive(Serialize)]
struct Meta<'a> {
    name: &'static str,
    ph: &'static str,
    pid: usize,
    tid: usize,
    args: MetaArgs<'a>,
}

#[derive(Serialize)]
struct MetaArgs<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sort_index: Option<usize>,
}

impl<'a> MetaArgs<'a> {
    fn name(name: &'a str) -> Self {
        MetaArgs {
            name: Some(name),
            sort_index: None,
        }
    }

    fn sort(i: usize) -> Self {
        MetaArgs {
            name: None,
            sort_index: Some(i),
        }
    }
}

/// The tracks of a rank, in display order: a category's spans go to its
/// track (unknown categories after these, by name).
const TRACKS: [(&str, &str); 5] = [
    ("compute", "compute"),
    ("optimizer", "optimizer"),
    ("comm", "waits for communication"),
    ("collective", "collectives (progress thread)"),
    ("offload", "offload"),
];

/// Writes `events` to `path` as a Chrome trace:
/// `{"traceEvents": [...], "displayTimeUnit": "ms"}` with one complete
/// event (`"ph": "X"`, `ts` and `dur` in µs) per span. Each rank is a
/// process (`pid` = rank, named `rank N`, in rank order) with one track
/// (`tid`) per category: `compute`, `optimizer`, `waits for communication`
/// (cat `comm`), `collectives (progress thread)` (cat `collective`: when
/// each collective ran), `offload`, then any other category. Spans of one
/// category that overlap without nesting (e.g. two I/O threads) go to extra
/// tracks of that category (`offload 2`, …), since a viewer shows one track
/// as a stack of nested slices.
pub fn write_chrome_trace(path: &Path, events: &[Event]) -> std::io::Result<()> {
    let mut w = BufWriter::new(File::create(path)?);
    write_trace(&mut w, events)?;
    w.flush()
}

/// Places each event on a track: `(rank, track name, tid)` per event, and
/// the tracks in display order. Within a (rank, category), events are
/// visited by start (longest first) and each goes to the first lane where
/// it is disjoint from or nested in what is open there.
fn lay_out(events: &[Event]) -> (Vec<usize>, Vec<(usize, usize, String)>) {
    use std::collections::BTreeMap;
    let rank_of_cat = |cat: &str| TRACKS.iter().position(|(c, _)| *c == cat);
    // (rank, category order key) → event indices.
    let mut groups: BTreeMap<(usize, usize, &str), Vec<usize>> = BTreeMap::new();
    for (i, e) in events.iter().enumerate() {
        let key = rank_of_cat(&e.cat).unwrap_or(TRACKS.len());
        groups.entry((e.rank, key, &e.cat)).or_default().push(i);
    }
    let mut tid_of = vec![0; events.len()];
    let mut tracks = Vec::new();
    let mut next_tid: BTreeMap<usize, usize> = BTreeMap::new();
    for ((rank, key, cat), mut idx) in groups {
        idx.sort_by(|&a, &b| {
            let (x, y) = (&events[a], &events[b]);
            x.ts_us
                .total_cmp(&y.ts_us)
                .then(y.dur_us.total_cmp(&x.dur_us))
        });
        // Per lane: the ends of the spans open at the current start.
        let mut lanes: Vec<Vec<f64>> = Vec::new();
        let mut lane_tid: Vec<usize> = Vec::new();
        for i in idx {
            let (start, end) = (events[i].ts_us, events[i].ts_us + events[i].dur_us.max(0.0));
            let fits = |open: &mut Vec<f64>| {
                while open.last().is_some_and(|&e| e <= start) {
                    open.pop();
                }
                open.last().is_none_or(|&e| e >= end)
            };
            let lane = match lanes.iter_mut().position(fits) {
                Some(l) => l,
                None => {
                    lanes.push(Vec::new());
                    let tid = next_tid.entry(rank).or_insert(0);
                    lane_tid.push(*tid);
                    let base = key.min(TRACKS.len());
                    let name = match TRACKS.get(base) {
                        Some((_, n)) if lanes.len() == 1 => (*n).to_string(),
                        Some((_, n)) => format!("{n} {}", lanes.len()),
                        None if lanes.len() == 1 => cat.to_string(),
                        None => format!("{cat} {}", lanes.len()),
                    };
                    tracks.push((rank, *tid, name));
                    *tid += 1;
                    lanes.len() - 1
                }
            };
            lanes[lane].push(end);
            tid_of[i] = lane_tid[lane];
        }
    }
    (tid_of, tracks)
}

fn write_trace<W: Write>(w: &mut W, events: &[Event]) -> std::io::Result<()> {
    let (tid_of, tracks) = lay_out(events);
    let mut ranks: Vec<usize> = events.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    w.write_all(b"{\"traceEvents\":[\n")?;
    let mut first = true;
    let mut meta = |w: &mut W, name: &'static str, pid: usize, tid: usize, args: MetaArgs| {
        if !std::mem::take(&mut first) {
            w.write_all(b",\n")?;
        }
        serde_json::to_writer(
            &mut *w,
            &Meta {
                name,
                ph: "M",
                pid,
                tid,
                args,
            },
        )
        .map_err(std::io::Error::from)
    };
    for &r in &ranks {
        let label = format!("rank {r}");
        meta(w, "process_name", r, 0, MetaArgs::name(&label))?;
        meta(w, "process_sort_index", r, 0, MetaArgs::sort(r))?;
    }
    for (k, (rank, tid, name)) in tracks.iter().enumerate() {
        meta(w, "thread_name", *rank, *tid, MetaArgs::name(name))?;
        meta(w, "thread_sort_index", *rank, *tid, MetaArgs::sort(k))?;
    }
    for (e, &tid) in events.iter().zip(&tid_of) {
        if !std::mem::take(&mut first) {
            w.write_all(b",\n")?;
        }
        serde_json::to_writer(
            &mut *w,
            &ChromeEvent {
                name: &e.name,
                cat: &e.cat,
                ph: "X",
                ts: e.ts_us,
                dur: e.dur_us.max(0.0),
                pid: e.rank,
                tid,
            },
        )?;
    }
    w.write_all(b"\n],\"displayTimeUnit\":\"ms\"}\n")
}

/// How much of one rank's communication ran while the rank computed: see
/// [`overlap`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Overlap {
    /// Time in which collectives ran (union of the `collective` spans), µs.
    pub collective_us: f64,
    /// Of that, the time in which the trainer computed (inside a `compute`
    /// or `optimizer` span) and was not blocked in a `comm` wait, µs.
    pub hidden_us: f64,
    /// Time the trainer was blocked in `comm` waits (union), µs.
    pub wait_us: f64,
}

impl Overlap {
    /// `hidden_us / collective_us`; `None` when no collective ran.
    pub fn fraction(&self) -> Option<f64> {
        (self.collective_us > 0.0).then(|| self.hidden_us / self.collective_us)
    }
}

/// The communication/compute overlap of `rank` in `events`: the time its
/// collectives ran (`collective` spans), and how much of it the rank spent
/// computing rather than waiting — `|C ∩ (F ∖ W)|` with `C` the union of
/// `collective` spans, `F` of `compute` and `optimizer` spans and `W` of
/// `comm` waits (the trainer's compute spans enclose its engine calls, so
/// the waits are taken out).
pub fn overlap(events: &[Event], rank: usize) -> Overlap {
    let union = |cats: &[&str]| {
        let mut v: Vec<(f64, f64)> = events
            .iter()
            .filter(|e| e.rank == rank && cats.contains(&e.cat.as_ref()))
            .map(|e| (e.ts_us, e.ts_us + e.dur_us.max(0.0)))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
        for (a, b) in v {
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        out
    };
    let len = |v: &[(f64, f64)]| v.iter().map(|(a, b)| b - a).sum::<f64>();
    // Intersection of two sorted disjoint interval lists.
    let meet = |x: &[(f64, f64)], y: &[(f64, f64)]| {
        let (mut i, mut j, mut out) = (0, 0, Vec::new());
        while i < x.len() && j < y.len() {
            let (a, b) = (x[i].0.max(y[j].0), x[i].1.min(y[j].1));
            if a < b {
                out.push((a, b));
            }
            if x[i].1 < y[j].1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        out
    };
    let c = union(&["collective"]);
    let f = union(&["compute", "optimizer"]);
    let w = union(&["comm"]);
    let cf = meet(&c, &f);
    Overlap {
        collective_us: len(&c),
        hidden_us: len(&cf) - len(&meet(&cf, &w)),
        wait_us: len(&w),
    }
}

/// Collects every rank's `events` on rank 0 (a collective: every rank
/// calls it at the same point). Returns `Some` of all events, rank 0's
/// first, on rank 0 and `None` on the others. For one process per rank
/// (MPI), where each rank has its own [`Tracer`]; with the threads backend
/// and one shared tracer, read [`Tracer::events`] instead (gathering
/// would duplicate the events).
pub fn gather_events<C: Communicator>(comm: &C, events: Vec<Event>) -> Result<Option<Vec<Event>>> {
    let rank = comm.rank();
    let bytes = encode(&events);
    drop(events);
    // Every rank's bytes, whatever their lengths (two collectives).
    let parts = exchange_bytes(comm, &bytes)?;
    drop(bytes);
    if rank != 0 {
        return Ok(None);
    }
    let mut all = Vec::new();
    for (r, part) in parts.iter().enumerate() {
        decode(part, &mut all).ok_or_else(|| Error::Disagreement {
            rank,
            what: format!(
                "gather_events: rank {r} sent {} bytes that are not a trace (a different version \
                 of zero?)",
                part.len()
            ),
        })?;
    }
    Ok(Some(all))
}

/// Events as bytes, exactly (f64 bit patterns): per event
/// `rank ts dur` (u64 LE each), then name and cat as a u32 LE length and
/// UTF-8.
fn encode(events: &[Event]) -> Vec<u8> {
    let mut out = Vec::with_capacity(events.len() * 48);
    for e in events {
        out.extend((e.rank as u64).to_le_bytes());
        out.extend(e.ts_us.to_bits().to_le_bytes());
        out.extend(e.dur_us.to_bits().to_le_bytes());
        for s in [&e.name, &e.cat] {
            out.extend((s.len() as u32).to_le_bytes());
            out.extend(s.as_bytes());
        }
    }
    out
}

/// The inverse of [`encode`], appending to `out`; `None` if malformed.
fn decode(mut b: &[u8], out: &mut Vec<Event>) -> Option<()> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (head, tail) = b.split_at(n);
        *b = tail;
        Some(head)
    }
    fn word(b: &mut &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(take(b, 8)?.try_into().ok()?))
    }
    fn text(b: &mut &[u8]) -> Option<Cow<'static, str>> {
        let n = u32::from_le_bytes(take(b, 4)?.try_into().ok()?) as usize;
        let s = std::str::from_utf8(take(b, n)?).ok()?;
        Some(Cow::Owned(s.to_owned()))
    }
    while !b.is_empty() {
        let rank = usize::try_from(word(&mut b)?).ok()?;
        let ts_us = f64::from_bits(word(&mut b)?);
        let dur_us = f64::from_bits(word(&mut b)?);
        let name = text(&mut b)?;
        let cat = text(&mut b)?;
        out.push(Event {
            name,
            cat,
            rank,
            ts_us,
            dur_us,
        });
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(rank: usize, name: &str, ts: f64) -> Event {
        Event {
            name: Cow::Owned(name.to_owned()),
            cat: Cow::Borrowed("comm"),
            rank,
            ts_us: ts,
            dur_us: 1.5,
        }
    }

    #[test]
    fn encode_round_trips_exactly() {
        let events = vec![
            ev(0, "gather", 1.7e15 + 0.123),
            ev(7, "forward layers.3 – ü", -0.0),
            ev(1, "", f64::MIN_POSITIVE),
        ];
        let mut out = Vec::new();
        decode(&encode(&events), &mut out).unwrap();
        assert_eq!(out, events);
        let bytes = encode(&events);
        assert!(decode(&bytes[..bytes.len() - 1], &mut Vec::new()).is_none());
    }

    #[test]
    fn disabled_records_nothing() {
        let t = Tracer::disabled();
        assert!(!t.is_enabled());
        drop(t.span(0, "x", "comm"));
        drop(t.span_with(0, || unreachable!("not built when disabled"), "comm"));
        t.record(0, "y", "comm", Instant::now(), Instant::now());
        assert!(t.events().is_empty());
    }

    #[test]
    fn spans_are_timed_on_the_wall_clock() {
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            * 1e6;
        let t = Tracer::new();
        {
            let _s = t.clone().span(3, String::from("forward layer0"), "compute");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let a = Instant::now();
        t.record(
            1,
            "late",
            "comm",
            a,
            a - std::time::Duration::from_millis(1),
        );
        let after = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            * 1e6;
        let ev = t.events();
        assert_eq!(ev.len(), 2);
        assert_eq!(
            (ev[0].rank, &*ev[0].name, &*ev[0].cat),
            (3, "forward layer0", "compute")
        );
        assert!(ev[0].dur_us >= 2000.0, "{ev:?}");
        for e in &ev {
            assert!(
                e.ts_us >= before - 1e3 && e.ts_us + e.dur_us <= after + 1e3,
                "{e:?}"
            );
        }
        assert_eq!(ev[1].dur_us, 0.0);
        t.clear();
        assert!(t.events().is_empty());
    }

    fn span(rank: usize, cat: &'static str, name: &str, ts: f64, dur: f64) -> Event {
        Event {
            name: Cow::Owned(name.into()),
            cat: Cow::Borrowed(cat),
            rank,
            ts_us: ts,
            dur_us: dur,
        }
    }

    #[test]
    fn chrome_trace_has_a_process_per_rank_and_a_track_per_category() {
        let events = [
            ev(1, "reduce", 10.0),
            ev(0, "gather", 5.0),
            span(0, "compute", "forward", 0.0, 100.0),
            span(0, "compute", "layer0", 10.0, 20.0),
            span(0, "collective", "all_gather", 2.0, 50.0),
            // Two offload spans that overlap without nesting: two tracks.
            span(0, "offload", "swap read", 0.0, 30.0),
            span(0, "offload", "swap write", 20.0, 30.0),
            // Nested in the first: same track.
            span(0, "offload", "inner", 5.0, 5.0),
            span(0, "custom", "x", 0.0, 1.0),
        ];
        let mut out = Vec::new();
        write_trace(&mut out, &events).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        let names = |what: &str| -> Vec<(u64, u64, String)> {
            evs.iter()
                .filter(|e| e["name"] == what)
                .map(|e| {
                    (
                        e["pid"].as_u64().unwrap(),
                        e["tid"].as_u64().unwrap(),
                        e["args"]["name"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        };
        assert_eq!(
            names("process_name"),
            [(0, 0, "rank 0".to_string()), (1, 0, "rank 1".to_string())]
        );
        let tracks = names("thread_name");
        let t = |pid: u64, name: &str| {
            tracks
                .iter()
                .find(|(p, _, n)| *p == pid && n == name)
                .unwrap_or_else(|| panic!("no track {name} on rank {pid}: {tracks:?}"))
                .1
        };
        let x: Vec<_> = evs.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), events.len());
        let tid_of = |name: &str| {
            let e = x.iter().find(|e| e["name"] == name).unwrap();
            (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap())
        };
        assert_eq!(tid_of("reduce"), (1, t(1, "waits for communication")));
        assert_eq!(tid_of("gather"), (0, t(0, "waits for communication")));
        assert_eq!(tid_of("forward"), (0, t(0, "compute")));
        assert_eq!(tid_of("layer0"), (0, t(0, "compute")));
        assert_eq!(
            tid_of("all_gather"),
            (0, t(0, "collectives (progress thread)"))
        );
        assert_eq!(tid_of("swap read"), (0, t(0, "offload")));
        assert_eq!(tid_of("inner"), (0, t(0, "offload")));
        assert_eq!(tid_of("swap write"), (0, t(0, "offload 2")));
        assert_eq!(tid_of("x"), (0, t(0, "custom")));
        // Tracks of a rank are distinct and in the documented order.
        let rank0: Vec<&str> = tracks
            .iter()
            .filter(|(p, _, _)| *p == 0)
            .map(|(_, _, n)| n.as_str())
            .collect();
        assert_eq!(
            rank0,
            [
                "compute",
                "waits for communication",
                "collectives (progress thread)",
                "offload",
                "offload 2",
                "custom"
            ]
        );
        assert_eq!(x[0]["dur"], 1.5);
        assert_eq!(v["displayTimeUnit"], "ms");
        // No events: still a valid trace.
        let mut out = Vec::new();
        write_trace(&mut out, &[]).unwrap();
        serde_json::from_slice::<serde_json::Value>(&out).unwrap();
    }

    #[test]
    fn overlap_counts_collective_time_spent_computing() {
        let events = [
            // Compute 0..100 with a wait 60..80 inside it; the optimizer
            // 100..120.
            span(0, "compute", "forward", 0.0, 100.0),
            span(0, "compute", "layer", 10.0, 10.0),
            span(0, "comm", "gather", 60.0, 20.0),
            span(0, "optimizer", "optimizer", 100.0, 20.0),
            // Collectives: 50..90 (hidden 50..60 and 80..90) and 115..130
            // (hidden 115..120).
            span(0, "collective", "all_gather", 50.0, 40.0),
            span(0, "collective", "reduce_scatter", 115.0, 15.0),
            // Another rank's spans do not count.
            span(1, "collective", "all_gather", 0.0, 1000.0),
        ];
        let o = overlap(&events, 0);
        assert_eq!(o.collective_us, 55.0);
        assert_eq!(o.hidden_us, 25.0);
        assert_eq!(o.wait_us, 20.0);
        assert_eq!(o.fraction(), Some(25.0 / 55.0));
        assert_eq!(overlap(&events, 2).fraction(), None);
    }
}
