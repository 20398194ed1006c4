//! The stage-3 gather schedule: parameters gathered on demand, with
//! prefetch along the recorded order, reuse, persistence and a cap on live
//! parameters — decided here, as data, and executed twice: by the engine's
//! parameter gatherer (`src/engine/gatherer.rs`: buffers, all-gathers,
//! swap reads) and by the memory estimator ([`crate::estimate`]: the same
//! actions replayed against a memory tracker), so the two cannot drift.
//!
//! The first micro-batch records the order of `gather` calls (the trace).
//! From then on, a `gather` at trace position p also starts the
//! all-gathers of the units after p, up to `stage3_prefetch_bucket_size`
//! elements ahead, while the gathered total stays within
//! `stage3_max_live_parameters`:
//!
//! ```text
//!  trace:    e  b0  b1  b2  h  h  b2  b1  b0  e
//!  gather(b0) at p=1 ─▶ in flight: b1, b2 (window of 2 units' elements)
//!  release(b2) at p=4: next use at p=6, 2 units away ─▶ kept if within
//!                      stage3_max_reuse_distance elements, else freed
//! ```
//!
//! Units smaller than `stage3_param_persistence_threshold` elements stay
//! gathered for good (refreshed after each optimizer step). If a later
//! micro-batch gathers in another order (or stops early), prefetching stops
//! for the rest of that micro-batch with a warning naming the unit, and that
//! micro-batch's order becomes the trace for the next ones (counted in
//! `EngineStats::gather_order_changes`); results do not change, since a
//! prefetched unit holds the same values an on-demand gather would.
//! Every decision depends only on the trace and the call sequence, which
//! are the same on every rank, so all ranks issue the same collectives.
//!
//! [`Stage3Schedule`] holds no buffer, communicator or tracker: each call
//! appends what to do to an [`Actions`] (launch, refresh, wait for, free a
//! unit's gathered buffer; read a shard ahead from the swap file), with the
//! counters and the warning of that call.

use zero_core::config::{OffloadDevice, ResolvedConfig};
use zero_core::partition::UnitLayout;

/// With `offload_param.device = "nvme"`: how many units beyond the
/// prefetch window the parameter shards are read ahead from the swap file
/// (NVMe latency is longer than an all-gather's).
pub(crate) const NVME_EXTRA_AHEAD: usize = 2;

/// The knobs of the schedule (`zero_optimization` keys, in elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stage3Knobs {
    /// `stage3_prefetch_bucket_size`: how far ahead along the trace
    /// all-gathers start, counting the unit that crosses it (0: no
    /// prefetch).
    pub(crate) prefetch_bucket_size: usize,
    /// `stage3_max_live_parameters`: the cap on gathered elements that
    /// prefetch respects and on-demand gathers evict units kept for reuse
    /// to meet.
    pub(crate) max_live_parameters: usize,
    /// `stage3_max_reuse_distance`: a released unit is kept when its next
    /// use along the trace is at most this many elements away.
    pub(crate) max_reuse_distance: usize,
    /// `stage3_param_persistence_threshold`: units with fewer real elements
    /// stay gathered for good (0 below stage 3: none).
    pub(crate) param_persistence_threshold: usize,
    /// With `offload_param.device = "nvme"`: the units read ahead beyond
    /// the prefetch window ([`NVME_EXTRA_AHEAD`]); `None` otherwise.
    pub(crate) nvme_read_ahead: Option<usize>,
}

impl Stage3Knobs {
    /// The knobs of `cfg` (no unit is persistent below stage 3, and shards
    /// are read ahead only from a stage-3 parameter swap file).
    pub(crate) fn from_config(cfg: &ResolvedConfig) -> Stage3Knobs {
        let z = &cfg.zero;
        let stage3 = z.stage == 3;
        Stage3Knobs {
            prefetch_bucket_size: z.prefetch_bucket_size,
            max_live_parameters: z.max_live_parameters,
            max_reuse_distance: z.max_reuse_distance,
            param_persistence_threshold: if stage3 {
                z.param_persistence_threshold
            } else {
                0
            },
            nvme_read_ahead: (stage3 && z.offload_param.device == OffloadDevice::Nvme)
                .then_some(NVME_EXTRA_AHEAD),
        }
    }
}

