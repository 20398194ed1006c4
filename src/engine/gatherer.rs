//! Stage 3: the parameter gatherer. It owns the gathered units' buffers
//! (in use, kept for reuse, prefetched, persistent), the all-gathers in
//! flight, the pool of freed buffers per size and their tracker
//! accounting, and executes what the pure [`Stage3Schedule`] decides
//! (`src/schedule.rs`: prefetch along the recorded order, reuse,
//! persistence, the live cap; the estimator replays the same schedule).
//!
//! Whatever it needs from the engine comes in with each call as a
//! [`GatherIo`]: the communicator, the memory tracker, the tracer, the
//! parameter dtype, where this rank's shards live (the engine's units, or
//! the parameter offload) and the stats to count into.
//!
//! ```text
//!  trainer ─▶ Engine ─▶ ParamGatherer::gather(i, io)
//!                         │ Stage3Schedule::gather(i) ─▶ [Free(k), Launch(i),
//!                         │                               Launch(j), ReadAhead(m), Wait(i)]
//!                         └ executes: pool / tracker, shard ─▶ slot, all-gather,
//!                           swap read ahead, wait
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use zero_core::backend::{HostAccess, Stream};
use zero_core::config::ResolvedConfig;
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero_core::partition::PartitionPlan;
use zero_core::DType;

use super::backend::EngineComm;
use super::ctx::Ctx;
use super::devbuf::{DevBuf, DynHost, DynWork};
use super::dynbuf::ring_bytes;
use super::lease::exclusive;
use super::param_offload::{Fetch, ParamOffload};
use super::stats::EngineStats;
use crate::schedule::{Action, Actions, Stage3Knobs, Stage3Schedule};
use crate::trace::Tracer;
use crate::{Error, Result};

/// Where stage 3 keeps one unit's frozen segment
/// (`zero_optimization.frozen_params`).
pub(crate) enum FrozenHome<B: HostAccess> {
    /// The unit's own gathered buffer (trainable segment, then the whole
    /// frozen segment, filled once), on every rank: a gather all-gathers
    /// only the trainable segment into it, and a free keeps it here
    /// (`None` while it is gathered or in flight).
    Resident(Option<DevBuf<B>>),
    /// This rank's shard on the device: all-gathered with the unit into a
    /// buffer of the frozen segment's own, which the unit's guards read
    /// where it landed (`UnitGuard::frozen_buffer`).
    Shard(DevBuf<B>),
    /// This rank's shard in host memory (the parameter dtype's bytes):
    /// copied into the rank's slot of the frozen segment's buffer, then
    /// all-gathered with the unit as [`FrozenHome::Shard`].
    Host(Vec<u8>),
}

/// This rank's parameter shards where they stay on the device tier (no
/// parameter offload): the engine's units.
pub(crate) trait HomeShards<B: HostAccess> {
    /// Unit `unit`'s shard (padding included).
    fn shard(&self, unit: usize) -> &DevBuf<B>;
}

/// Where a launched unit's shard is copied from.
pub(crate) enum Shards<'a, B: HostAccess> {
    /// The engine's own shards.
    Home(&'a dyn HomeShards<B>),
    /// `offload_param`: host homes or the swap file (with reads ahead).
    Offloaded(&'a mut ParamOffload),
}

/// What the gatherer needs from the engine for one call.
pub(crate) struct GatherIo<'a, C: EngineComm<B>, B: HostAccess> {
    /// The device the gathered buffers and the shards live on, the stream
    /// an all-gather starts after, the communicator the all-gathers run on
    /// (and buffers come from), the tracker of new gathered buffers
    /// (`GatheredParams`, device tier), the tracer of the waited
    /// all-gathers and the parameter dtype.
    pub(crate) cx: &'a Ctx<C, B>,
    /// Where the shards are.
    pub(crate) shards: Shards<'a, B>,
    /// Counts gathers, prefetches, hits, order changes, swap reads and the
    /// live peak.
    pub(crate) stats: &'a mut EngineStats,
}

