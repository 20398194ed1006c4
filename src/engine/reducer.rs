//! The gradient reducer: each unit's gradient of a micro-batch goes into a
//! bucket, buckets are reduced across ranks (overlapping the backward pass
//! where the stage allows), and the reduced values land in the unit's
//! gradient home, which the optimizer reads.
//!
//! ```text
//!  trainer     lend(u) ─▶ writes ─▶ hand_back(u)
//!                                      │ pack (convert to the comm dtype)
//!                                      ▼
//!  open bucket [a0 b0 .. | a1 b1 ..] ──full──▶ launch: all-reduce (stage 0)
//!                                              or reduce-scatter (1–3)
//!                                                       │
//!  in flight   ...oldest ◀──────────────────────────────┘
//!                 │ complete: unpack this rank's section (store, or add
//!                 ▼ from the second micro-batch of a step on)
//!  homes       acc[u] (A dtype; full at stage 0, else the shard) or the
//!              persistent P buffer grads[u] (stages 0–1 without a
//!              separate accumulation buffer)
//! ```
//!
//! Per unit the gradient goes through [`GradState`]: `Empty` at the start
//! of a micro-batch, `Lent` while the trainer writes it, `Ready` once it is
//! handed back.

use std::collections::{HashMap, VecDeque};

use zero_comm::{Communicator, Work};
use zero_core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero_core::partition::PartitionPlan;
use zero_core::DType;

use super::dynbuf::{ring_bytes, DynBuf};
use crate::trace::Tracer;
use crate::Result;

/// Where a unit's gradient of the current micro-batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GradState {
    /// Not handed out in this micro-batch.
    Empty,
    /// The trainer holds the buffer.
    Lent,
    /// Handed back: in a bucket, in flight, or reduced.
    Ready,
}

/// A bucket of gradients being filled.
struct OpenBucket {
    buf: DynBuf,
    units: Vec<usize>,
    elems: usize,
}

/// A bucket whose reduction is in flight.
struct InFlight {
    work: Work<DynBuf>,
    units: Vec<usize>,
}

/// Gradient buckets and homes of one rank.
pub(crate) struct GradReducer {
    stage: u8,
    rank: usize,
    world: usize,
    pdt: DType,
    cdt: DType,
    /// Reductions overlap the backward pass (see [`overlaps`]).
    overlap: bool,
    /// `zero_optimization.reduce_scatter`.
    reduce_scatter: bool,
    /// `zero_optimization.reduce_bucket_size`.
    bucket_size: usize,
    /// With optimizer offload the homes are host memory (for the trace).
    offloading: bool,
    /// Each unit's padded elements and shard length.
    padded: Vec<usize>,
    shard: Vec<usize>,
    bucket_cap: usize,
    free: Vec<DynBuf>,
    open: Option<OpenBucket>,
    inflight: VecDeque<InFlight>,
    /// Stage 1: units handed back, reduced after the backward pass.
    deferred: Vec<usize>,
    /// Stages 2–3: transient full gradient buffers by length.
    pool: HashMap<usize, Vec<DynBuf>>,
    /// Stages 0–1: the persistent full gradient buffer in P (`None` while
    /// lent or in a bucket).
    grads: Vec<Option<DynBuf>>,
    /// The accumulated gradient in A: full (stage 0) or shard; `None` when
    /// it lives in `grads` (A = P without accumulation, stages 0/1, no
    /// optimizer offload). With optimizer offload it is the host-side
    /// gradient shard that feeds the CPU AdamW (accounted in the host
    /// tier).
    acc: Vec<Option<DynBuf>>,
    state: Vec<GradState>,
    allocs: Vec<Allocation>,
}

/// Whether gradient reductions overlap the backward pass: stage 0 always
/// (as DDP), stages 2–3 with `overlap_comm`; stage 1 reduces after it.
pub(crate) fn overlaps(cfg: &ResolvedConfig) -> bool {
    match cfg.zero.stage {
        0 => true,
        1 => false,
        _ => cfg.zero.overlap_comm,
    }
}