/// One thing to do, in order, for the schedule's caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Take a buffer of the unit's padded size (a freed one of that size,
    /// else a new one) and start the unit's all-gather into it.
    Launch(usize),
    /// Start the all-gather of a gathered unit again, into its buffer (a
    /// persistent unit after an optimizer step): no new buffer.
    Refresh(usize),
    /// Wait for the unit's all-gather: its buffer is then readable.
    Wait(usize),
    /// Give the unit's gathered buffer back (to the pool of its size).
    Free(usize),
    /// nvme parameter offload: read the unit's shard ahead from the swap
    /// file. The `ReadAhead`s of one call are candidates in order: stop at
    /// the first one the staging buffers refuse.
    ReadAhead(usize),
}

/// What one call of the schedule decided: its actions, in order, and its
/// counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Actions {
    /// The actions, in order.
    pub(crate) list: Vec<Action>,
    /// All-gathers launched ahead of use.
    pub(crate) prefetches: u64,
    /// Gathers that found their (non-persistent) unit gathered or in
    /// flight.
    pub(crate) prefetch_hits: u64,
    /// Micro-batches that left the recorded order (or ended early), so
    /// that their order became the trace.
    pub(crate) order_changes: u64,
    /// A gather off the recorded order: the warning naming it.
    pub(crate) warning: Option<String>,
}

impl Actions {
    /// Empties the actions and counters, keeping the list's capacity (a
    /// caller reuses one `Actions` for every call).
    pub(crate) fn clear(&mut self) {
        self.list.clear();
        self.prefetches = 0;
        self.prefetch_hits = 0;
        self.order_changes = 0;
        self.warning = None;
    }
}

/// Where a unit's parameters are, as the schedule left them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Residency {
    /// Only this rank's shard.
    Sharded,
    /// All-gather launched, not yet waited for.
    InFlight,
    /// Gathered: the full unit is readable.
    Gathered,
}

/// One unit as the schedule sees it.
#[derive(Debug, Clone)]
struct Unit {
    name: String,
    /// Elements of the gathered buffer (padding included).
    padded: usize,
    persistent: bool,
    state: Residency,
    /// `gather`s not yet `release`d.
    in_use: usize,
    /// The release tick of the last release (least recently released
    /// goes first when room is made).
    released_at: u64,
}

/// The stage-3 gather schedule of one rank (see the module docs): the
/// trace, the position along it, which units are gathered or in flight,
/// how many elements that is, which are in use, and when each was last
/// released.
#[derive(Debug, Clone)]
pub(crate) struct Stage3Schedule {
    knobs: Stage3Knobs,
    units: Vec<Unit>,
    /// Elements gathered or being gathered.
    live: usize,
    /// The recorded order of gathers (after the first micro-batch).
    trace: Option<Vec<usize>>,
    /// The order of this micro-batch's gathers so far.
    recording: Vec<usize>,
    /// The position along the trace of the next gather.
    pos: usize,
    /// This micro-batch has followed the trace so far.
    on_track: bool,
    tick: u64,
}

impl Stage3Schedule {
    /// The schedule of units `layouts` (in registration order) under
    /// `knobs`, nothing gathered yet.
    pub(crate) fn new(knobs: Stage3Knobs, layouts: &[UnitLayout]) -> Stage3Schedule {
        let units = layouts
            .iter()
            .map(|l| Unit {
                name: l.name.clone(),
                padded: l.param_len(),
                persistent: l.total_numel() < knobs.param_persistence_threshold,
                state: Residency::Sharded,
                in_use: 0,
                released_at: 0,
            })
            .collect();
        Stage3Schedule {
            knobs,
            units,
            live: 0,
            trace: None,
            recording: Vec::new(),
            pos: 0,
            on_track: true,
            tick: 0,
        }
    }

    /// Elements gathered or being gathered (in use, kept for reuse,
    /// prefetched or persistent).
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// The trainer gathers unit `i`: record it, follow (or leave) the
    /// trace, launch it unless it is gathered or in flight (first freeing
    /// units kept for reuse until it fits under the live cap), prefetch
    /// along the trace, and wait for it.
    pub(crate) fn gather(&mut self, i: usize, out: &mut Actions) {
        self.recording.push(i);
        if let Some(trace) = &self.trace {
            if self.on_track {
                if trace.get(self.pos) == Some(&i) {
                    self.pos += 1;
                } else {
                    self.on_track = false;
                    let expected = trace
                        .get(self.pos)
                        .map_or("the end of the trace".to_string(), |&e| {
                            format!("`{}`", self.units[e].name)
                        });
                    out.warning = Some(format!(
                        "stage 3: gather(`{}`) at position {} differs from the recorded order \
                         (expected {expected}); prefetching is off for the rest of this micro-batch \
                         and the next micro-batch is recorded as the new order",
                        self.units[i].name, self.pos
                    ));
                }
            }
        }
        if !self.acquire(i, out) && !self.units[i].persistent {
            out.prefetch_hits += 1;
        }
        if self.on_track && self.trace.is_some() {
            self.prefetch(out);
        }
        self.wait(i, out);
        self.units[i].in_use += 1;
    }

