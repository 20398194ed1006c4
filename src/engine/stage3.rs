//! Stage 3: parameters gathered on demand, with prefetch along the
//! recorded order, reuse, persistence and a cap on live parameters.
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

use std::collections::HashMap;

use zero_comm::{Communicator, Work};
use zero_core::config::ResolvedConfig;
use zero_core::memory::{Allocation, Category, Tier};
use zero_core::partition::PartitionPlan;

use super::dynbuf::DynBuf;
use super::param_offload::{Fetch, NVME_EXTRA_AHEAD};
use super::{ring_bytes, Engine};
use crate::Result;

pub(crate) struct Stage3 {
    /// Gathered units (full, padded).
    pub(crate) full: Vec<Option<DynBuf>>,
    inflight: Vec<Option<Work<DynBuf>>>,
    persistent: Vec<bool>,
    /// Elements gathered or being gathered.
    pub(crate) live: usize,
    trace: Option<Vec<usize>>,
    recording: Vec<usize>,
    pos: usize,
    on_track: bool,
    pool: HashMap<usize, Vec<DynBuf>>,
    released_at: Vec<u64>,
    tick: u64,
    allocs: Vec<Allocation>,
}

impl Stage3 {
    pub(crate) fn new(cfg: &ResolvedConfig, plan: &PartitionPlan) -> Self {
        let n = plan.units().len();
        let persistent = plan
            .units()
            .iter()
            .map(|u| cfg.zero.stage == 3 && u.numel < cfg.zero.param_persistence_threshold)
            .collect();
        Self {
            full: (0..n).map(|_| None).collect(),
            inflight: (0..n).map(|_| None).collect(),
            persistent,
            live: 0,
            trace: None,
            recording: Vec::new(),
            pos: 0,
            on_track: true,
            pool: HashMap::new(),
            released_at: vec![0; n],
            tick: 0,
            allocs: Vec::new(),
        }
    }
}

impl<C: Communicator> Engine<C> {
    /// Starts the all-gather of unit `i` (into its resident buffer if it
    /// has one, as when refreshing a persistent unit).
    fn s3_launch(&mut self, i: usize) -> Result<()> {
        let l = &self.units[i].layout;
        let (padded, shard) = (l.padded_numel, l.shard_len);
        let mut buf = match self.s3.full[i].take() {
            Some(b) => b,
            None => {
                self.s3.live += padded;
                match self.s3.pool.get_mut(&padded).and_then(Vec::pop) {
                    Some(b) => b,
                    None => {
                        let b = DynBuf::alloc(&self.comm, self.pdt, padded)?;
                        self.s3.allocs.push(self.tracker.allocate(
                            Tier::Device,
                            Category::GatheredParams,
                            b.capacity_bytes(),
                        ));
                        b
                    }
                }
            }
        };
        match self.poff.as_mut() {
            // Parameter offload: host → the rank's slot of the gathered
            // (device-tier) buffer, or the swap read issued ahead.
            Some(po) => {
                self.stats.param_reads_ahead += u64::from(po.has_read(i));
                match po.load_into(i, &mut buf, self.rank * shard) {
                    Fetch::Read => self.stats.param_swap_reads += 1,
                    Fetch::Cached => self.stats.param_cache_hits += 1,
                    Fetch::Host => {}
                }
            }
            None => {
                let own = self.units[i].params.as_ref().expect("shards are home");
                buf.store_from(self.rank * shard, own, 0, shard, false);
            }
        }
        self.stats.peak_live_elems = self.stats.peak_live_elems.max(self.s3.live);
        self.stats.gather_bytes += ring_bytes(padded, self.world, self.pdt);
        self.s3.inflight[i] = Some(buf.all_gather(&self.comm, &vec![shard; self.world]));
        Ok(())
    }

    fn s3_wait(&mut self, i: usize) -> Result<()> {
        if let Some(w) = self.s3.inflight[i].take() {
            self.s3.full[i] = Some(super::wait_traced(&self.tracer, self.rank, w)?);
        }
        Ok(())
    }

    fn s3_free(&mut self, i: usize) {
        if let Some(b) = self.s3.full[i].take() {
            self.s3.live -= self.units[i].layout.padded_numel;
            self.s3.pool.entry(b.len()).or_default().push(b);
        }
    }

    /// Frees units kept for reuse, least recently released first, until
    /// `need` more elements fit under `stage3_max_live_parameters`.
    fn s3_make_room(&mut self, need: usize) {
        let max_live = self.cfg.zero.max_live_parameters;
        while self.s3.live + need > max_live {
            let victim = (0..self.units.len())
                .filter(|&j| {
                    self.s3.full[j].is_some()
                        && self.units[j].gathers == 0
                        && !self.s3.persistent[j]
                })
                .min_by_key(|&j| self.s3.released_at[j]);
            match victim {
                Some(j) => self.s3_free(j),
                None => break,
            }
        }
    }

    pub(super) fn s3_gather(&mut self, i: usize) -> Result<()> {
        self.s3.recording.push(i);
        if let Some(trace) = &self.s3.trace {
            if self.s3.on_track {
                if trace.get(self.s3.pos) == Some(&i) {
                    self.s3.pos += 1;
                } else {
                    self.s3.on_track = false;
                    let expected = trace
                        .get(self.s3.pos)
                        .map_or("the end of the trace".to_string(), |&e| {
                            format!("`{}`", self.units[e].layout.name)
                        });
                    let msg = format!(
                        "stage 3: gather(`{}`) at position {} differs from the recorded order \
                         (expected {expected}); prefetching is off for the rest of this micro-batch \
                         and the next micro-batch is recorded as the new order",
                        self.units[i].layout.name, self.s3.pos
                    );
                    self.warn(msg);
                }
            }
        }
        let resident = self.s3.full[i].is_some() || self.s3.inflight[i].is_some();
        if resident {
            if !self.s3.persistent[i] {
                self.stats.prefetch_hits += 1;
            }
        } else {
            self.s3_make_room(self.units[i].layout.padded_numel);
            self.s3_launch(i)?;
        }
        if self.s3.on_track && self.s3.trace.is_some() {
            self.s3_prefetch()?;
        }
        self.s3_wait(i)
    }