/// On a device backend, the host buffers (pinned on a GPU) that offloaded
/// shards go up through, in turn, each with the event after its last
/// upload.
struct Uploads<B: HostAccess> {
    ring: Vec<(DynHost<B>, Option<B::Event>)>,
    next: usize,
}

impl<B: HostAccess> Uploads<B> {
    /// `fill` writes the next buffer's first `len` elements on the host
    /// (once its last upload is done); they go up into `dst[at..]` on the
    /// host-to-device stream, after the compute stream's work so far, and
    /// the compute stream waits for them (as for a copy of a shard there).
    fn upload<R>(
        &mut self,
        backend: &B,
        (dst, at, len): (&mut DevBuf<B>, usize, usize),
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        let n = self.ring.len();
        let (host, pending) = &mut self.ring[self.next];
        self.next = (self.next + 1) % n;
        if let Some(up) = pending.take() {
            backend.sync(&up)?;
        }
        let r = host.write_bytes(backend, 0..len, fill)?;
        let before = backend.record(Stream::Compute)?;
        backend.wait(Stream::HostToDevice, &before)?;
        host.copy_to_device(backend, Stream::HostToDevice, dst, at, len)?;
        let up = backend.record(Stream::HostToDevice)?;
        backend.wait(Stream::Compute, &up)?;
        *pending = Some(up);
        Ok(r)
    }
}

/// The stage-3 parameter gatherer of one rank (see the module docs).
pub(crate) struct ParamGatherer<B: HostAccess> {
    schedule: Stage3Schedule,
    /// Per unit: the gathered buffer's length (both segments, or only the
    /// trainable one where the frozen segment is gathered apart) and the
    /// trainable shard's.
    padded: Vec<usize>,
    shard_len: Vec<usize>,
    /// Per unit: the frozen segment's length (padded).
    frozen_len: Vec<usize>,
    /// Per unit: its frozen segment (see [`FrozenHome`]), which goes into
    /// the gathered buffer after the trainable segment.
    frozen: Vec<Option<FrozenHome<B>>>,
    /// Per unit: the all-gather of its frozen shards in flight (into a
    /// buffer of the frozen segment's length) …
    frozen_inflight: Vec<Option<DynWork<B>>>,
    /// … then, from its wait until the unit is freed, that buffer, shared
    /// with the trainer's guards (read where the gather landed) …
    frozen_full: Vec<Option<Arc<DevBuf<B>>>>,
    /// … and a launched unit whose trainable segment needs no all-gather
    /// (only frozen tensors).
    parked: Vec<Option<DevBuf<B>>>,
    /// Per unit: the label of its gathered buffers.
    labels: Vec<String>,
    /// Gathered units (full, padded), shared with the trainer's guards.
    full: Vec<Option<Arc<DevBuf<B>>>>,
    inflight: Vec<Option<DynWork<B>>>,
    /// Freed gathered buffers, per length.
    pool: HashMap<usize, Vec<DevBuf<B>>>,
    allocs: Vec<Allocation>,
    /// On a device: the host buffers offloaded shards go up through
    /// (`None`: they are written into the gathered buffers by the host).
    uploads: Option<Uploads<B>>,
    /// The schedule's actions of the current call (reused).
    actions: Actions,
    /// The warning of the last call, for the engine to issue.
    warning: Option<String>,
    /// Test-only: the compute stream does not wait for the gathers of
    /// frozen segments (`SkipWait::FrozenBeforeRead`).
    skip_frozen_wait: bool,
}