    /// Launches unit `i` unless it is gathered or in flight, first freeing
    /// units kept for reuse until it fits under the live cap; whether it
    /// launched.
    fn acquire(&mut self, i: usize, out: &mut Actions) -> bool {
        if self.units[i].state != Residency::Sharded {
            return false;
        }
        self.make_room(self.units[i].padded, out);
        self.launch(i, out);
        true
    }

    /// Ends one use of unit `i`; whether it was the last use of a unit that
    /// is not persistent (then its release tick is set).
    fn end_use(&mut self, i: usize) -> bool {
        let u = &mut self.units[i];
        if u.in_use == 0 {
            return false;
        }
        u.in_use -= 1;
        if u.in_use > 0 || u.persistent {
            return false;
        }
        self.tick += 1;
        u.released_at = self.tick;
        true
    }

    /// The trainer releases unit `i` (a release without a gather does
    /// nothing). After its last use is released, a unit that is not
    /// persistent is kept if the trace uses it again within
    /// `stage3_max_reuse_distance` elements, else freed.
    pub(crate) fn release(&mut self, i: usize, out: &mut Actions) {
        if !self.end_use(i) {
            return;
        }
        let keep = match &self.trace {
            Some(trace) if self.on_track => {
                let rest = &trace[self.pos.min(trace.len())..];
                rest.iter().position(|&j| j == i).is_some_and(|k| {
                    let distance: usize = rest[..k].iter().map(|&j| self.units[j].padded).sum();
                    distance <= self.knobs.max_reuse_distance
                })
            }
            _ => false,
        };
        if !keep {
            self.free(i, out);
        }
    }

    /// An evaluation gather (forward only, `Engine::eval`): not recorded
    /// into the order, no position along it, no prefetch; the unit is
    /// launched unless it is gathered or in flight (a hit on what the step
    /// prefetched for training is fine: the values are the same).
    pub(crate) fn gather_eval(&mut self, i: usize, out: &mut Actions) {
        self.acquire(i, out);
        self.wait(i, out);
        self.units[i].in_use += 1;
    }

    /// An evaluation release: after its last use a unit that is not
    /// persistent is freed (evaluation has no order to reuse it along).
    pub(crate) fn release_eval(&mut self, i: usize, out: &mut Actions) {
        if self.end_use(i) {
            self.free(i, out);
        }
    }

    /// End of a micro-batch: fix the trace after the first one, finish
    /// prefetches nobody used, free what is not persistent.
    pub(crate) fn end_micro_batch(&mut self, out: &mut Actions) {
        // Keep the trace if this micro-batch followed it to the end;
        // otherwise this micro-batch's order becomes the trace (as
        // DeepSpeed re-records an invalidated trace).
        let recorded = std::mem::take(&mut self.recording);
        let followed = self.on_track && self.trace.as_ref().is_some_and(|t| t.len() == self.pos);
        if !followed {
            if self.trace.is_some() {
                out.order_changes += 1;
            }
            self.trace = Some(recorded);
        }
        self.pos = 0;
        self.on_track = true;
        for i in 0..self.units.len() {
            self.wait(i, out);
            if !self.units[i].persistent {
                self.free(i, out);
            }
        }
    }

    /// The end of a step: with a recorded order and prefetching on, start
    /// gathering what the next micro-batch gathers first (the prefetch
    /// window from the start of the order), so that its first gathers do
    /// not wait.
    pub(crate) fn prefetch_next(&mut self, out: &mut Actions) {
        if self.on_track && self.trace.is_some() {
            self.prefetch(out);
        }
    }