/// The gradient buckets of the memory plan (the engine allocates them, the
/// estimator counts them): their capacity in elements — as large as
/// `reduce_bucket_size` but no larger than the model, and at least the
/// largest unit — and how many: two when reductions overlap the backward
/// pass, else one.
pub(crate) fn buckets(cfg: &ResolvedConfig, plan: &PartitionPlan) -> (usize, usize) {
    let largest = plan
        .units()
        .iter()
        .map(|u| u.padded_numel)
        .max()
        .unwrap_or(0);
    let cap = cfg
        .zero
        .reduce_bucket_size
        .min(plan.padded_numel())
        .max(largest);
    (cap, if overlaps(cfg) { 2 } else { 1 })
}

impl GradReducer {
    /// Allocates every gradient home and the bucket buffers of the memory
    /// plan (prefaulted: the step takes no page faults).
    pub(crate) fn new<C: Communicator>(
        cfg: &ResolvedConfig,
        plan: &PartitionPlan,
        comm: &C,
        tracker: &MemoryTracker,
    ) -> Result<Self> {
        let stage = cfg.zero.stage;
        let pdt = match cfg.precision {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        };
        let adt = cfg.grad_accum_dtype;
        let cdt = cfg.communication_data_type;
        let offloading = cfg.zero.offload_optimizer.device != OffloadDevice::None;
        let alias = stage <= 1 && adt == pdt && cfg.gradient_accumulation_steps == 1 && !offloading;
        let mut allocs = Vec::new();
        let (mut grads, mut acc) = (Vec::new(), Vec::new());
        for layout in plan.units() {
            let full = layout.padded_numel;
            grads.push(if stage <= 1 {
                let mut g = DynBuf::alloc(comm, pdt, full)?;
                g.prefault();
                allocs.push(tracker.allocate(Tier::Device, Category::Grads, g.capacity_bytes()));
                Some(g)
            } else {
                None
            });
            acc.push(if alias {
                None
            } else {
                let len = if stage == 0 { full } else { layout.shard_len };
                let mut a = DynBuf::alloc(comm, adt, len)?;
                a.prefault();
                // With optimizer offload the gradient shard feeding AdamW
                // is host memory (device→host as buckets complete).
                let tier = if offloading { Tier::Host } else { Tier::Device };
                allocs.push(tracker.allocate(tier, Category::Grads, a.capacity_bytes()));
                Some(a)
            });
        }
        let (bucket_cap, count) = buckets(cfg, plan);
        let overlap = overlaps(cfg);
        let mut free = Vec::new();
        for _ in 0..count {
            let mut b = DynBuf::alloc(comm, cdt, bucket_cap)?;
            b.prefault();
            allocs.push(tracker.allocate(Tier::Device, Category::CommBuffers, b.capacity_bytes()));
            free.push(b);
        }
        let n = plan.units().len();
        Ok(GradReducer {
            stage,
            rank: comm.rank(),
            world: comm.world_size(),
            pdt,
            cdt,
            overlap,
            reduce_scatter: cfg.zero.reduce_scatter,
            bucket_size: cfg.zero.reduce_bucket_size,
            offloading,
            padded: plan.units().iter().map(|u| u.padded_numel).collect(),
            shard: plan.units().iter().map(|u| u.shard_len).collect(),
            bucket_cap,
            free,
            open: None,
            inflight: VecDeque::new(),
            deferred: Vec::new(),
            pool: HashMap::new(),
            grads,
            acc,
            state: vec![GradState::Empty; n],
            allocs,
        })
    }

    /// Where unit `i`'s gradient of this micro-batch is.
    pub(crate) fn state(&self, i: usize) -> GradState {
        self.state[i]
    }