impl<B: HostAccess> ParamGatherer<B> {
    /// The gatherer of `plan`'s units under `cfg`'s stage-3 knobs, nothing
    /// gathered yet.
    pub(crate) fn new(
        cfg: &ResolvedConfig,
        plan: &PartitionPlan,
        frozen: Vec<Option<FrozenHome<B>>>,
    ) -> ParamGatherer<B> {
        let units = plan.units();
        let n = units.len();
        let padded = units
            .iter()
            .zip(&frozen)
            .map(|(u, f)| match f {
                Some(FrozenHome::Shard(_) | FrozenHome::Host(_)) => u.padded_numel,
                _ => u.param_len(),
            })
            .collect();
        ParamGatherer {
            schedule: Stage3Schedule::new(Stage3Knobs::from_config(cfg), units),
            padded,
            shard_len: units.iter().map(|u| u.shard_len).collect(),
            frozen_len: units.iter().map(|u| u.frozen_padded).collect(),
            frozen,
            frozen_inflight: (0..n).map(|_| None).collect(),
            frozen_full: (0..n).map(|_| None).collect(),
            skip_frozen_wait: false,
            parked: (0..n).map(|_| None).collect(),
            labels: units
                .iter()
                .map(|u| format!("gathered `{}`", u.name))
                .collect(),
            full: (0..n).map(|_| None).collect(),
            inflight: (0..n).map(|_| None).collect(),
            pool: HashMap::new(),
            allocs: Vec::new(),
            uploads: None,
            actions: Actions::default(),
            warning: None,
        }
    }

    /// On a device backend: offloaded shards (and frozen segments in host
    /// memory) go up to the gathered buffers through `count` host buffers
    /// of `len` elements of `dtype` (accounted in the host tier).
    pub(crate) fn stage_uploads(
        &mut self,
        backend: &B,
        tracker: &MemoryTracker,
        (count, len, dtype): (usize, usize, DType),
    ) -> Result<()> {
        let mut ring = Vec::with_capacity(count);
        for k in 0..count {
            let h = DynHost::alloc(backend, dtype, len, &format!("shard upload {k}"))?;
            self.allocs
                .push(tracker.allocate(Tier::Host, Category::Params, h.bytes()));
            ring.push((h, None));
        }
        self.uploads = Some(Uploads { ring, next: 0 });
        Ok(())
    }

    /// Test-only: leaves out the compute stream's wait for the gathers of
    /// frozen segments, so that a test proves the hazard checker sees it.
    pub(crate) fn skip_frozen_wait(&mut self) {
        self.skip_frozen_wait = true;
    }

    /// Unit `i`'s frozen segment or shard, if it has frozen tensors.
    pub(crate) fn frozen(&self, i: usize) -> Option<&FrozenHome<B>> {
        self.frozen.get(i).and_then(Option::as_ref)
    }

    /// Unit `i`'s frozen segment or shard, to fill (checkpoint load).
    pub(crate) fn frozen_mut(&mut self, i: usize) -> Option<&mut FrozenHome<B>> {
        self.frozen.get_mut(i).and_then(Option::as_mut)
    }

    /// Elements gathered or being gathered.
    pub(crate) fn live(&self) -> usize {
        self.schedule.live()
    }

    /// Unit `i`'s gathered parameters (padded), if they are gathered and
    /// not in flight.
    pub(crate) fn params(&self, i: usize) -> Option<&Arc<DevBuf<B>>> {
        self.full[i].as_ref()
    }

    /// Unit `i`'s gathered frozen segment (padded), if it is gathered
    /// apart from the trainable one (`frozen_params` `shard` or
    /// `offload`) and not in flight.
    pub(crate) fn frozen_params(&self, i: usize) -> Option<&Arc<DevBuf<B>>> {
        self.frozen_full[i].as_ref()
    }

    /// The warning of the last call (a gather off the recorded order), once.
    pub(crate) fn take_warning(&mut self) -> Option<String> {
        self.warning.take()
    }

    /// Gathers unit `i` in training (see [`Stage3Schedule::gather`]) or,
    /// not `training`, for an evaluation (see
    /// [`Stage3Schedule::gather_eval`]); its parameters are readable when
    /// this returns.
    pub(crate) fn gather<C: EngineComm<B>>(
        &mut self,
        i: usize,
        training: bool,
        io: GatherIo<'_, C, B>,
    ) -> Result<()> {
        if training {
            self.decide_and_run(io, |s, out| s.gather(i, out))
        } else {
            self.decide_and_run(io, |s, out| s.gather_eval(i, out))
        }
    }

