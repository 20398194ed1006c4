//! The hazard checker: vector clocks per agent and the unordered accesses
//! of every buffer. Pure logic; the CPU backend drives it.
//!
//! Each agent (four streams and the host) keeps a vector clock with one
//! entry per agent. Enqueuing an operation on stream `s` joins the host's
//! clock into `s`'s (the host's earlier actions are ordered before it) and
//! ticks `s`'s own entry; the operation's accesses carry that tick. A host
//! access ticks the host's entry. An event is a copy of a stream's clock;
//! waiting joins it into another stream's clock, syncing into the host's.
//!
//! An earlier access `a` (agent `Y`, tick `t`) is ordered before a new
//! access on agent `X` with clock `C` when `X == Y` or `C[Y] >= t`. A new
//! access conflicts with `a` when their ranges overlap, at least one writes,
//! and `a` is not ordered before it.
//!
//! Per buffer only the accesses that may still conflict are kept:
//!
//! - once the host's clock covers an access, every later access (host or
//!   stream, which joins the host's clock when enqueued) is ordered after
//!   it: it is dropped (host accesses are thus never kept);
//! - an access `a` ordered before a new access `b` whose range covers `a`'s
//!   is dropped when `b` writes or `a` only reads: whatever conflicts with
//!   `a` then conflicts with `b`, and being ordered after `b` implies being
//!   ordered after `a`.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use super::{AccessKind, Agent, BufferId, Hazard, Stream};
use crate::{Error, Result};

const HOST: usize = 4;

/// One entry per agent: operations (or host accesses) issued so far, and
/// how far each other agent is known to be ordered before this one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Clock(pub(crate) [u64; Agent::COUNT]);

impl Clock {
    /// The entry-wise maximum.
    pub(crate) fn join(&mut self, other: &Clock) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a = (*a).max(b);
        }
    }
}

/// One declared access of an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decl {
    pub(crate) id: BufferId,
    pub(crate) range: Range<usize>,
    pub(crate) kind: AccessKind,
}

/// An access that may still conflict with a later one.
#[derive(Debug, Clone)]
struct Record {
    agent: Agent,
    tick: u64,
    /// The position of the operation on its stream's queue (Chaos mode:
    /// work items enqueued before it, plus one), for waiting until it ran.
    seq: u64,
    range: Range<usize>,
    kind: AccessKind,
    op: &'static str,
}

struct Tracked {
    label: Arc<str>,
    len: usize,
    records: Vec<Record>,
}

