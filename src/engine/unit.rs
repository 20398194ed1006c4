//! The registered units and their own parameters: where each unit's
//! parameters are ([`Params`]), and at stages 1–2 the all-gathers of the
//! parameters the optimizer step updated ([`Units::advance`]).
//!
//! ```text
//!  step (stages 1–2): queue(u0) queue(u1) …
//!  comm:              gather(u0) gather(u1) …   at most allgather_bucket_size
//!                                               elements in flight
//!  next forward:      gather(u) waits for unit u's all-gather (overlap_comm)
//! ```

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Instant;

use zero_core::backend::HostAccess;
use zero_core::memory::Allocation;
use zero_core::partition::UnitLayout;

use super::backend::{EngineBackend, EngineComm};
use super::ctx::Ctx;
use super::devbuf::{DevBuf, DynWork};
use super::dynbuf::ring_bytes;
use super::gatherer::{GatherIo, HomeShards, ParamGatherer, Shards};
use super::lease::{exclusive, Releases, UnitGuard};
use super::param_offload::ParamOffload;
use super::stats::EngineStats;
use crate::Result;

/// A registered unit of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnitId {
    pub(super) engine: u64,
    pub(super) index: usize,
}

impl UnitId {
    /// The unit's position in registration order.
    pub fn index(self) -> usize {
        self.index
    }

    /// Unit `index` of the engine whose id is `engine`.
    pub(super) fn new(engine: u64, index: usize) -> Self {
        Self { engine, index }
    }

    /// Its index, if it is one of the `n` units of engine `engine` (`Err`:
    /// the refusal of `call`).
    pub(super) fn index_in(
        self,
        engine: u64,
        n: usize,
        call: &str,
    ) -> std::result::Result<usize, String> {
        if self.engine != engine || self.index >= n {
            return Err(format!(
                "{call}: unknown unit #{} (it was not registered with this engine)",
                self.index
            ));
        }
        Ok(self.index)
    }
}

/// Where a unit's own parameters are (stages 0–2: the full padded unit;
/// stage 3: this rank's shard), one state per unit:
///
/// ```text
///  Home ──step (stages 1–2)──▶ Queued ──launch──▶ Gathering ──complete──▶ Home
///  Offloaded (stage 3 with offload_param: the shard lives in ParamOffload)
/// ```
pub(super) enum Params<B: HostAccess> {
    /// Current and readable; shared with the trainer's `UnitGuard`s at
    /// stages 0–2.
    Home(Arc<DevBuf<B>>),
    /// Stages 1–2: updated by the step (this rank's range); the all-gather
    /// of the other ranks' ranges is queued.
    Queued(Arc<DevBuf<B>>),
    /// Stages 1–2: lent to that all-gather (its handle is in
    /// [`Units`]).
    Gathering,
    /// Stage 3 with `offload_param`: the shard's home is the parameter
    /// offload.
    Offloaded,
}

/// The per-unit state.
pub(super) struct Unit<B: HostAccess> {
    pub(super) layout: Arc<UnitLayout>,
    pub(super) params: Params<B>,
    /// How many `gather`s are not yet `release`d (live `UnitGuard`s).
    pub(super) gathers: usize,
    pub(super) _allocs: Vec<Allocation>,
}

impl<B: HostAccess> Unit<B> {
    /// The unit's parameters where they are current.
    pub(super) fn home(&self) -> Option<&Arc<DevBuf<B>>> {
        match &self.params {
            Params::Home(p) => Some(p),
            _ => None,
        }
    }

    /// Whether the updated parameters' all-gather is queued or in flight
    /// (stages 1–2).
    pub(super) fn is_stale(&self) -> bool {
        matches!(self.params, Params::Queued(_) | Params::Gathering)
    }

    /// The unit's own parameters, to update or fill: home (or queued for
    /// their all-gather), and no `UnitGuard` holds them (the step refuses
    /// to run while a unit is gathered, and a checkpoint load fills a new
    /// engine).
    pub(super) fn params_mut(&mut self) -> &mut DevBuf<B> {
        let p = match &mut self.params {
            Params::Home(p) | Params::Queued(p) => p,
            Params::Gathering | Params::Offloaded => {
                unreachable!("the step and a load update parameters that are home")
            }
        };
        Arc::get_mut(p).expect("no UnitGuard holds the parameters while they are updated")
    }

    /// Stages 1–2, after the step: marks the updated parameters for their
    /// all-gather (false if it is queued or in flight already).
    fn mark_queued(&mut self) -> bool {
        if !self.layout.is_trainable() {
            // Only frozen tensors: the step never changes them.
            return false;
        }
        match std::mem::replace(&mut self.params, Params::Gathering) {
            Params::Home(p) => {
                self.params = Params::Queued(p);
                true
            }
            other => {
                self.params = other;
                false
            }
        }
    }
}