    /// Ends one use of unit `i`, in training (see
    /// [`Stage3Schedule::release`]) or an evaluation (see
    /// [`Stage3Schedule::release_eval`]).
    pub(crate) fn release<C: EngineComm<B>>(
        &mut self,
        i: usize,
        training: bool,
        io: GatherIo<'_, C, B>,
    ) -> Result<()> {
        if training {
            self.decide_and_run(io, |s, out| s.release(i, out))
        } else {
            self.decide_and_run(io, |s, out| s.release_eval(i, out))
        }
    }

    /// The end of a micro-batch: waits for the shard reads issued ahead,
    /// then see [`Stage3Schedule::end_micro_batch`].
    pub(crate) fn end_micro_batch<C: EngineComm<B>>(
        &mut self,
        mut io: GatherIo<'_, C, B>,
    ) -> Result<()> {
        if let Shards::Offloaded(po) = &mut io.shards {
            po.drain_reads();
        }
        self.decide_and_run(io, Stage3Schedule::end_micro_batch)
    }

    /// Starts what the next micro-batch gathers first (see
    /// [`Stage3Schedule::prefetch_next`]).
    pub(crate) fn prefetch_next<C: EngineComm<B>>(&mut self, io: GatherIo<'_, C, B>) -> Result<()> {
        self.decide_and_run(io, Stage3Schedule::prefetch_next)
    }

    /// One past the highest unit the next micro-batch gathers first (see
    /// [`Stage3Schedule::head`]).
    pub(crate) fn head(&self) -> Option<usize> {
        self.schedule.head()
    }

    /// Gathers (or refreshes, after a step) the persistent units.
    pub(crate) fn gather_persistent<C: EngineComm<B>>(
        &mut self,
        io: GatherIo<'_, C, B>,
    ) -> Result<()> {
        self.decide_and_run(io, Stage3Schedule::gather_persistent)
    }

    /// Asks the schedule, then executes its actions.
    fn decide_and_run<C: EngineComm<B>>(
        &mut self,
        io: GatherIo<'_, C, B>,
        decide: impl FnOnce(&mut Stage3Schedule, &mut Actions),
    ) -> Result<()> {
        let mut actions = std::mem::take(&mut self.actions);
        actions.clear();
        decide(&mut self.schedule, &mut actions);
        let r = self.run(&actions, io);
        self.actions = actions;
        r
    }

    fn run<C: EngineComm<B>>(&mut self, actions: &Actions, io: GatherIo<'_, C, B>) -> Result<()> {
        let GatherIo {
            cx,
            mut shards,
            stats,
        } = io;
        let Ctx {
            backend,
            gather_after: after,
            comm,
            tracker,
            tracer,
            pdt,
            ..
        } = cx;
        let (after, pdt) = (*after, *pdt);
        stats.prefetches += actions.prefetches;
        stats.prefetch_hits += actions.prefetch_hits;
        stats.gather_order_changes += actions.order_changes;
        if let Some(w) = &actions.warning {
            self.warning = Some(w.clone());
        }
        // The staging buffers refused a read ahead: none of the later
        // candidates is read.
        let mut refused = false;
        for &action in &actions.list {
            match action {
                Action::Launch(i) | Action::Refresh(i) => {
                    self.launch(i, (backend, after), comm, tracker, pdt, &mut shards, stats)?;
                }
                Action::Wait(i) => self.settle(i, backend, tracer, comm.rank())?,
                Action::Free(i) => {
                    if let Some(t) = self.frozen_full[i].take() {
                        let t = exclusive(t, i, comm.rank())?;
                        self.pool.entry(t.len()).or_default().push(t);
                    }
                    if let Some(b) = self.full[i].take() {
                        let b = exclusive(b, i, comm.rank())?;
                        match &mut self.frozen[i] {
                            // A resident unit keeps its buffer.
                            Some(FrozenHome::Resident(slot)) => *slot = Some(b),
                            _ => self.pool.entry(b.len()).or_default().push(b),
                        }
                    }
                }
                Action::ReadAhead(j) => {
                    if let Shards::Offloaded(po) = &mut shards {
                        refused = refused || !po.read_ahead(j);
                    }
                }
            }
        }
        // Live elements grow only by launches, and the peak is never below
        // them, so this is the peak over the call.
        stats.peak_live_elems = stats.peak_live_elems.max(self.schedule.live());
        Ok(())
    }