    /// With a recorded order and prefetching on: one past the highest unit
    /// index among the units the next micro-batch gathers first (those
    /// [`Engine::s3_prefetch`] starts from the beginning of the order), so
    /// that the step can start them as soon as AdamW has updated them.
    pub(super) fn s3_head(&self) -> Option<usize> {
        if self.stage != 3 || !self.s3.on_track {
            return None;
        }
        let trace = self.s3.trace.as_ref()?;
        let window = self.cfg.zero.prefetch_bucket_size;
        let mut ahead = 0;
        let mut last = None;
        for &j in trace {
            if ahead >= window {
                break;
            }
            ahead += self.units[j].layout.padded_numel;
            last = last.max(Some(j));
        }
        last.map(|j| j + 1)
    }

    /// The end of `step`: start gathering what the next micro-batch
    /// gathers first (the prefetch window from the start of the recorded
    /// order), so that its first gathers do not wait.
    pub(super) fn s3_prefetch_next(&mut self) -> Result<()> {
        if self.s3.on_track && self.s3.trace.is_some() {
            self.s3_prefetch()?;
        }
        Ok(())
    }

    /// Starts the all-gathers of the next units along the trace.
    pub(super) fn s3_prefetch(&mut self) -> Result<()> {
        let window = self.cfg.zero.prefetch_bucket_size;
        let max_live = self.cfg.zero.max_live_parameters;
        let Some(trace) = self.s3.trace.clone() else {
            return Ok(());
        };
        let mut ahead = 0;
        let rest = &trace[self.s3.pos.min(trace.len())..];
        let mut covered = rest.len();
        // The units within `window` elements ahead, counting the one that
        // crosses it (so any window > 0 prefetches at least the next unit,
        // as DeepSpeed's prefetch_bucket_size; 0 turns prefetching off).
        for (k, &j) in rest.iter().enumerate() {
            let n = self.units[j].layout.padded_numel;
            if ahead >= window {
                covered = k;
                break;
            }
            ahead += n;
            if self.s3.full[j].is_some() || self.s3.inflight[j].is_some() {
                continue;
            }
            if self.s3.live + n > max_live {
                break;
            }
            self.s3_launch(j)?;
            self.stats.prefetches += 1;
        }
        // nvme parameter offload: the swap reads run further ahead than
        // the all-gathers (NVMe latency), within the staging buffers.
        if let Some(po) = self.poff.as_mut().filter(|p| p.is_nvme()) {
            let reach = (covered + NVME_EXTRA_AHEAD).min(rest.len());
            for &j in &rest[..reach] {
                if self.s3.full[j].is_some() || self.s3.inflight[j].is_some() {
                    continue;
                }
                if !po.read_ahead(j) {
                    break;
                }
            }
        }
        Ok(())
    }

    pub(super) fn s3_release(&mut self, i: usize) -> Result<()> {
        if self.s3.persistent[i] {
            return Ok(());
        }
        self.s3.tick += 1;
        self.s3.released_at[i] = self.s3.tick;
        let keep = match &self.s3.trace {
            Some(trace) if self.s3.on_track => {
                let rest = &trace[self.s3.pos.min(trace.len())..];
                rest.iter().position(|&j| j == i).is_some_and(|k| {
                    let distance: usize = rest[..k]
                        .iter()
                        .map(|&j| self.units[j].layout.padded_numel)
                        .sum();
                    distance <= self.cfg.zero.max_reuse_distance
                })
            }
            _ => false,
        };
        if !keep {
            self.s3_free(i);
        }
        Ok(())
    }

    /// End of a micro-batch: fix the trace after the first one, finish
    /// prefetches nobody used, free what is not persistent.
    pub(super) fn s3_end_micro_batch(&mut self) -> Result<()> {
        // Keep the trace if this micro-batch followed it to the end;
        // otherwise this micro-batch's order becomes the trace (as
        // DeepSpeed re-records an invalidated trace).
        let recorded = std::mem::take(&mut self.s3.recording);
        let followed = self.s3.on_track
            && self
                .s3
                .trace
                .as_ref()
                .is_some_and(|t| t.len() == self.s3.pos);
        if !followed {
            if self.s3.trace.is_some() {
                self.stats.gather_order_changes += 1;
            }
            self.s3.trace = Some(recorded);
        }
        self.s3.pos = 0;
        self.s3.on_track = true;
        if let Some(po) = self.poff.as_mut() {
            po.drain_reads();
        }
        for i in 0..self.units.len() {
            self.s3_wait(i)?;
            if !self.s3.persistent[i] {
                self.s3_free(i);
            }
        }
        Ok(())
    }

    /// Gathers (or refreshes, after a step) the persistent units.
    pub(super) fn gather_persistent(&mut self) -> Result<()> {
        for i in 0..self.units.len() {
            if self.s3.persistent[i] {
                self.s3_launch(i)?;
            }
        }
        for i in 0..self.units.len() {
            self.s3_wait(i)?;
        }
        Ok(())
    }
}