    /// With a recorded order and prefetching on: one past the highest unit
    /// index among the units the next micro-batch gathers first (those
    /// [`Stage3Schedule::prefetch_next`] starts), so that the optimizer
    /// step can start them as soon as AdamW has updated them.
    pub(crate) fn head(&self) -> Option<usize> {
        if !self.on_track {
            return None;
        }
        let trace = self.trace.as_ref()?;
        let window = self.knobs.prefetch_bucket_size;
        let mut ahead = 0;
        let mut last = None;
        for &j in trace {
            if ahead >= window {
                break;
            }
            ahead += self.units[j].padded;
            last = last.max(Some(j));
        }
        last.map(|j| j + 1)
    }

    /// Gathers (at the start) or refreshes (after an optimizer step) the
    /// persistent units, then waits for every all-gather in flight.
    pub(crate) fn gather_persistent(&mut self, out: &mut Actions) {
        for i in 0..self.units.len() {
            if self.units[i].persistent {
                self.launch(i, out);
            }
        }
        for i in 0..self.units.len() {
            self.wait(i, out);
        }
    }

    /// Starts the all-gather of unit `i`: into a new buffer, or into its
    /// own if it is gathered.
    fn launch(&mut self, i: usize, out: &mut Actions) {
        match self.units[i].state {
            Residency::Sharded => {
                self.live += self.units[i].padded;
                out.list.push(Action::Launch(i));
            }
            Residency::InFlight => {
                self.wait(i, out);
                out.list.push(Action::Refresh(i));
            }
            Residency::Gathered => out.list.push(Action::Refresh(i)),
        }
        self.units[i].state = Residency::InFlight;
    }

    fn wait(&mut self, i: usize, out: &mut Actions) {
        if self.units[i].state == Residency::InFlight {
            self.units[i].state = Residency::Gathered;
            out.list.push(Action::Wait(i));
        }
    }

    fn free(&mut self, i: usize, out: &mut Actions) {
        if self.units[i].state == Residency::Gathered {
            self.live -= self.units[i].padded;
            self.units[i].state = Residency::Sharded;
            out.list.push(Action::Free(i));
        }
    }

    /// Frees units kept for reuse, least recently released first, until
    /// `need` more elements fit under `stage3_max_live_parameters`.
    fn make_room(&mut self, need: usize, out: &mut Actions) {
        while self.live + need > self.knobs.max_live_parameters {
            let victim = (0..self.units.len())
                .filter(|&j| {
                    let u = &self.units[j];
                    u.state == Residency::Gathered && u.in_use == 0 && !u.persistent
                })
                .min_by_key(|&j| self.units[j].released_at);
            match victim {
                Some(j) => self.free(j, out),
                None => break,
            }
        }
    }

    /// Starts the all-gathers of the next units along the trace; with nvme
    /// parameter offload, the swap reads further ahead.
    fn prefetch(&mut self, out: &mut Actions) {
        // Taken out (and put back) so that launching can update the units.
        let Some(trace) = self.trace.take() else {
            return;
        };
        let window = self.knobs.prefetch_bucket_size;
        let mut ahead = 0;
        let rest = &trace[self.pos.min(trace.len())..];
        let mut covered = rest.len();
        // The units within `window` elements ahead, counting the one that
        // crosses it (so any window > 0 prefetches at least the next unit,
        // as DeepSpeed's prefetch_bucket_size; 0 turns prefetching off).
        for (k, &j) in rest.iter().enumerate() {
            let n = self.units[j].padded;
            if ahead >= window {
                covered = k;
                break;
            }
            ahead += n;
            if self.units[j].state != Residency::Sharded {
                continue;
            }
            if self.live + n > self.knobs.max_live_parameters {
                break;
            }
            self.launch(j, out);
            out.prefetches += 1;
        }
        // nvme parameter offload: the swap reads run further ahead than
        // the all-gathers (NVMe latency), within the staging buffers.
        if let Some(extra) = self.knobs.nvme_read_ahead {
            let reach = (covered + extra).min(rest.len());
            for &j in &rest[..reach] {
                if self.units[j].state == Residency::Sharded {
                    out.list.push(Action::ReadAhead(j));
                }
            }
        }
        self.trace = Some(trace);
    }
}

#[cfg(test)]
mod tests {
    use super::Action::{Free, Launch, ReadAhead, Refresh, Wait};
    use super::*;
    use zero_core::partition::{PartitionPlan, TensorSpec, UnitSpec};

    /// Knobs with everything unlimited and nothing persistent.
    fn knobs() -> Stage3Knobs {
        Stage3Knobs {
            prefetch_bucket_size: 0,
            max_live_parameters: usize::MAX,
            max_reuse_distance: 0,
            param_persistence_threshold: 0,
            nvme_read_ahead: None,
        }
    }