    /// Waits for unit `i`'s all-gathers in flight (if any): then its
    /// parameters are in `full[i]` (and a frozen segment gathered apart in
    /// `frozen_full[i]`, where it landed), readable from the host and
    /// the compute stream.
    pub(crate) fn settle(
        &mut self,
        i: usize,
        backend: &B,
        tracer: &Tracer,
        rank: usize,
    ) -> Result<()> {
        let main = match self.inflight[i].take() {
            Some(w) => {
                // The trainer reads the unit from the host.
                let (b, done) = w.wait(tracer, rank)?;
                backend.sync(&done)?;
                Some(b)
            }
            None => self.parked[i].take(),
        };
        if let Some(b) = main {
            if let Some(w) = self.frozen_inflight[i].take() {
                // The gathered frozen segment stays where it landed; the
                // compute stream (the trainer's kernels, and the host
                // after the sync below) reads it after the gather.
                let (t, done) = w.wait(tracer, rank)?;
                if !self.skip_frozen_wait {
                    backend.wait(Stream::Compute, &done)?;
                }
                self.frozen_full[i] = Some(Arc::new(t));
            }
            backend.sync(&backend.record(Stream::Compute)?)?;
            self.full[i] = Some(Arc::new(b));
        }
        Ok(())
    }

    /// Unit `i`'s resident buffer (after [`ParamGatherer::settle`]), with
    /// `frozen_params` `resident`: in `full[i]` while gathered, else kept.
    pub(crate) fn resident(&self, i: usize) -> Option<&DevBuf<B>> {
        match self.frozen.get(i)? {
            Some(FrozenHome::Resident(slot)) => slot.as_ref().or(self.full[i].as_deref()),
            _ => None,
        }
    }

    /// [`ParamGatherer::resident`], to fill (a checkpoint load: no guard
    /// holds it).
    pub(crate) fn resident_mut(&mut self, i: usize, rank: usize) -> Result<Option<&mut DevBuf<B>>> {
        match self.frozen.get_mut(i) {
            Some(Some(FrozenHome::Resident(slot))) => match slot.as_mut() {
                Some(b) => Ok(Some(b)),
                None => match self.full[i].as_mut() {
                    Some(b) => Arc::get_mut(b).map(Some).ok_or_else(|| Error::Usage {
                        rank,
                        what: format!(
                            "internal: the parameters of unit #{i} are held while its frozen \
                             tensors are set"
                        ),
                    }),
                    None => Ok(None),
                },
            },
            _ => Ok(None),
        }
    }