    /// The first unit whose gradient is in `state`.
    pub(crate) fn find(&self, state: GradState) -> Option<usize> {
        self.state.iter().position(|&s| s == state)
    }

    /// Whether no reduction is open or in flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.open.is_none() && self.inflight.is_empty()
    }

    /// Whether unit gradients are accumulated in a separate buffer (in the
    /// accumulation dtype, the rank's shard beyond stage 0).
    pub(crate) fn has_acc(&self, i: usize) -> bool {
        self.acc[i].is_some()
    }

    /// The reduced (and accumulated) gradient of unit `i`: the separate
    /// accumulation buffer, or the persistent one.
    pub(crate) fn home(&self, i: usize) -> &DynBuf {
        self.acc[i]
            .as_ref()
            .or(self.grads[i].as_ref())
            .expect("a gradient home")
    }

    /// The dtype of the gradient homes (one for every unit).
    pub(crate) fn home_dtype(&self) -> Option<DType> {
        (!self.state.is_empty()).then(|| self.home(0).dtype())
    }

    /// Lends unit `i`'s gradient buffer to the trainer, zeroed: the
    /// persistent one (stages 0/1) or one from the pool (stages 2/3).
    /// `add`: later micro-batches of a step accumulate into the homes.
    pub(crate) fn lend<C: Communicator>(
        &mut self,
        comm: &C,
        tracker: &MemoryTracker,
        tracer: &Tracer,
        i: usize,
        add: bool,
    ) -> Result<DynBuf> {
        let mut buf = self.take_buffer(comm, tracker, tracer, i, add)?;
        buf.fill_zero();
        self.state[i] = GradState::Lent;
        Ok(buf)
    }

    /// Takes unit `i`'s gradient buffer back from the trainer: it joins
    /// the current bucket, which is reduced as soon as it is full (stages
    /// 0, 2, 3 while backward goes on; stage 1 after backward, in
    /// [`GradReducer::finish`]). Returns the bytes sent.
    pub(crate) fn hand_back<C: Communicator>(
        &mut self,
        comm: &C,
        tracer: &Tracer,
        i: usize,
        buf: DynBuf,
        add: bool,
    ) -> Result<u64> {
        self.state[i] = GradState::Ready;
        if self.stage == 1 {
            self.grads[i] = Some(buf);
            self.deferred.push(i);
            return Ok(0);
        }
        self.add_to_bucket(comm, tracer, i, buf, add)
    }

    /// Unit `i`'s gradient buffer, not zeroed.
    fn take_buffer<C: Communicator>(
        &mut self,
        comm: &C,
        tracker: &MemoryTracker,
        tracer: &Tracer,
        i: usize,
        add: bool,
    ) -> Result<DynBuf> {
        if self.stage <= 1 {
            self.wait_for_home(comm, tracer, i, add)?;
            return Ok(self.grads[i].take().expect("grad buffer is home"));
        }
        let len = self.padded[i];
        if let Some(b) = self.pool.get_mut(&len).and_then(Vec::pop) {
            return Ok(b);
        }
        let b = DynBuf::alloc(comm, self.pdt, len)?;
        // Transient gradient buffers stay in the pool: accounted as
        // gradients for as long as they exist.
        self.allocs
            .push(tracker.allocate(Tier::Device, Category::Grads, b.capacity_bytes()));
        Ok(b)
    }

    /// Stage 0/1: the unit's gradient buffer may sit in a bucket (stage 0
    /// with reductions in flight): drain until it is home.
    fn wait_for_home<C: Communicator>(
        &mut self,
        comm: &C,
        tracer: &Tracer,
        i: usize,
        add: bool,
    ) -> Result<()> {
        while self.grads[i].is_none() {
            if self.open.as_ref().is_some_and(|b| b.units.contains(&i)) {
                self.launch_open(comm, tracer, add)?;
            }
            if self.inflight.is_empty() {
                break;
            }
            self.complete_oldest(tracer, add)?;
        }
        Ok(())
    }

    /// Copies unit `i`'s gradient into the open bucket (converting to the
    /// communication dtype) and gives the gradient buffer back at once
    /// (stages 2/3: to the pool, so only the units in flight hold full
    /// gradients). The bucket starts its reduction when full. Layout:
    /// stage 0 puts the units one after another; stages 1–3 group the
    /// units' shards by rank, in sections of `stride = capacity / N`:
    ///
    /// ```text
    ///  units a, b:   a = [a0 a1]  b = [b0 b1]     (shard r of each unit)
    ///  buffer:       [a0 b0 .. | a1 b1 ..]  → rank r receives section r
    /// ```
    fn add_to_bucket<C: Communicator>(
        &mut self,
        comm: &C,
        tracer: &Tracer,
        i: usize,
        grad: DynBuf,
        add: bool,
    ) -> Result<u64> {
        let n = self.padded[i];
        let world = self.world;
        let stride = self.bucket_cap / world;
        let (stage, cap) = (self.stage, self.bucket_cap);
        let fits = |elems: usize| {
            if stage == 0 {
                elems + n <= cap
            } else {
                (elems + n) / world <= stride
            }
        };
        let mut sent = 0;
        if self.open.as_ref().is_some_and(|b| !fits(b.elems)) {
            sent += self.launch_open(comm, tracer, add)?;
        }
        if self.open.is_none() {
            if self.free.is_empty() {
                self.complete_oldest(tracer, add)?;
            }
            let buf = self.free.pop().expect("a bucket buffer is free");
            self.open = Some(OpenBucket {
                buf,
                units: Vec::new(),
                elems: 0,
            });
        }
        let b = self.open.as_mut().expect("opened above");
        if self.stage == 0 {
            b.buf.store_from(b.elems, &grad, 0, n, false);
        } else {
            let shard = n / world;
            let at = b.elems / world;
            for r in 0..world {
                b.buf
                    .store_from(r * stride + at, &grad, r * shard, shard, false);
            }
        }
        b.units.push(i);
        b.elems += n;
        let full = b.elems >= self.bucket_size.min(self.bucket_cap);
        if self.stage <= 1 {
            self.grads[i] = Some(grad);
        } else {
            self.pool.entry(grad.len()).or_default().push(grad);
        }
        if full {
            sent += self.launch_open(comm, tracer, add)?;
        }
        Ok(sent)
    }

    /// Starts the reduction of the open bucket: all-reduce (stage 0) or
    /// reduce-scatter of the rank sections (stages 1–3), after closing the
    /// gaps between sections of a bucket that is not full. Returns the
    /// bytes sent.
    fn launch_open<C: Communicator>(
        &mut self,
        comm: &C,
        tracer: &Tracer,
        add: bool,
    ) -> Result<u64> {
        let Some(open) = self.open.take() else {
            return Ok(0);
        };
        let mut buf = open.buf;
        let world = self.world;
        let (work, sent) = if self.stage == 0 {
            buf.set_len(open.elems)?;
            (
                buf.all_reduce(comm),
                ring_bytes(open.elems, world, self.cdt) * 2,
            )
        } else {
            let section = open.elems / world;
            let stride = self.bucket_cap / world;
            if section < stride {
                for r in 1..world {
                    buf.copy_within(r * stride..r * stride + section, r * section);
                }
            }
            buf.set_len(open.elems)?;
            if self.reduce_scatter {
                (
                    buf.reduce_scatter(comm, &vec![section; world]),
                    ring_bytes(open.elems, world, self.cdt),
                )
            } else {
                // `reduce_scatter: false`: all-reduce, keep this rank's
                // section (the same sums, twice the traffic).
                (
                    buf.all_reduce(comm),
                    ring_bytes(open.elems, world, self.cdt) * 2,
                )
            }
        };
        self.inflight.push_back(InFlight {
            work,
            units: open.units,
        });
        if !self.overlap {
            self.complete_oldest(tracer, add)?;
        }
        Ok(sent)
    }

    /// Waits for the oldest bucket and stores its result in the units'
    /// homes (`add`: adds it).
    fn complete_oldest(&mut self, tracer: &Tracer, add: bool) -> Result<()> {
        let Some(f) = self.inflight.pop_front() else {
            return Ok(());
        };
        let buf = tracer.wait(self.rank, f.work)?;
        // With optimizer offload the accumulated shard is host memory:
        // this is the device→host copy of the reduced gradient.
        let _span = self
            .offloading
            .then(|| tracer.span(self.rank, "grad to host", "offload"));
        let world = self.world;
        let rank = self.rank;
        if self.stage == 0 {
            let mut off = 0;
            for &i in &f.units {
                let n = self.padded[i];
                let dst = self.acc[i]
                    .as_mut()
                    .or(self.grads[i].as_mut())
                    .expect("a gradient home");
                dst.store_from(0, &buf, off, n, add);
                off += n;
            }
        } else {
            let section = buf.len() / world;
            let mut off = rank * section;
            for &i in &f.units {
                let s = self.shard[i];
                match self.acc[i].as_mut() {
                    Some(acc) => acc.store_from(0, &buf, off, s, add),
                    None => self.grads[i]
                        .as_mut()
                        .expect("stage 1 grads are home")
                        .store_from(rank * s, &buf, off, s, add),
                }
                off += s;
            }
        }
        let mut buf = buf;
        buf.set_len(buf.capacity())?;
        self.free.push(buf);
        Ok(())
    }

    /// Reduces what is left of this micro-batch (stage 1's deferred units,
    /// the open bucket) and waits for everything. Every unit must have
    /// been handed back. Returns the bytes sent.
    pub(crate) fn finish<C: Communicator>(
        &mut self,
        comm: &C,
        tracer: &Tracer,
        add: bool,
    ) -> Result<u64> {
        let mut sent = 0;
        for i in std::mem::take(&mut self.deferred) {
            let buf = self.grads[i].take().expect("deferred grads are home");
            sent += self.add_to_bucket(comm, tracer, i, buf, add)?;
        }
        sent += self.launch_open(comm, tracer, add)?;
        while !self.inflight.is_empty() {
            self.complete_oldest(tracer, add)?;
        }
        for s in &mut self.state {
            *s = GradState::Empty;
        }
        Ok(sent)
    }

    /// Takes back unit `i`'s gradient buffer that the trainer dropped
    /// without handing it back (an error path): the unit has no gradient
    /// in this micro-batch, and the buffer is home again.
    pub(crate) fn take_back_unused(&mut self, i: usize, buf: DynBuf) {
        if self.state[i] == GradState::Lent {
            self.state[i] = GradState::Empty;
        }
        if self.stage <= 1 {
            self.grads[i] = Some(buf);
        } else {
            self.pool.entry(buf.len()).or_default().push(buf);
        }
    }

    /// Ends a micro-batch that will not be stepped (after an error):
    /// waits for the reductions in flight (every rank launched them),
    /// drops the open bucket and stage 1's deferred units, and zeroes the
    /// homes. No unit may be lent.
    pub(crate) fn abort(&mut self, tracer: &Tracer) -> Result<()> {
        while !self.inflight.is_empty() {
            self.complete_oldest(tracer, false)?;
        }
        if let Some(open) = self.open.take() {
            let mut buf = open.buf;
            buf.set_len(buf.capacity())?;
            self.free.push(buf);
        }
        self.deferred.clear();
        self.zero();
        Ok(())
    }

    /// Drops the accumulated gradients (the homes are zeroed).
    pub(crate) fn zero(&mut self) {
        for s in &mut self.state {
            *s = GradState::Empty;
        }
        for h in self.acc.iter_mut().chain(self.grads.iter_mut()).flatten() {
            h.fill_zero();
        }
    }
}