/// What an all-gather of updated parameters needs from the engine.
pub(super) struct AllGatherIo<'a, C, B: HostAccess> {
    /// The device, the communicator, the stream the all-gathers start
    /// after, the tracer and `allgather_bucket_size`.
    pub(super) cx: &'a Ctx<C, B>,
    pub(super) stats: &'a mut EngineStats,
}

/// Every unit of an engine (a slice of [`Unit`]s, in registration order)
/// and, at stages 1–2, the all-gathers of updated parameters: in flight
/// (unit, handle) in launch order with their padded elements, and queued
/// (not launched yet, over `allgather_bucket_size`). With `overlap_comm`
/// both drain during the next forward pass, as `gather` asks for each
/// unit.
pub(super) struct Units<B: EngineBackend> {
    units: Vec<Unit<B>>,
    in_flight: VecDeque<(usize, DynWork<B>)>,
    in_flight_elems: usize,
    queue: VecDeque<usize>,
}

impl<B: EngineBackend> Deref for Units<B> {
    type Target = [Unit<B>];
    fn deref(&self) -> &[Unit<B>] {
        &self.units
    }
}

impl<B: EngineBackend> DerefMut for Units<B> {
    fn deref_mut(&mut self) -> &mut [Unit<B>] {
        &mut self.units
    }
}

impl<B: EngineBackend> HomeShards<B> for Units<B> {
    fn shard(&self, unit: usize) -> &DevBuf<B> {
        self.units[unit].home().expect("shards are home")
    }
}

impl<B: EngineBackend> Units<B> {
    /// Lends unit `i`'s full parameters to one more [`UnitGuard`] (of
    /// `rank`, on `backend`, reporting its drop to `releases`): stage 3's
    /// gathered buffers from `s3` (the frozen segment too where it was
    /// gathered apart), else the unit's home; `Err` where they are not
    /// there (the gather did not complete: an internal error).
    pub(super) fn lend(
        &mut self,
        i: usize,
        s3: Option<&ParamGatherer<B>>,
        (backend, rank): (&B, usize),
        releases: &Releases,
    ) -> Result<UnitGuard<B>, String> {
        let params = match s3 {
            Some(s3) => s3
                .params(i)
                .map(|p| (p.clone(), s3.frozen_params(i).cloned())),
            None => self.units[i].home().map(|p| (p.clone(), None)),
        };
        let u = &mut self.units[i];
        let Some(params) = params else {
            return Err(format!(
                "internal: gather(`{}`): the parameters are not home after the gather",
                u.layout.name
            ));
        };
        u.gathers += 1;
        let (layout, releases) = (u.layout.clone(), releases.clone());
        Ok(UnitGuard::new(
            params,
            backend.clone(),
            layout,
            i,
            rank,
            releases,
        ))
    }

    /// Ends one use of unit `i`'s parameters (its guard dropped); `Err`
    /// when it is not lent.
    pub(super) fn unlend(&mut self, i: usize) -> std::result::Result<(), String> {
        let u = &mut self.units[i];
        if u.gathers == 0 {
            let name = &u.layout.name;
            return Err(format!(
                "internal: release(`{name}`): the unit is not gathered"
            ));
        }
        u.gathers -= 1;
        Ok(())
    }

    /// The built units, every parameter home.
    pub(super) fn new(units: Vec<Unit<B>>) -> Self {
        Self {
            units,
            in_flight: VecDeque::new(),
            in_flight_elems: 0,
            queue: VecDeque::new(),
        }
    }

    /// Call `call` is refused while a guard still holds the parameters
    /// of a unit (the error names the first).
    pub(super) fn check_none_gathered(&self, call: &str) -> Result<(), String> {
        match self.units.iter().find(|u| u.gathers > 0) {
            Some(u) => Err(format!(
                "{call}() while unit `{}` is still gathered; drop its UnitGuard first",
                u.layout.name
            )),
            None => Ok(()),
        }
    }

    /// Whether an all-gather is queued and not launched yet.
    pub(super) fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Stages 1–2, after the step updated unit `i`: queues the all-gather
    /// of its parameters (no-op if it is queued or in flight already).
    pub(super) fn queue_gather(&mut self, i: usize) {
        if self.units[i].mark_queued() {
            self.queue.push_back(i);
        }
    }

    /// Stages 1–2, after a step that every rank applied: all-gathers every
    /// unit's updated shard in place, with up to `allgather_bucket_size`
    /// elements in flight. With `overlap_comm` (`overlap`) this only
    /// starts them: the next forward pass waits for each unit in
    /// [`Units::wait_for`] (as FSDP's forward all-gather), so the transfer
    /// hides behind the compute of the units before it.
    pub(super) fn gather_all<C: EngineComm<B>>(
        &mut self,
        overlap: bool,
        io: &mut AllGatherIo<'_, C, B>,
    ) -> Result<()> {
        // (With overlap_comm and the optimizer state on the device tier,
        // AdamW queued each unit as it finished it.)
        for i in 0..self.len() {
            self.queue_gather(i);
        }
        if overlap {
            self.advance(None, io)
        } else {
            self.finish(io)
        }
    }