    /// Units `u0, u1, …` of `sizes` elements on one rank (sizes that are
    /// multiples of the shard alignment are not padded).
    fn schedule(knobs: Stage3Knobs, sizes: &[usize]) -> Stage3Schedule {
        let specs: Vec<UnitSpec> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| UnitSpec::new(format!("u{i}"), vec![TensorSpec::new("w", &[n])]))
            .collect();
        let plan = PartitionPlan::new(&specs, 1).expect("a valid plan");
        Stage3Schedule::new(knobs, plan.units())
    }

    /// Runs one call and returns its actions.
    fn call(s: &mut Stage3Schedule, f: impl FnOnce(&mut Stage3Schedule, &mut Actions)) -> Actions {
        let mut out = Actions::default();
        f(s, &mut out);
        out
    }

    /// One micro-batch that gathers and releases `order`, one unit at a
    /// time, then ends.
    fn micro_batch(s: &mut Stage3Schedule, order: &[usize]) -> Vec<Actions> {
        let mut all = Vec::new();
        for &i in order {
            all.push(call(s, |s, o| s.gather(i, o)));
            all.push(call(s, |s, o| s.release(i, o)));
        }
        all.push(call(s, |s, o| s.end_micro_batch(o)));
        all
    }

    /// A schedule whose first micro-batch recorded `order`.
    fn recorded(knobs: Stage3Knobs, sizes: &[usize], order: &[usize]) -> Stage3Schedule {
        let mut s = schedule(knobs, sizes);
        micro_batch(&mut s, order);
        s
    }

    const N: usize = 1024;

    #[test]
    fn first_micro_batch_gathers_on_demand_and_records() {
        let mut s = schedule(knobs(), &[N, N, N]);
        let g = call(&mut s, |s, o| s.gather(1, o));
        assert_eq!(g.list, vec![Launch(1), Wait(1)]);
        assert_eq!(s.live(), N);
        assert_eq!(call(&mut s, |s, o| s.release(1, o)).list, vec![Free(1)]);
        assert_eq!(s.live(), 0);
        assert_eq!(s.head(), None, "no recorded order yet");
        let end = call(&mut s, |s, o| s.end_micro_batch(o));
        assert_eq!(
            end,
            Actions::default(),
            "the first recording is no order change"
        );
        assert_eq!(s.trace.as_deref(), Some(&[1][..]));
    }

    #[test]
    fn evaluation_gathers_are_not_recorded_and_free_on_release() {
        let k = Stage3Knobs {
            prefetch_bucket_size: N,
            max_reuse_distance: usize::MAX,
            param_persistence_threshold: 10,
            ..knobs()
        };
        // u0 is persistent (fewer elements than the threshold).
        let mut s = recorded(k, &[8, N, N, N], &[0, 1, 2, 3]);
        s.gather_persistent(&mut Actions::default());
        let trace = s.trace.clone();
        // Evaluation in another order: no prefetch, no warning, no order
        // change, no position along the trace.
        let g = call(&mut s, |s, o| s.gather_eval(3, o));
        assert_eq!(g.list, vec![Launch(3), Wait(3)]);
        assert_eq!(g.warning, None);
        // Released: freed even though the trace (on track) would reuse it.
        assert_eq!(
            call(&mut s, |s, o| s.release_eval(3, o)).list,
            vec![Free(3)]
        );
        // A persistent unit stays.
        assert_eq!(call(&mut s, |s, o| s.gather_eval(0, o)).list, vec![]);
        assert_eq!(call(&mut s, |s, o| s.release_eval(0, o)).list, vec![]);
        assert_eq!(s.live(), s.units[0].padded, "only the persistent unit");
        assert_eq!(s.trace, trace);
        assert!(s.recording.is_empty() && s.pos == 0 && s.on_track);
        // Training then follows the recorded order with its prefetch.
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.list, vec![Launch(1)]);
        assert_eq!(g.warning, None);
    }

    #[test]
    fn prefetch_window_counts_the_unit_that_crosses_it() {
        // A window of 1.5 units: the next two units (the second crosses it).
        let k = Stage3Knobs {
            prefetch_bucket_size: N + N / 2,
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N, N], &[0, 1, 2, 3]);
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.list, vec![Launch(0), Launch(1), Launch(2), Wait(0)]);
        assert_eq!(g.prefetches, 2);
        assert_eq!(s.live(), 3 * N);
        // A window of exactly one unit: only the next one.
        let k = Stage3Knobs {
            prefetch_bucket_size: N,
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N, N], &[0, 1, 2, 3]);
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.list, vec![Launch(0), Launch(1), Wait(0)]);
        // The prefetched unit is a hit, and the window moves on.
        call(&mut s, |s, o| s.release(0, o));
        let g = call(&mut s, |s, o| s.gather(1, o));
        assert_eq!(g.list, vec![Launch(2), Wait(1)]);
        assert_eq!((g.prefetch_hits, g.prefetches), (1, 1));
    }

    #[test]
    fn window_zero_turns_prefetch_off() {
        let mut s = recorded(knobs(), &[N, N, N], &[0, 1, 2]);
        for i in 0..3 {
            let g = call(&mut s, |s, o| s.gather(i, o));
            assert_eq!(g.list, vec![Launch(i), Wait(i)]);
            assert_eq!((g.prefetches, g.prefetch_hits), (0, 0));
            call(&mut s, |s, o| s.release(i, o));
        }
        assert_eq!(s.head(), None, "an empty window has no head");
        assert!(call(&mut s, |s, o| s.prefetch_next(o)).list.is_empty());
    }

    #[test]
    fn prefetch_stops_at_the_live_cap() {
        let k = Stage3Knobs {
            prefetch_bucket_size: 3 * N,
            max_live_parameters: 2 * N,
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N, N], &[0, 1, 2, 3]);
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.list, vec![Launch(0), Launch(1), Wait(0)]);
        assert_eq!(s.live(), 2 * N);
        // Prefetch never evicts: nothing more starts.
        assert!(call(&mut s, |s, o| s.prefetch_next(o)).list.is_empty());
    }

    #[test]
    fn on_demand_gather_evicts_least_recently_released_first() {
        // Everything is kept for reuse (distance unlimited), two units fit.
        let k = Stage3Knobs {
            max_live_parameters: 2 * N,
            max_reuse_distance: usize::MAX,
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N], &[0, 1, 0, 1, 2]);
        for i in [0, 1] {
            call(&mut s, |s, o| s.gather(i, o));
        }
        // Released 1 first, then 0: unit 1 is the older one and goes.
        for i in [1, 0] {
            assert!(call(&mut s, |s, o| s.release(i, o)).list.is_empty());
        }
        let g = call(&mut s, |s, o| s.gather(2, o));
        assert_eq!(g.list, vec![Free(1), Launch(2), Wait(2)]);
        assert_eq!(s.live(), 2 * N);
        // Units in use are never evicted: with 2 in use and 0 kept, a
        // gather of 1 evicts 0; then, with 2 and 1 in use, a gather of 0
        // goes over the cap rather than evict either.
        let g = call(&mut s, |s, o| s.gather(1, o));
        assert_eq!(g.list, vec![Free(0), Launch(1), Wait(1)]);
        assert_eq!(s.live(), 2 * N);
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.list, vec![Launch(0), Wait(0)]);
        assert_eq!(s.live(), 3 * N);
    }

    #[test]
    fn reuse_distance_keeps_or_frees() {
        // Order 0 1 2 1: releasing 1 at position 2, its next use is one unit
        // (unit 2, 4N elements) away.
        let sizes = [N, N, 4 * N];
        let order = [0, 1, 2, 1];
        for (distance, kept) in [(4 * N, true), (4 * N - 1, false)] {
            let k = Stage3Knobs {
                max_reuse_distance: distance,
                ..knobs()
            };
            let mut s = recorded(k, &sizes, &order);
            for i in [0, 1] {
                call(&mut s, |s, o| s.gather(i, o));
            }
            let r = call(&mut s, |s, o| s.release(1, o));
            assert_eq!(r.list.is_empty(), kept, "distance {distance}");
            call(&mut s, |s, o| s.gather(2, o));
            let g = call(&mut s, |s, o| s.gather(1, o));
            if kept {
                assert_eq!((g.list.clone(), g.prefetch_hits), (vec![], 1));
            } else {
                assert_eq!(
                    (g.list.clone(), g.prefetch_hits),
                    (vec![Launch(1), Wait(1)], 0)
                );
            }
        }
        // A unit the trace does not use again is freed whatever the
        // distance.
        let k = Stage3Knobs {
            max_reuse_distance: usize::MAX,
            ..knobs()
        };
        let mut s = recorded(k, &sizes, &order);
        call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(call(&mut s, |s, o| s.release(0, o)).list, vec![Free(0)]);
    }

    #[test]
    fn nested_gathers_release_on_the_last() {
        let mut s = schedule(knobs(), &[N]);
        call(&mut s, |s, o| s.gather(0, o));
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert!(g.list.is_empty());
        assert!(call(&mut s, |s, o| s.release(0, o)).list.is_empty());
        assert_eq!(call(&mut s, |s, o| s.release(0, o)).list, vec![Free(0)]);
        assert!(call(&mut s, |s, o| s.release(0, o)).list.is_empty());
    }

    #[test]
    fn persistent_units_stay_gathered_and_are_refreshed() {
        // Unit 1 (100 real elements) is under the threshold, unit 0 is not.
        let k = Stage3Knobs {
            param_persistence_threshold: 101,
            ..knobs()
        };
        let mut s = schedule(k, &[N, 100]);
        assert!(!s.units[0].persistent && s.units[1].persistent);
        let padded1 = s.units[1].padded;
        let p = call(&mut s, |s, o| s.gather_persistent(o));
        assert_eq!(p.list, vec![Launch(1), Wait(1)]);
        let g = call(&mut s, |s, o| s.gather(1, o));
        assert_eq!((g.list.clone(), g.prefetch_hits), (vec![], 0), "not a hit");
        assert!(call(&mut s, |s, o| s.release(1, o)).list.is_empty());
        let end = call(&mut s, |s, o| s.end_micro_batch(o));
        assert!(end.list.is_empty(), "persistent units survive the end");
        assert_eq!(s.live(), padded1);
        // After a step: refreshed in place, no new buffer.
        let p = call(&mut s, |s, o| s.gather_persistent(o));
        assert_eq!(p.list, vec![Refresh(1), Wait(1)]);
        assert_eq!(s.live(), padded1);
        // The threshold compares real elements: 100 < 100 is false.
        let k = Stage3Knobs {
            param_persistence_threshold: 100,
            ..knobs()
        };
        assert!(!schedule(k, &[N, 100]).units[1].persistent);
    }

    #[test]
    fn persistent_units_are_never_evicted() {
        let k = Stage3Knobs {
            param_persistence_threshold: 101,
            max_live_parameters: 0,
            ..knobs()
        };
        let mut s = schedule(k, &[100, N]);
        call(&mut s, |s, o| s.gather_persistent(o));
        let g = call(&mut s, |s, o| s.gather(1, o));
        assert_eq!(g.list, vec![Launch(1), Wait(1)]);
    }

    #[test]
    fn order_change_warns_rerecords_and_counts() {
        let k = Stage3Knobs {
            prefetch_bucket_size: N,
            max_reuse_distance: usize::MAX,
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N], &[0, 1, 2]);
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.list, vec![Launch(0), Launch(1), Wait(0)]);
        assert_eq!(g.warning, None);
        // Off the order: a warning naming both units, and no prefetch.
        let g = call(&mut s, |s, o| s.gather(2, o));
        let w = g.warning.expect("a warning");
        assert!(w.contains("gather(`u2`) at position 1"), "{w}");
        assert!(w.contains("expected `u1`"), "{w}");
        assert_eq!(g.list, vec![Launch(2), Wait(2)]);
        assert_eq!(s.head(), None, "prefetching is off");
        // Off the order nothing is kept for reuse.
        for i in [0, 2] {
            assert_eq!(call(&mut s, |s, o| s.release(i, o)).list, vec![Free(i)]);
        }
        // The unused prefetch is finished and freed at the end; the order
        // of this micro-batch becomes the trace, counted once.
        let end = call(&mut s, |s, o| s.end_micro_batch(o));
        assert_eq!(end.list, vec![Wait(1), Free(1)]);
        assert_eq!(end.order_changes, 1);
        assert_eq!(s.trace.as_deref(), Some(&[0, 2][..]));
        // Following the new trace changes nothing.
        let all = micro_batch(&mut s, &[0, 2]);
        assert!(all
            .iter()
            .all(|a| a.warning.is_none() && a.order_changes == 0));
        assert_eq!(all[0].list, vec![Launch(0), Launch(2), Wait(0)]);
    }

    #[test]
    fn leaving_the_order_turns_prefetch_off() {
        let k = Stage3Knobs {
            prefetch_bucket_size: N,
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N], &[0, 1, 2]);
        // Unit 1 where unit 0 was expected: no prefetch of unit 0 (nor of
        // anything after it) for the rest of the micro-batch.
        let g = call(&mut s, |s, o| s.gather(1, o));
        assert!(g.warning.is_some());
        assert_eq!((g.list, g.prefetches), (vec![Launch(1), Wait(1)], 0));
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!((g.list, g.prefetches), (vec![Launch(0), Wait(0)], 0));
        assert!(call(&mut s, |s, o| s.prefetch_next(o)).list.is_empty());
    }

    #[test]
    fn early_end_rerecords_without_a_warning() {
        let mut s = recorded(knobs(), &[N, N, N], &[0, 1, 2]);
        let all = micro_batch(&mut s, &[0, 1]);
        assert!(all.iter().all(|a| a.warning.is_none()));
        assert_eq!(all.last().map(|a| a.order_changes), Some(1));
        assert_eq!(s.trace.as_deref(), Some(&[0, 1][..]));
        // One more unit than the trace: a warning ("the end of the trace").
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.warning, None);
        call(&mut s, |s, o| s.gather(1, o));
        let w = call(&mut s, |s, o| s.gather(2, o))
            .warning
            .expect("a warning");
        assert!(w.contains("expected the end of the trace"), "{w}");
    }

    #[test]
    fn head_is_one_past_the_highest_unit_of_the_first_window() {
        let k = Stage3Knobs {
            prefetch_bucket_size: 2 * N,
            ..knobs()
        };
        // The first window (two units, the second reaching 2N) is 3, 1.
        let s = recorded(k, &[N, N, N, N], &[3, 1, 0, 2]);
        assert_eq!(s.head(), Some(4));
        let s = recorded(k, &[N, N, N, N], &[1, 2, 3, 0]);
        assert_eq!(s.head(), Some(3));
        // prefetch_next launches exactly that window.
        let mut s = s;
        let p = call(&mut s, |s, o| s.prefetch_next(o));
        assert_eq!(p.list, vec![Launch(1), Launch(2)]);
        assert_eq!(p.prefetches, 2);
    }

    #[test]
    fn nvme_read_ahead_runs_past_the_window_skipping_gathered_units() {
        let k = Stage3Knobs {
            prefetch_bucket_size: N,
            nvme_read_ahead: Some(2),
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N, N, N], &[0, 1, 2, 3, 4]);
        let g = call(&mut s, |s, o| s.gather(0, o));
        // Window: unit 1; reads: the window's units not launched (none)
        // and two more.
        assert_eq!(
            g.list,
            vec![Launch(0), Launch(1), ReadAhead(2), ReadAhead(3), Wait(0)]
        );
        // Without nvme there are no reads.
        let k = Stage3Knobs {
            nvme_read_ahead: None,
            ..k
        };
        let mut s = recorded(k, &[N, N, N, N, N], &[0, 1, 2, 3, 4]);
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(g.list, vec![Launch(0), Launch(1), Wait(0)]);
        // A prefetch stopped by the live cap reads ahead the whole rest of
        // the trace (the window is not known to be covered).
        let k = Stage3Knobs {
            prefetch_bucket_size: 2 * N,
            max_live_parameters: N,
            nvme_read_ahead: Some(1),
            ..knobs()
        };
        let mut s = recorded(k, &[N, N, N, N, N], &[0, 1, 2, 3, 4]);
        let g = call(&mut s, |s, o| s.gather(0, o));
        assert_eq!(
            g.list,
            vec![
                Launch(0),
                ReadAhead(1),
                ReadAhead(2),
                ReadAhead(3),
                ReadAhead(4),
                Wait(0)
            ]
        );
    }

    #[test]
    fn knobs_from_config() {
        let mut cfg = ResolvedConfig::simple(3, 2, 1);
        cfg.zero.param_persistence_threshold = 7;
        cfg.zero.offload_param.device = OffloadDevice::Nvme;
        let k = Stage3Knobs::from_config(&cfg);
        assert_eq!(k.param_persistence_threshold, 7);
        assert_eq!(k.nvme_read_ahead, Some(NVME_EXTRA_AHEAD));
        cfg.zero.offload_param.device = OffloadDevice::Cpu;
        assert_eq!(Stage3Knobs::from_config(&cfg).nvme_read_ahead, None);
        cfg.zero.stage = 2;
        let k = Stage3Knobs::from_config(&cfg);
        assert_eq!(k.param_persistence_threshold, 0);
    }
}
