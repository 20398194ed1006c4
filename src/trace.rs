//! Span tracing to a Chrome trace (JSON), to see per rank how forward,
//! backward, gradient reductions, parameter gathers, the optimizer step and
//! offload traffic overlap. The file opens in [Perfetto](https://ui.perfetto.dev)
//! or `chrome://tracing`; each rank is one row (`tid` = rank, named
//! `rank N`).
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
//! | `gather` | `comm` | parameter all-gathers the rank waits for (stage 3 `gather`; after the step: stages 1–2, stage 3's persistent units) |
//! | `reduce` | `comm` | adding a gradient to a bucket, waiting for and storing reductions |
//! | `optimizer` | `optimizer` | norm, clipping and AdamW (offload write-back included) |
//! | `grad to host` | `offload` | storing a reduced gradient into the host shard (optimizer offload) |
//! | `adam tile` | `optimizer` | AdamW on one offloaded tile |
//! | `param copy-out` | `offload` | updated parameters of an offloaded tile back to the parameters |
//! | `swap read`, `swap write` | `offload` | waiting for a swap-file read or write |
//! | `param fetch` | `offload` | a parameter shard from its offload home into the gathered unit |
//! | `param write back` | `offload` | an updated parameter shard to its offload home (nvme without optimizer offload: the unit's AdamW included) |
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
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use zero_comm::Communicator;
use zero_core::{bf16, HostBuffer};

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
#[derive(Clone, Default)]
pub(crate) struct RankTracer {
    tracer: Tracer,
    rank: usize,
}

impl RankTracer {
    pub(crate) fn new(tracer: Tracer, rank: usize) -> Self {
        Self { tracer, rank }
    }

    /// [`Tracer::span`] of this rank.
    pub(crate) fn span(&self, name: &'static str, cat: &'static str) -> SpanGuard {
        self.tracer.span(self.rank, name, cat)
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
    pid: u32,
    tid: usize,
}

/// A metadata (`"ph": "M"`) entry: names a process or thread row.
#[derive(Serialize)]
struct Meta<'a> {
    name: &'static str,
    ph: &'static str,
    pid: u32,
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

/// Writes `events` to `path` as a Chrome trace:
/// `{"traceEvents": [...], "displayTimeUnit": "ms"}` with one complete
/// event (`"ph": "X"`, `ts` and `dur` in µs, `pid` 0, `tid` the rank) per
/// span, and metadata naming each rank's row `rank N`, in rank order.
pub fn write_chrome_trace(path: &Path, events: &[Event]) -> std::io::Result<()> {
    let mut w = BufWriter::new(File::create(path)?);
    write_trace(&mut w, events)?;
    w.flush()
}

fn write_trace<W: Write>(w: &mut W, events: &[Event]) -> std::io::Result<()> {
    let mut ranks: Vec<usize> = events.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    w.write_all(b"{\"traceEvents\":[\n")?;
    let mut first = true;
    let mut sep = |w: &mut W| -> std::io::Result<()> {
        if !std::mem::take(&mut first) {
            w.write_all(b",\n")?;
        }
        Ok(())
    };
    sep(w)?;
    serde_json::to_writer(
        &mut *w,
        &Meta {
            name: "process_name",
            ph: "M",
            pid: 0,
            tid: 0,
            args: MetaArgs {
                name: Some("zero"),
                sort_index: None,
            },
        },
    )?;
    for &r in &ranks {
        let label = format!("rank {r}");
        for (name, args) in [
            (
                "thread_name",
                MetaArgs {
                    name: Some(&label),
                    sort_index: None,
                },
            ),
            (
                "thread_sort_index",
                MetaArgs {
                    name: None,
                    sort_index: Some(r),
                },
            ),
        ] {
            sep(w)?;
            serde_json::to_writer(
                &mut *w,
                &Meta {
                    name,
                    ph: "M",
                    pid: 0,
                    tid: r,
                    args,
                },
            )?;
        }
    }
    for e in events {
        sep(w)?;
        serde_json::to_writer(
            &mut *w,
            &ChromeEvent {
                name: &e.name,
                cat: &e.cat,
                ph: "X",
                ts: e.ts_us,
                dur: e.dur_us.max(0.0),
                pid: 0,
                tid: e.rank,
            },
        )?;
    }
    w.write_all(b"\n],\"displayTimeUnit\":\"ms\"}\n")
}

/// Collects every rank's `events` on rank 0 (a collective: every rank
/// calls it at the same point). Returns `Some` of all events, rank 0's
/// first, on rank 0 and `None` on the others. For one process per rank
/// (MPI), where each rank has its own [`Tracer`]; with the threads backend
/// and one shared tracer, read [`Tracer::events`] instead (gathering
/// would duplicate the events).
pub fn gather_events<C: Communicator>(comm: &C, events: Vec<Event>) -> Result<Option<Vec<Event>>> {
    let world = comm.world_size();
    let rank = comm.rank();
    let bytes = encode(&events);
    drop(events);
    // Round 1: every rank's byte length; round 2: the bytes, padded to the
    // longest (all_gather takes the same count from every rank). Bytes
    // travel as bf16 bit patterns, which collectives copy exactly.
    let lens = crate::engine::exchange_words(comm, &[bytes.len() as u64])?;
    let lens: Vec<usize> = lens.iter().map(|w| w[0] as usize).collect();
    let n = lens.iter().copied().max().unwrap_or(0).div_ceil(2);
    if n == 0 {
        return Ok((rank == 0).then(Vec::new));
    }
    let send = HostBuffer::from_fn(n, |i| {
        let b = |k: usize| bytes.get(k).copied().unwrap_or(0);
        bf16::from_bits(u16::from_le_bytes([b(2 * i), b(2 * i + 1)]))
    })?;
    let recv = HostBuffer::<bf16>::zeros(n * world)?;
    let (_, recv) = comm.all_gather(send, recv, &vec![n; world]).wait()?;
    if rank != 0 {
        return Ok(None);
    }
    let mut all = Vec::new();
    let mut buf = Vec::with_capacity(2 * n);
    for (r, &len) in lens.iter().enumerate() {
        buf.clear();
        buf.extend(
            recv[r * n..(r + 1) * n]
                .iter()
                .flat_map(|x| x.to_bits().to_le_bytes()),
        );
        decode(&buf[..len], &mut all).ok_or_else(|| Error::Disagreement {
            rank,
            what: format!("gather_events: rank {r} sent {len} bytes that are not a trace (a different version of zero?)"),
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

    #[test]
    fn chrome_trace_is_json_with_named_rows() {
        let mut out = Vec::new();
        write_trace(&mut out, &[ev(1, "reduce", 10.0), ev(0, "gather", 5.0)]).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        let names: Vec<_> = evs
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(names, [(0, "rank 0"), (1, "rank 1")]);
        let x: Vec<_> = evs.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 2);
        assert_eq!(x[0]["tid"], 1);
        assert_eq!(x[0]["dur"], 1.5);
        assert_eq!(v["displayTimeUnit"], "ms");
        // No events: still a valid trace.
        let mut out = Vec::new();
        write_trace(&mut out, &[]).unwrap();
        serde_json::from_slice::<serde_json::Value>(&out).unwrap();
    }
}