    /// Before unit `i`'s parameters are read (a gather): with
    /// `overlap_comm` the all-gather of its updated parameters started in
    /// the step, so waits for it (a `gather` span, counted in
    /// `gather_time`), and keeps launching the queued ones.
    pub(super) fn wait_for<C: EngineComm<B>>(
        &mut self,
        i: usize,
        io: &mut AllGatherIo<'_, C, B>,
    ) -> Result<()> {
        if self.units[i].is_stale() {
            let _span = io.cx.tracer.span(io.cx.comm.rank(), "gather", "comm");
            let t = Instant::now();
            self.advance(Some(i), io)?;
            io.stats.gather_time += t.elapsed();
        } else if self.has_queued() {
            self.advance(None, io)?;
        }
        Ok(())
    }

    /// Launches queued parameter all-gathers while they fit in
    /// `allgather_bucket_size` (at least one in flight), completing the
    /// oldest to make room, until unit `until` is home; with `None`, only
    /// launches what fits now.
    pub(super) fn advance<C: EngineComm<B>>(
        &mut self,
        until: Option<usize>,
        io: &mut AllGatherIo<'_, C, B>,
    ) -> Result<()> {
        let (rank, world) = (io.cx.comm.rank(), io.cx.comm.world_size());
        loop {
            while let Some(&j) = self.queue.front() {
                let l = &self.units[j].layout;
                let (n, s) = (l.padded_numel, l.shard_len);
                if !self.in_flight.is_empty() && self.in_flight_elems + n > io.cx.gather_limit() {
                    break;
                }
                self.queue.pop_front();
                let p = match std::mem::replace(&mut self.units[j].params, Params::Gathering) {
                    Params::Queued(p) => exclusive(p, j, rank)?,
                    _ => unreachable!("a queued unit's parameters are queued"),
                };
                io.stats.gather_bytes += ring_bytes(n, world, p.dtype());
                // After AdamW wrote the unit (or a checkpoint load filled it).
                let updated = io.cx.backend.record(io.cx.gather_after)?;
                let work = p.all_gather(&io.cx.backend, &io.cx.comm, &vec![s; world], &updated);
                self.in_flight.push_back((j, work));
                self.in_flight_elems += n;
            }
            match until {
                Some(i) if self.units[i].is_stale() => {}
                _ => return Ok(()),
            }
            let (j, w) = self
                .in_flight
                .pop_front()
                .expect("a stale unit has its all-gather queued or in flight");
            self.complete(j, w, io)?;
        }
    }

    /// Unit `j`'s parameter all-gather `w` is done: the host may read the
    /// parameters again.
    fn complete<C: EngineComm<B>>(
        &mut self,
        j: usize,
        w: DynWork<B>,
        io: &AllGatherIo<'_, C, B>,
    ) -> Result<()> {
        self.in_flight_elems -= self.units[j].layout.padded_numel;
        let (p, done) = w.wait(&io.cx.tracer, io.cx.comm.rank())?;
        io.cx.backend.sync(&done)?;
        self.units[j].params = Params::Home(Arc::new(p));
        Ok(())
    }

    /// Completes every parameter all-gather still queued or in flight
    /// (before anything reads or writes the parameters as a whole).
    pub(super) fn finish<C: EngineComm<B>>(
        &mut self,
        io: &mut AllGatherIo<'_, C, B>,
    ) -> Result<()> {
        while !self.in_flight.is_empty() || !self.queue.is_empty() {
            match self.queue.back().copied() {
                Some(j) => self.advance(Some(j), io)?,
                None => {
                    let (j, w) = self.in_flight.pop_front().expect("not empty");
                    self.complete(j, w, io)?;
                }
            }
        }
        Ok(())
    }
}

/// What stage 3's gatherer needs from the engine for one call, made in
/// this one place for the coordinator's calls and the optimizer step's
/// prefetch alike: the context, the shards (from the parameter offload
/// `poff`, else the units' own parameters) and the counters.
pub(super) fn gather_io<'a, C: EngineComm<B>, B: EngineBackend>(
    cx: &'a Ctx<C, B>,
    (poff, units): (Option<&'a mut ParamOffload>, &'a Units<B>),
    stats: &'a mut EngineStats,
) -> GatherIo<'a, C, B> {
    let shards = match poff {
        Some(po) => Shards::Offloaded(po),
        None => Shards::Home(units),
    };
    GatherIo { cx, shards, stats }
}