    /// Starts the all-gather of unit `i`: into its resident buffer if it
    /// has one (a refresh), else into a pooled or new one.
    #[allow(clippy::too_many_arguments)]
    fn launch<C: EngineComm<B>>(
        &mut self,
        i: usize,
        (backend, after): (&B, Stream),
        comm: &C,
        tracker: &MemoryTracker,
        pdt: DType,
        shards: &mut Shards<'_, B>,
        stats: &mut EngineStats,
    ) -> Result<()> {
        let (padded, shard) = (self.padded[i], self.shard_len[i]);
        let (rank, world) = (comm.rank(), comm.world_size());
        let resident = match &mut self.frozen[i] {
            Some(FrozenHome::Resident(slot)) => Some(slot.take()),
            _ => None,
        };
        let mut buf = match self.full[i].take() {
            Some(b) => exclusive(b, i, rank)?,
            None => match resident {
                Some(Some(b)) => b,
                Some(None) => {
                    return Err(Error::Usage {
                        rank,
                        what: format!(
                            "internal: unit #{i}'s resident buffer is neither kept nor gathered"
                        ),
                    })
                }
                None => match self.pool.get_mut(&padded).and_then(Vec::pop) {
                    Some(b) => b,
                    None => {
                        let b = DevBuf::alloc(backend, comm, pdt, padded, &self.labels[i])?;
                        self.allocs.push(tracker.allocate(
                            Tier::Device,
                            Category::GatheredParams,
                            b.bytes(),
                        ));
                        b
                    }
                },
            },
        };
        match shards {
            // Parameter offload: host → the rank's slot of the gathered
            // (device-tier) buffer, or the swap read issued ahead.
            Shards::Offloaded(po) => {
                stats.param_reads_ahead += u64::from(po.has_read(i));
                let fetch = match self.uploads.as_mut() {
                    Some(up) => up.upload(backend, (&mut buf, rank * shard, shard), |slot| {
                        po.load_into(i, slot)
                    })?,
                    None => {
                        host_writes_after_compute(backend)?;
                        buf.write_bytes(backend, rank * shard..(rank + 1) * shard, |slot| {
                            Ok(po.load_into(i, slot))
                        })?
                    }
                };
                match fetch {
                    Fetch::Read => stats.param_swap_reads += 1,
                    Fetch::Cached => stats.param_cache_hits += 1,
                    Fetch::Host => {}
                }
            }
            Shards::Home(home) => {
                buf.copy_from(
                    backend,
                    Stream::Compute,
                    rank * shard,
                    home.shard(i),
                    0,
                    shard,
                )?;
                stats.gather_copy_bytes += (shard * pdt.size_in_bytes()) as u64;
            }
        }
        match &self.frozen[i] {
            // Resident: the frozen segment is in the buffer already.
            None | Some(FrozenHome::Resident(_)) => {}
            // Gathered or in flight (a refresh after the step): it never
            // changes, so it stays.
            Some(_) if self.frozen_full[i].is_some() || self.frozen_inflight[i].is_some() => {}
            Some(home) => {
                let frozen_len = self.frozen_len[i];
                let fs = frozen_len / world;
                let mut t = match self.pool.get_mut(&frozen_len).and_then(Vec::pop) {
                    Some(t) => t,
                    None => {
                        let label = format!("frozen {}", self.labels[i]);
                        let t = DevBuf::alloc(backend, comm, pdt, frozen_len, &label)?;
                        self.allocs.push(tracker.allocate(
                            Tier::Device,
                            Category::GatheredParams,
                            t.bytes(),
                        ));
                        t
                    }
                };
                match home {
                    FrozenHome::Shard(f) => {
                        t.copy_from(backend, Stream::Compute, rank * fs, f, 0, fs)?;
                        stats.gather_copy_bytes += (fs * pdt.size_in_bytes()) as u64;
                    }
                    FrozenHome::Host(bytes) => match self.uploads.as_mut() {
                        Some(up) => up.upload(backend, (&mut t, rank * fs, fs), |slot| {
                            slot.copy_from_slice(bytes)
                        })?,
                        None => {
                            host_writes_after_compute(backend)?;
                            t.write_bytes(backend, rank * fs..(rank + 1) * fs, |slot| {
                                slot.copy_from_slice(bytes);
                                Ok(())
                            })?
                        }
                    },
                    FrozenHome::Resident(_) => unreachable!("matched above"),
                }
                stats.gather_bytes += ring_bytes(frozen_len, world, pdt);
                stats.frozen_gather_bytes += ring_bytes(frozen_len, world, pdt);
                let filled = backend.record(after)?;
                self.frozen_inflight[i] =
                    Some(t.all_gather(backend, comm, &vec![fs; world], &filled));
            }
        }
        if shard == 0 {
            // Only frozen tensors: no trainable segment to all-gather.
            self.parked[i] = Some(buf);
            return Ok(());
        }
        stats.gather_bytes += ring_bytes(shard * world, world, pdt);
        let filled = backend.record(after)?;
        // The trainable segment: the prefix of the buffer.
        self.inflight[i] = Some(buf.all_gather(backend, comm, &vec![shard; world], &filled));
        Ok(())
    }
}

/// Before the host writes a shard into a gathered buffer without staging
/// (the CPU backend): the buffer may come from the pool while the compute
/// stream still reads what it held (a trainer's ops on the unit freed
/// last), so the host waits for the compute stream first.
fn host_writes_after_compute<B: HostAccess>(backend: &B) -> Result<()> {
    backend.sync(&backend.record(Stream::Compute)?)?;
    Ok(())
}