/// The clocks of the five agents and the unordered accesses of every live
/// buffer.
pub(crate) struct Checker {
    clocks: [Clock; Agent::COUNT],
    buffers: HashMap<BufferId, Tracked>,
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

fn covers(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

impl Checker {
    pub(crate) fn new() -> Self {
        Checker {
            clocks: [Clock::default(); Agent::COUNT],
            buffers: HashMap::new(),
        }
    }

    /// Starts tracking a buffer of `len` elements.
    pub(crate) fn register(&mut self, id: BufferId, label: Arc<str>, len: usize) {
        self.buffers.insert(
            id,
            Tracked {
                label,
                len,
                records: Vec::new(),
            },
        );
    }

    /// Stops tracking `id`; returns, per stream, the queue position of its
    /// last access that may still be pending (0: none).
    pub(crate) fn forget(&mut self, id: BufferId) -> [u64; 4] {
        let pending = self.pending(id);
        self.buffers.remove(&id);
        pending
    }

    /// Per stream, the queue position of the last kept access to `id` (0:
    /// none). Once each stream has run that far, no work that touches the
    /// buffer is pending: every dropped access was ordered before a kept
    /// one or synced by the host.
    pub(crate) fn pending(&self, id: BufferId) -> [u64; 4] {
        let mut out = [0u64; 4];
        if let Some(t) = self.buffers.get(&id) {
            for r in &t.records {
                if let Agent::Stream(s) = r.agent {
                    out[s.index()] = out[s.index()].max(r.seq);
                }
            }
        }
        out
    }

    /// The clock an event recorded now on `stream` carries.
    pub(crate) fn record(&self, stream: Stream) -> Clock {
        let mut c = self.clocks[stream.index()];
        c.join(&self.clocks[HOST]);
        c
    }

    /// `stream` waits for an event with clock `event`.
    pub(crate) fn wait(&mut self, stream: Stream, event: &Clock) {
        self.clocks[stream.index()].join(event);
    }

    /// The host waits for an event with clock `event`.
    pub(crate) fn sync(&mut self, event: &Clock) {
        self.clocks[HOST].join(event);
        self.prune_synced();
    }

    /// The host waits for every stream.
    pub(crate) fn sync_all(&mut self) {
        for s in 0..4 {
            let c = self.clocks[s];
            self.clocks[HOST].join(&c);
        }
        self.prune_synced();
    }

    /// Checks and records operation `op` on `stream`, at queue position
    /// `seq`. On a conflict nothing changes and the hazard is returned.
    pub(crate) fn enqueue(
        &mut self,
        stream: Stream,
        op: &'static str,
        decls: &[Decl],
        seq: u64,
    ) -> Result<()> {
        let s = stream.index();
        let mut clock = self.clocks[s];
        clock.join(&self.clocks[HOST]);
        clock.0[s] += 1;
        let agent = Agent::Stream(stream);
        self.check(agent, &clock, op, decls)?;
        self.clocks[s] = clock;
        self.commit(agent, &clock, op, decls, seq);
        Ok(())
    }

    /// Checks and records a host access.
    pub(crate) fn host(&mut self, op: &'static str, decls: &[Decl]) -> Result<()> {
        let mut clock = self.clocks[HOST];
        clock.0[HOST] += 1;
        self.check(Agent::Host, &clock, op, decls)?;
        self.clocks[HOST] = clock;
        self.commit(Agent::Host, &clock, op, decls, 0);
        Ok(())
    }

    fn check(&self, agent: Agent, clock: &Clock, op: &'static str, decls: &[Decl]) -> Result<()> {
        for (i, d) in decls.iter().enumerate() {
            let t = self.buffers.get(&d.id).ok_or_else(|| Error::Backend {
                op,
                msg: format!(
                    "buffer {} is not a live buffer of this backend (freed, lent, or another backend's)",
                    d.id
                ),
            })?;
            if d.range.end > t.len || d.range.start > d.range.end {
                return Err(Error::InvalidSize {
                    op,
                    msg: format!(
                        "range [{}..{}) of buffer {:?} ({}) outside its {} elements",
                        d.range.start, d.range.end, t.label, d.id, t.len
                    ),
                });
            }
            let hazard = |other_agent, other_op, other_access, other_range: &Range<usize>| {
                Error::Hazard(Box::new(Hazard {
                    buffer: t.label.to_string(),
                    id: d.id,
                    range: d.range.clone(),
                    op,
                    agent,
                    access: d.kind,
                    other_op,
                    other_agent,
                    other_access,
                    other_range: other_range.clone(),
                }))
            };
            // Two accesses of one operation to one buffer run concurrently
            // (e.g. the threads of a kernel): they must not conflict.
            for e in &decls[..i] {
                if e.id == d.id
                    && overlaps(&e.range, &d.range)
                    && (e.kind == AccessKind::Write || d.kind == AccessKind::Write)
                {
                    return Err(hazard(agent, op, e.kind, &e.range));
                }
            }
            for r in &t.records {
                let ordered = r.agent == agent || clock.0[r.agent.index()] >= r.tick;
                if !ordered
                    && overlaps(&r.range, &d.range)
                    && (r.kind == AccessKind::Write || d.kind == AccessKind::Write)
                {
                    return Err(hazard(r.agent, r.op, r.kind, &r.range));
                }
            }
        }
        Ok(())
    }

    fn commit(&mut self, agent: Agent, clock: &Clock, op: &'static str, decls: &[Decl], seq: u64) {
        let host = self.clocks[HOST];
        let tick = clock.0[agent.index()];
        for d in decls {
            let Some(t) = self.buffers.get_mut(&d.id) else {
                continue;
            };
            t.records.retain(|r| {
                let synced = host.0[r.agent.index()] >= r.tick;
                let ordered = r.agent == agent || clock.0[r.agent.index()] >= r.tick;
                let covered = ordered
                    && covers(&d.range, &r.range)
                    && (d.kind == AccessKind::Write || r.kind == AccessKind::Read);
                !synced && !covered
            });
            if host.0[agent.index()] < tick && !d.range.is_empty() {
                t.records.push(Record {
                    agent,
                    tick,
                    seq,
                    range: d.range.clone(),
                    kind: d.kind,
                    op,
                });
            }
        }
    }

    fn prune_synced(&mut self) {
        let host = self.clocks[HOST];
        for t in self.buffers.values_mut() {
            t.records.retain(|r| host.0[r.agent.index()] < r.tick);
        }
    }

    /// Accesses kept for `id` (tests: pruning keeps memory bounded).
    #[cfg(test)]
    fn kept(&self, id: BufferId) -> usize {
        self.buffers.get(&id).map_or(0, |t| t.records.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const B: BufferId = BufferId(1);

    fn decl(range: Range<usize>, kind: AccessKind) -> Decl {
        Decl { id: B, range, kind }
    }

    fn checker() -> Checker {
        let mut c = Checker::new();
        c.register(B, "bucket 0".into(), 100);
        c
    }

    use AccessKind::{Read, Write};
    use Stream::{Comm, Compute, DeviceToHost, HostToDevice};

    #[test]
    fn missing_wait_is_a_hazard_naming_both_sides() {
        let mut c = checker();
        c.enqueue(Compute, "pack", &[decl(0..50, Write)], 1)
            .unwrap();
        let e = c
            .enqueue(Comm, "all_reduce", &[decl(0..100, Write)], 1)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "hazard on buffer \"bucket 0\" (#1) [0..100): all_reduce on comm writes while \
             pack on compute (not waited for) writes [0..50)"
        );
        // Refused: nothing recorded, the clock did not move.
        assert_eq!(c.kept(B), 1);
        let ev = c.record(Compute);
        c.wait(Comm, &ev);
        c.enqueue(Comm, "all_reduce", &[decl(0..100, Write)], 1)
            .unwrap();
        // The pack is covered by the ordered all-reduce.
        assert_eq!(c.kept(B), 1);
    }

    #[test]
    fn read_read_and_disjoint_ranges_never_conflict() {
        let mut c = checker();
        c.enqueue(Compute, "a", &[decl(0..100, Read)], 1).unwrap();
        c.enqueue(Comm, "b", &[decl(0..100, Read)], 1).unwrap();
        c.enqueue(HostToDevice, "c", &[decl(0..10, Write)], 1)
            .unwrap_err();
        let mut c = checker();
        c.enqueue(Compute, "a", &[decl(0..50, Write)], 1).unwrap();
        c.enqueue(Comm, "b", &[decl(50..100, Write)], 1).unwrap();
        c.enqueue(DeviceToHost, "c", &[decl(50..51, Read)], 1)
            .unwrap_err();
    }

    #[test]
    fn host_reads_need_a_sync_not_a_wait() {
        let mut c = checker();
        c.enqueue(DeviceToHost, "copy_d2h", &[decl(0..100, Write)], 1)
            .unwrap();
        let e = c.host("read_host", &[decl(3..4, Read)]).unwrap_err();
        assert!(e
            .to_string()
            .contains("read_host on host reads while copy_d2h on d2h (not synced) writes"));
        let ev = c.record(DeviceToHost);
        c.wait(Compute, &ev);
        c.host("read_host", &[decl(3..4, Read)]).unwrap_err();
        c.sync(&ev);
        c.host("read_host", &[decl(3..4, Read)]).unwrap();
        assert_eq!(c.kept(B), 0);
    }

    #[test]
    fn host_writes_are_ordered_before_later_enqueues() {
        let mut c = checker();
        c.host("write_host", &[decl(0..100, Write)]).unwrap();
        c.enqueue(HostToDevice, "copy_h2d", &[decl(0..100, Read)], 1)
            .unwrap();
        // ... but a host write after an unsynced read is not.
        c.host("write_host", &[decl(0..100, Write)]).unwrap_err();
    }

    #[test]
    fn ordering_is_transitive_through_events() {
        let mut c = checker();
        c.enqueue(HostToDevice, "upload", &[decl(0..100, Write)], 1)
            .unwrap();
        let e1 = c.record(HostToDevice);
        c.wait(Compute, &e1);
        c.enqueue(Compute, "other", &[], 1).unwrap();
        let e2 = c.record(Compute);
        c.wait(Comm, &e2);
        c.enqueue(Comm, "read", &[decl(0..100, Read)], 1).unwrap();
        // An event recorded before the wait does not order.
        let mut c = checker();
        let early = c.record(Compute);
        c.enqueue(HostToDevice, "upload", &[decl(0..100, Write)], 1)
            .unwrap();
        c.wait(Compute, &early);
        c.enqueue(Compute, "read", &[decl(0..1, Read)], 1)
            .unwrap_err();
    }

    #[test]
    fn one_operation_may_not_write_what_it_also_touches() {
        let mut c = checker();
        let e = c
            .enqueue(
                Compute,
                "pack",
                &[decl(0..10, Write), decl(5..15, Write)],
                1,
            )
            .unwrap_err();
        assert!(e
            .to_string()
            .contains("pack on compute writes while pack on compute"));
        c.enqueue(
            Compute,
            "unpack",
            &[decl(0..10, Read), decl(5..15, Read)],
            1,
        )
        .unwrap();
    }

    #[test]
    fn unknown_buffers_and_bad_ranges_are_errors() {
        let mut c = checker();
        let e = c
            .enqueue(
                Compute,
                "fill",
                &[Decl {
                    id: BufferId(9),
                    range: 0..1,
                    kind: Write,
                }],
                1,
            )
            .unwrap_err();
        assert!(matches!(e, Error::Backend { op: "fill", .. }), "{e}");
        let e = c
            .enqueue(Compute, "fill", &[decl(90..101, Write)], 1)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidSize { op: "fill", .. }), "{e}");
    }

    #[test]
    fn pending_tracks_the_last_unordered_access_per_stream() {
        let mut c = checker();
        c.enqueue(Compute, "a", &[decl(0..10, Read)], 3).unwrap();
        c.enqueue(Comm, "b", &[decl(20..30, Write)], 5).unwrap();
        assert_eq!(c.pending(B), [3, 5, 0, 0]);
        c.sync_all();
        assert_eq!(c.pending(B), [0; 4]);
        assert_eq!(c.forget(B), [0; 4]);
        assert!(c.host("x", &[decl(0..1, Read)]).is_err());
    }

    // -----------------------------------------------------------------
    // Property: the pruned checker gives the verdict of a brute-force
    // happens-before oracle (reachability in the graph of every operation,
    // event, wait and sync) on random programs.
    // -----------------------------------------------------------------

    #[derive(Debug, Clone)]
    enum Step {
        Op(usize, Range<usize>, bool),
        Host(Range<usize>, bool),
        Record(usize),
        Wait(usize, usize),
        Sync(usize),
        SyncAll,
    }

    fn step() -> impl Strategy<Value = Step> {
        let range = (0usize..8, 1usize..5).prop_map(|(a, n)| a..(a + n).min(10));
        prop_oneof![
            4 => (0usize..4, range.clone(), any::<bool>()).prop_map(|(s, r, w)| Step::Op(s, r, w)),
            1 => (range, any::<bool>()).prop_map(|(r, w)| Step::Host(r, w)),
            2 => (0usize..4).prop_map(Step::Record),
            2 => (0usize..4, 0usize..16).prop_map(|(s, e)| Step::Wait(s, e)),
            1 => (0usize..16).prop_map(Step::Sync),
            1 => Just(Step::SyncAll),
        ]
    }

    /// The oracle: every operation, wait and sync is a node with explicit
    /// predecessor edges; an access is ordered after another when that one's
    /// node reaches it.
    #[derive(Default)]
    struct Oracle {
        preds: Vec<Vec<usize>>,
        last: [Option<usize>; 5],
        /// (node, range, write) of every access that was accepted.
        accesses: Vec<(usize, Range<usize>, bool)>,
    }

    impl Oracle {
        fn node(&mut self, agent: usize, extra: &[usize]) -> usize {
            let mut preds = extra.to_vec();
            preds.extend(self.last[agent]);
            if agent != HOST {
                preds.extend(self.last[HOST]);
            }
            self.preds.push(preds);
            let n = self.preds.len() - 1;
            self.last[agent] = Some(n);
            n
        }

        fn reaches(&self, from: usize, to: usize) -> bool {
            let mut stack = vec![to];
            let mut seen = vec![false; self.preds.len()];
            while let Some(n) = stack.pop() {
                if n == from {
                    return true;
                }
                if !std::mem::replace(&mut seen[n], true) {
                    stack.extend(&self.preds[n]);
                }
            }
            false
        }

        /// Adds the access unless it conflicts; returns whether it did.
        fn access(&mut self, agent: usize, range: Range<usize>, write: bool) -> bool {
            let before = self.last[agent];
            let n = self.node(agent, &[]);
            let bad = self
                .accesses
                .iter()
                .any(|(m, r, w)| overlaps(r, &range) && (*w || write) && !self.reaches(*m, n));
            if bad {
                self.preds.pop();
                self.last[agent] = before;
            } else {
                self.accesses.push((n, range, write));
            }
            bad
        }

        fn event(&self, s: usize) -> Vec<usize> {
            self.last[s].into_iter().chain(self.last[HOST]).collect()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        #[test]
        fn checker_matches_a_happens_before_oracle(steps in prop::collection::vec(step(), 1..48)) {
            let mut c = checker();
            let mut o = Oracle::default();
            let mut events: Vec<(Clock, Vec<usize>)> = Vec::new();
            let kind = |w: bool| if w { Write } else { Read };
            for st in steps {
                match st {
                    Step::Op(s, r, w) => {
                        let got = c.enqueue(Stream::ALL[s], "op", &[decl(r.clone(), kind(w))], 1);
                        let refused = o.access(s, r, w);
                        prop_assert_eq!(got.is_err(), refused);
                        if let Err(e) = got {
                            prop_assert!(matches!(e, Error::Hazard(_)), "{}", e);
                        }
                    }
                    Step::Host(r, w) => {
                        let got = c.host("host", &[decl(r.clone(), kind(w))]);
                        prop_assert_eq!(got.is_err(), o.access(HOST, r, w));
                    }
                    Step::Record(s) => events.push((c.record(Stream::ALL[s]), o.event(s))),
                    Step::Wait(s, e) => {
                        if let Some((clock, nodes)) = events.get(e) {
                            c.wait(Stream::ALL[s], clock);
                            o.node(s, nodes);
                        }
                    }
                    Step::Sync(e) => {
                        if let Some((clock, nodes)) = events.get(e) {
                            c.sync(clock);
                            o.node(HOST, nodes);
                        }
                    }
                    Step::SyncAll => {
                        c.sync_all();
                        let all: Vec<usize> = o.last[..4].iter().flatten().copied().collect();
                        o.node(HOST, &all);
                    }
                }
                // Pruning keeps the records bounded by what is unsynced.
                prop_assert!(c.kept(B) <= o.accesses.len());
            }
        }
    }
}
