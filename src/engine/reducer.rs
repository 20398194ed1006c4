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
//!
//! # Streams and events
//!
//! Buckets, gradient homes and gradient buffers are buffers of the
//! engine's [`CpuBackend`], and every ordering decision of the gradient
//! path is made here, explicitly:
//!
//! ```text
//!  compute  ─[fill 0]─[backward (lent)]─[pack → bucket]─●packed
//!                                                        ╲ wait (device collective)
//!  comm     ──────────────────────────────────────────────◆─[reduce]─●done─[unpack → homes]─●unpacked
//!                                                                                          ╲
//!  compute  (a bucket reused for packing waits for its ●unpacked) ◆   finish: compute waits for
//!                                                                        the last ●unpacked (norm, AdamW)
//! ```
//!
//! - `lend`: the buffer is zeroed on the compute stream and lent to the
//!   trainer as the operation `backward` on the compute stream
//!   ([`CpuBackend::lend`]): the trainer's writes are compute-stream work,
//!   and `hand_back` takes the memory back under the same id
//!   ([`CpuBackend::give_back`]), so the checker follows the buffer across
//!   micro-batches and nothing is allocated or copied.
//! - `pack` runs on the compute stream, after the trainer's work (program
//!   order); the collective starts on the communication stream after the
//!   event `packed` recorded after the last pack;
//! - its completion event orders the `unpack` of this rank's section into
//!   the homes on the communication stream; the event recorded after it
//!   is what the compute stream waits for before packing into that bucket
//!   again; [`GradReducer::finish`] makes the compute stream wait for the
//!   last one (the optimizer's norm and AdamW read the homes there), and
//!   the host syncs the compute stream before it reads or zeroes them.
//!
//! In the backend's `Inline` mode (production) every call runs at once and
//! events are empty values; in `Checked`/`Chaos` mode the hazard checker
//! proves each access ordered.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use zero_comm::ReduceOp;
use zero_core::backend::{HostAccess, PackPiece, Stream, UnpackPiece};
use zero_core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero_core::memory::{Allocation, Category, MemoryTracker, Tier};
use zero_core::partition::{PartitionPlan, UnitLayout};
use zero_core::{DType, Element};

use super::backend::EngineComm;
use super::ctx::Ctx;
use super::devbuf::{map_dev, with_dev, DevBuf, DynHost, DynLoan, DynWork};
use super::dynbuf::{ring_bytes, DynBuf};
use super::grad_swap::GradSwap;
use super::lease::{GradBuffer, Returns};
use super::stats::EngineStats;
use crate::plan::{bucket_plan, overlaps};
use crate::trace::Tracer;
use crate::{Error, Result};

/// Test-only (feature `testing`): one wait of the gradient path that
/// `EngineBuilder::skip_wait_for_tests` removes, to prove that the
/// backend's hazard checker catches it.
#[doc(hidden)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipWait {
    /// The collective starts after an event of the communication stream
    /// instead of the compute stream's `packed`: the communication stream
    /// does not wait for the packing of the bucket.
    PackBeforeReduce,
    /// [`GradReducer::finish`] does not make the compute stream wait for
    /// the last unpack before the optimizer's kernels read the homes.
    HomesBeforeOptimizer,
    /// The parameter all-gathers (stage 3's of a unit's shard, stages
    /// 1–2's of the updated parameters) start after an event of the
    /// communication stream instead of the compute stream's: they do not
    /// wait for the copy of the shard or for AdamW.
    ParamsBeforeGather,
    /// Stage 3 with `frozen_params` `shard` or `offload`: the compute
    /// stream does not wait for the all-gather of a unit's frozen segment
    /// before the trainer reads it where it landed.
    FrozenBeforeRead,
}

/// Where a unit's gradient of the current micro-batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GradState {
    /// Not handed out in this micro-batch.
    Empty,
    /// The trainer holds the buffer.
    Lent,
    /// Handed back: in a bucket, in flight, or reduced.
    Ready,
    /// The unit has only frozen tensors: it never has a gradient.
    Frozen,
}

/// How a trainer gets out of a micro-batch that failed part way (some
/// units handed their gradients back, the others never will): the engine
/// cannot tell a failed micro-batch from a unit's gradient given twice, so
/// the trainer says so with `zero_grad`.
const RECOVER: &str = "if a micro-batch failed part way, call zero_grad() on every rank to drop \
                       it (and the gradients accumulated since the last optimizer step), then \
                       run the next micro-batch";

impl GradState {
    /// Whether `grad_buffer` may lend unit `name`'s buffer (`Err`: why not).
    pub(crate) fn check_lend(self, name: &str) -> std::result::Result<(), String> {
        match self {
            GradState::Empty => Ok(()),
            GradState::Ready => Err(format!(
                "grad_buffer(`{name}`): grad_ready was already called for this unit in this \
                 micro-batch; {RECOVER}"
            )),
            GradState::Lent => Err(format!(
                "grad_buffer(`{name}`): the buffer is already lent; hand it back with grad_ready"
            )),
            GradState::Frozen => Err(frozen_unit(name, "grad_buffer")),
        }
    }

    /// Whether `grad_ready` may take unit `name`'s buffer back (`Err`: why
    /// not).
    pub(crate) fn check_hand_back(self, name: &str) -> std::result::Result<(), String> {
        match self {
            GradState::Lent => Ok(()),
            GradState::Ready => Err(format!(
                "grad_ready(`{name}`) called twice in one micro-batch; {RECOVER}"
            )),
            GradState::Empty => Err(format!(
                "grad_ready(`{name}`): take the buffer with grad_buffer first"
            )),
            GradState::Frozen => Err(frozen_unit(name, "grad_ready")),
        }
    }
}

/// The refusal of a gradient call on a unit with only frozen tensors.
fn frozen_unit(name: &str, call: &str) -> String {
    format!(
        "{call}(`{name}`): the unit has only frozen tensors (TensorSpec::frozen), so it has no \
         gradient; leave it out of the backward pass"
    )
}

/// `len` elements of `src[src_at..]` into `dst[dst_at..]`, converting, on
/// the compute stream.
fn pack<B: HostAccess>(
    backend: &B,
    src: &DevBuf<B>,
    src_at: usize,
    dst: &mut DevBuf<B>,
    dst_at: usize,
    len: usize,
) -> Result<()> {
    with_dev!(dst, d => with_dev!(src, s => {
        let piece = PackPiece::<B, _> { src: s, src_at, dst_at, len };
        backend.pack(Stream::Compute, std::slice::from_ref(&piece), d)?
    }));
    Ok(())
}

/// `len` elements of `src[src_at..]` into `dst[dst_at..]`, converting (or
/// adding), on the communication stream.
#[allow(clippy::too_many_arguments)]
fn unpack<B: HostAccess>(
    backend: &B,
    src: &DevBuf<B>,
    src_at: usize,
    dst: &mut DevBuf<B>,
    dst_at: usize,
    len: usize,
    add: bool,
) -> Result<()> {
    with_dev!(dst, d => with_dev!(src, s => {
        let mut piece = UnpackPiece::<B, _> { dst: d, dst_at, src_at, len };
        backend.unpack(Stream::Comm, s, std::slice::from_mut(&mut piece), add)?
    }));
    Ok(())
}

/// Moves `buf[src..src + len]` down to `buf[dst..]` (`dst < src`) on the
/// compute stream, in pieces that do not overlap (the backend's
/// `copy_within` copies disjoint ranges only).
fn move_down<B: HostAccess>(
    backend: &B,
    buf: &mut DevBuf<B>,
    src: usize,
    dst: usize,
    len: usize,
) -> Result<()> {
    let step = src - dst;
    let mut done = 0;
    while done < len {
        let n = step.min(len - done);
        let from = src + done..src + done + n;
        with_dev!(&mut *buf, b => backend.copy_within(Stream::Compute, b, from, dst + done)?);
        done += n;
    }
    Ok(())
}

/// `swap_gradients`: stores unit `i`'s reduced section `src.0[src.1..][..s]`
/// through the window `w` (the host syncs each stream it reads after):
/// with `add` the unit's stored gradient is read into the window first;
/// the unpack runs on the communication stream, its norm term there too,
/// and the window's first `s` elements go to the swap file. On a device
/// the window goes through the host buffer `staged` (pinned on a GPU),
/// copied on the communication stream; else through host views.
fn store_unit<B: HostAccess, G: Element>(
    backend: &B,
    gs: &mut GradSwap,
    (w, staged): (&mut B::Buffer<G>, Option<&mut B::HostBuffer<G>>),
    src: (&DevBuf<B>, usize),
    (i, s, add): (usize, usize, bool),
) -> Result<()> {
    let (buf, off) = src;
    let mut staged = staged;
    if add {
        backend.sync(&backend.record(Stream::Comm)?)?;
        match staged.as_deref_mut() {
            Some(h) => {
                gs.load(i, backend.write_host(h, 0..s)?);
                backend.copy_h2d(Stream::Comm, h, 0, w, 0, s)?;
            }
            None => {
                let mut v = backend.host_mut(w, 0..s)?;
                gs.load(i, &mut v);
                backend.commit(v)?;
            }
        }
    }
    with_dev!(buf, b => {
        let mut piece = UnpackPiece::<B, _> { dst: &mut *w, dst_at: 0, src_at: off, len: s };
        backend.unpack(Stream::Comm, b, std::slice::from_mut(&mut piece), add)?;
    });
    let sums = backend.sum_squares(Stream::Comm, &[(&*w, gs.norm_range(i))])?;
    if let Some(h) = staged.as_deref_mut() {
        backend.copy_d2h(Stream::Comm, w, 0, h, 0, s)?;
    }
    backend.sync(&backend.record(Stream::Comm)?)?;
    let sum = backend.read_scalars(&sums)?[0];
    match staged {
        Some(h) => gs.store(i, backend.read_host(h, 0..s)?, sum),
        None => gs.store(i, &backend.host_ref(w, 0..s)?, sum),
    }
    Ok(())
}

/// A bucket of gradients being filled.
struct OpenBucket<B: HostAccess> {
    buf: DevBuf<B>,
    units: Vec<usize>,
    elems: usize,
}

/// A bucket whose reduction is in flight.
struct InFlight<B: HostAccess> {
    work: DynWork<B>,
    units: Vec<usize>,
}

/// A bucket ready to be packed into, and the event after which the
/// compute stream may write it (the unpack of its last reduction).
struct FreeBucket<B: HostAccess> {
    buf: DevBuf<B>,
    after: Option<B::Event>,
}

/// Gradient buckets and homes of one rank.
pub(crate) struct GradReducer<B: HostAccess> {
    /// The device the buckets, homes and gradient buffers live on.
    backend: B,
    /// Test-only: a wait left out (see [`SkipWait`]).
    skip: Option<SkipWait>,
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
    free: Vec<FreeBucket<B>>,
    open: Option<OpenBucket<B>>,
    inflight: VecDeque<InFlight<B>>,
    /// The event after the last unpack into the homes (what the host syncs
    /// before it touches them); `None` once synced.
    unpacked: Option<B::Event>,
    /// Stage 1: units handed back, reduced after the backward pass.
    deferred: Vec<usize>,
    /// Stages 2–3: transient full gradient buffers by length.
    pool: HashMap<usize, Vec<DevBuf<B>>>,
    /// Stages 0–1: the persistent full gradient buffer in P (`None` while
    /// lent).
    grads: Vec<Option<DevBuf<B>>>,
    /// The accumulated gradient in A: full (stage 0) or shard; `None` when
    /// it lives in `grads` (A = P without accumulation, stages 0/1, no
    /// optimizer offload). With optimizer offload it is the host-side
    /// gradient shard that feeds the CPU AdamW (accounted in the host
    /// tier).
    acc: Vec<Option<DevBuf<B>>>,
    /// `swap_gradients`: the accumulated shards live in this swap file
    /// (every `acc` is `None`), each unit unpacked into `window` and
    /// stored from there.
    gswap: Option<GradSwap>,
    window: Option<DevBuf<B>>,
    /// On a device: the host buffer (pinned on a GPU) the window goes
    /// through.
    window_host: Option<DynHost<B>>,
    /// The offloaded optimizer on a device (see `staging.rs`): a host
    /// copy of every gradient home, filled bucket by bucket on the
    /// device-to-host stream as the last micro-batch of a step reduces
    /// (empty otherwise) …
    staged: Vec<DynHost<B>>,
    /// … the event after the copies so far, for the step to wait for, and
    /// for the next writes of the homes (their unpacks on the
    /// communication stream, a zeroing by the host) …
    staged_copies: Option<B::Event>,
    homes_copied: Option<B::Event>,
    /// … and whether this micro-batch is the last of its step.
    last_micro: bool,
    /// The buffers lent to the trainer, by unit.
    loans: Vec<Option<DynLoan<B>>>,
    state: Vec<GradState>,
    allocs: Vec<Allocation>,
}

impl<B: HostAccess> GradReducer<B> {
    /// Allocates every gradient home and the bucket buffers of the memory
    /// plan on `backend` (from `comm`'s allocator, prefaulted: the step
    /// takes no page faults). `device_is_host`: the backend's buffers are
    /// host memory (the CPU backend), so the gradient homes that feed the
    /// offloaded optimizer are accounted in the host tier.
    pub(crate) fn new<C: EngineComm<B>>(
        cfg: &ResolvedConfig,
        plan: &PartitionPlan,
        comm: &C,
        tracker: &MemoryTracker,
        (backend, device_is_host): (B, bool),
        skip: Option<SkipWait>,
        gswap: Option<GradSwap>,
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
                let label = format!("grad `{}`", layout.name);
                let mut g = DevBuf::alloc(&backend, comm, pdt, full, &label)?;
                g.prefault(&backend)?;
                allocs.push(tracker.allocate(Tier::Device, Category::Grads, g.bytes()));
                Some(g)
            } else {
                None
            });
            acc.push(if alias || gswap.is_some() {
                None
            } else {
                let len = if stage == 0 { full } else { layout.shard_len };
                let label = format!("grad home `{}`", layout.name);
                let mut a = DevBuf::alloc(&backend, comm, adt, len, &label)?;
                a.prefault(&backend)?;
                // With optimizer offload on the CPU backend the gradient
                // shard feeding AdamW is host memory; on a device it is
                // device memory, read through host views at the step.
                let tier = if offloading && device_is_host {
                    Tier::Host
                } else {
                    Tier::Device
                };
                allocs.push(tracker.allocate(tier, Category::Grads, a.bytes()));
                Some(a)
            });
        }
        // swap_gradients: one home-sized window for the unit being stored.
        let window = match &gswap {
            Some(_) => {
                let len = plan.units().iter().map(|l| l.shard_len).max().unwrap_or(0);
                let mut w = DevBuf::alloc(&backend, comm, adt, len.max(1), "gradient window")?;
                w.prefault(&backend)?;
                let tier = if device_is_host {
                    Tier::Host
                } else {
                    Tier::Device
                };
                allocs.push(tracker.allocate(tier, Category::Grads, w.bytes()));
                Some(w)
            }
            None => None,
        };
        let (bucket_cap, count) = bucket_plan(cfg, plan);
        let overlap = overlaps(cfg);
        let mut free = Vec::new();
        for k in 0..count {
            let mut b = DevBuf::alloc(&backend, comm, cdt, bucket_cap, &format!("bucket {k}"))?;
            b.prefault(&backend)?;
            allocs.push(tracker.allocate(Tier::Device, Category::CommBuffers, b.bytes()));
            free.push(FreeBucket {
                buf: b,
                after: None,
            });
        }
        let n = plan.units().len();
        Ok(GradReducer {
            backend,
            skip,
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
            unpacked: None,
            deferred: Vec::new(),
            pool: HashMap::new(),
            grads,
            acc,
            gswap,
            window,
            window_host: None,
            staged: Vec::new(),
            staged_copies: None,
            homes_copied: None,
            last_micro: cfg.gradient_accumulation_steps <= 1,
            loans: (0..n).map(|_| None).collect(),
            state: plan
                .units()
                .iter()
                .map(|u| {
                    if u.is_trainable() {
                        GradState::Empty
                    } else {
                        GradState::Frozen
                    }
                })
                .collect(),
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

    /// Call `call` is refused while the gradient buffer of a unit is out
    /// (`name(i)` names unit `i`).
    pub(crate) fn check_none_lent<'a>(
        &self,
        call: &str,
        name: impl Fn(usize) -> &'a str,
    ) -> std::result::Result<(), String> {
        match self.find(GradState::Lent) {
            Some(i) => Err(format!(
                "{call}() while the gradient buffer of unit `{}` is still out; hand it back \
                 with grad_ready or drop it",
                name(i)
            )),
            None => Ok(()),
        }
    }

    /// Whether the micro-batch has every unit's gradient back for
    /// `step()` (`Err`: why not; `name(i)` names unit `i`).
    pub(crate) fn check_complete<'a>(
        &self,
        name: impl Fn(usize) -> &'a str,
    ) -> std::result::Result<(), String> {
        self.check_none_lent("step", &name)?;
        let missing: Vec<&str> = (0..self.state.len())
            .filter(|&j| self.state(j) == GradState::Empty)
            .map(&name)
            .collect();
        if let Some(first) = missing.first() {
            return Err(format!(
                "step(): no gradient for unit `{first}` in this micro-batch ({} of {} units have \
                 none: {}); every unit needs grad_buffer + grad_ready in every micro-batch (a \
                 buffer dropped on an error path gives none); call zero_grad() to drop this \
                 micro-batch",
                missing.len(),
                self.state.len(),
                missing.join(", ")
            ));
        }
        Ok(())
    }

    /// Whether no reduction is open or in flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.open.is_none() && self.inflight.is_empty()
    }

    /// Whether unit gradients are accumulated in a separate buffer (in the
    /// accumulation dtype, the rank's shard beyond stage 0).
    pub(crate) fn has_acc(&self, i: usize) -> bool {
        self.acc[i].is_some() || self.gswap.is_some()
    }

    /// With `swap_gradients`: the swap file of the accumulated shards.
    pub(crate) fn grad_swap(&self) -> Option<&GradSwap> {
        self.gswap.as_ref()
    }

    /// With `swap_gradients`: the swap file of the accumulated shards.
    pub(crate) fn grad_swap_mut(&mut self) -> Option<&mut GradSwap> {
        self.gswap.as_mut()
    }

    /// The gradient home of unit `i`: the separate accumulation buffer, or
    /// the persistent one.
    /// The offloaded optimizer on a device: every gradient home gets a
    /// host copy (accounted in the host tier), filled as the last
    /// micro-batch of each step reduces.
    pub(crate) fn stage_homes(&mut self, tracker: &MemoryTracker) -> Result<()> {
        for i in 0..self.acc.len() {
            let home = self.home(i);
            let h = DynHost::alloc(
                &self.backend,
                home.dtype(),
                home.len(),
                &format!("staged grads {i}"),
            )?;
            self.allocs
                .push(tracker.allocate(Tier::Host, Category::Grads, h.bytes()));
            self.staged.push(h);
        }
        Ok(())
    }

    /// `swap_gradients` on a device: the window goes to and from the swap
    /// file through a host buffer of its size (accounted in the host tier).
    pub(crate) fn stage_window(&mut self, tracker: &MemoryTracker) -> Result<()> {
        if let Some(w) = &self.window {
            let h = DynHost::alloc(&self.backend, w.dtype(), w.len(), "gradient window (host)")?;
            self.allocs
                .push(tracker.allocate(Tier::Host, Category::Grads, h.bytes()));
            self.window_host = Some(h);
        }
        Ok(())
    }

    /// Whether the micro-batch being reduced is the last of its step.
    fn set_last_micro(&mut self, last: bool) {
        self.last_micro = last;
    }

    /// The host copies of every gradient home (see
    /// [`GradReducer::stage_homes`]) once the last micro-batch reduced:
    /// the host waits for the copies.
    pub(crate) fn staged_homes<G: Element>(&mut self) -> Result<Vec<&[G]>> {
        let copies = self.staged_copies.take().ok_or_else(|| {
            self.internal("the staged gradients were not copied down in this step")
        })?;
        self.backend.sync(&copies)?;
        self.staged
            .iter()
            .map(|h| {
                let t = h.typed::<G>().ok_or_else(|| {
                    Error::from(zero_core::Error::DTypeMismatch {
                        op: "GradReducer::staged_homes",
                        expected: h.dtype(),
                        got: G::DTYPE,
                    })
                })?;
                Ok(self.backend.read_host(t, 0..h.len())?)
            })
            .collect()
    }

    fn home(&self, i: usize) -> &DevBuf<B> {
        self.acc[i]
            .as_ref()
            .or(self.grads[i].as_ref())
            .expect("a gradient home")
    }

    /// The reduced (and accumulated) gradient of unit `i`, for the host to
    /// read: a checked host read, valid once the host synced the compute
    /// stream after [`GradReducer::finish`] (the optimizer's norm does).
    /// `G` must be [`home_dtype`](Self::home_dtype).
    pub(crate) fn home_slice<G: Element>(&self, i: usize) -> Result<B::HostRef<'_, G>> {
        let home = self.home(i);
        home.host_ref::<G>(&self.backend)?.ok_or_else(|| {
            Error::from(zero_core::Error::DTypeMismatch {
                op: "GradReducer::home_slice",
                expected: home.dtype(),
                got: G::DTYPE,
            })
        })
    }

    /// The reduced (and accumulated) gradient of unit `i` on the device,
    /// for the optimizer's kernels (after [`GradReducer::finish`]). `G`
    /// must be [`home_dtype`](Self::home_dtype).
    pub(crate) fn home_buf<G: Element>(&self, i: usize) -> Result<&B::Buffer<G>> {
        let home = self.home(i);
        home.typed::<G>().ok_or_else(|| {
            Error::from(zero_core::Error::DTypeMismatch {
                op: "GradReducer::home_buf",
                expected: home.dtype(),
                got: G::DTYPE,
            })
        })
    }

    /// The dtype of the gradient homes (one for every unit).
    pub(crate) fn home_dtype(&self) -> Option<DType> {
        if self.state.is_empty() {
            return None;
        }
        Some(match &self.gswap {
            Some(g) => g.dtype(),
            None => self.home(0).dtype(),
        })
    }

    /// Lends unit `i`'s gradient buffer to the trainer, zeroed: the
    /// persistent one (stages 0/1) or one from the pool (stages 2/3). It
    /// is zeroed on the compute stream and lent as the compute stream's
    /// operation `backward`. `add`: later micro-batches of a step
    /// accumulate into the homes.
    pub(crate) fn lend<C: EngineComm<B>>(
        &mut self,
        comm: &C,
        tracker: &MemoryTracker,
        tracer: &Tracer,
        i: usize,
        add: bool,
    ) -> Result<DynBuf<B>> {
        let mut buf = self.take_buffer(comm, tracker, tracer, i, add)?;
        buf.fill_zero(&self.backend, Stream::Compute)?;
        let (loan, mem) = buf.lend(&self.backend)?;
        self.loans[i] = Some(loan);
        self.state[i] = GradState::Lent;
        Ok(mem)
    }

    /// [`GradReducer::lend`], typed as the trainer asked (`T`) and handed
    /// out as a [`GradBuffer`] (which goes back to `returns` if dropped):
    /// refused unless `T` is the parameter dtype and unit `i` (of `layout`)
    /// may lend its buffer now ([`GradState::check_lend`]).
    pub(crate) fn lend_as<T: Element, C: EngineComm<B>>(
        &mut self,
        cx: &Ctx<C, B>,
        (i, layout): (usize, &Arc<UnitLayout>),
        add: bool,
        returns: &Returns<B>,
    ) -> Result<GradBuffer<T, B>> {
        let mismatch = zero_core::Error::DTypeMismatch {
            op: "Engine::grad_buffer",
            expected: self.pdt,
            got: T::DTYPE,
        };
        if T::DTYPE != self.pdt {
            return Err(mismatch.into());
        }
        let rank = self.rank;
        let lend = self.state(i).check_lend(&layout.name);
        lend.map_err(|what| Error::Usage { rank, what })?;
        let buf = self.lend(&cx.comm, &cx.tracker, &cx.tracer, i, add)?;
        let typed = buf.into_lent::<T>().map_err(|_| mismatch)?;
        let (owner, backend) = ((i, layout.clone(), rank), self.backend.clone());
        Ok(GradBuffer::new(typed, owner, returns.clone(), backend))
    }

    fn internal(&self, what: &str) -> Error {
        Error::Usage {
            rank: self.rank,
            what: format!("internal: {what}"),
        }
    }

    /// The memory of unit `i`'s lent gradient buffer, back from the
    /// trainer under the lent buffer's id.
    fn give_back(&mut self, i: usize, mem: DynBuf<B>) -> Result<DevBuf<B>> {
        let loan = self.loans[i].take().ok_or_else(|| Error::Usage {
            rank: self.rank,
            what: format!("internal: unit #{i}'s gradient buffer came back but was not lent"),
        })?;
        loan.give_back(&self.backend, mem, self.rank)
    }

    /// Takes unit `i`'s gradient buffer back from the trainer (`mem`), in
    /// a micro-batch that is not the step's first (`add`: it accumulates
    /// into the homes) or is its last (`last`): it joins the current
    /// bucket, which is reduced as soon as it is full (stages 0, 2, 3
    /// while backward goes on, under a `reduce` span, counted in `stats`;
    /// stage 1 after backward, in [`GradReducer::finish`]).
    pub(crate) fn hand_back<C: EngineComm<B>>(
        &mut self,
        (comm, tracer, stats): (&C, &Tracer, &mut EngineStats),
        i: usize,
        mem: DynBuf<B>,
        (add, last): (bool, bool),
    ) -> Result<()> {
        self.set_last_micro(last);
        if self.stage == 1 {
            return self.take_grad(comm, tracer, i, mem, add).map(|_| ());
        }
        self.timed(tracer, stats, |r| r.take_grad(comm, tracer, i, mem, add))
    }

    /// Runs `f` (a reduction; it returns the bytes sent) under a `reduce`
    /// span, its time and bytes counted in `stats`.
    fn timed(
        &mut self,
        tracer: &Tracer,
        stats: &mut EngineStats,
        f: impl FnOnce(&mut Self) -> Result<u64>,
    ) -> Result<()> {
        let _span = tracer.span(self.rank, "reduce", "comm");
        let t = Instant::now();
        let r = f(self);
        stats.reduce_time += t.elapsed();
        stats.reduce_bytes += r?;
        Ok(())
    }

    /// [`GradReducer::hand_back`]'s work; the bytes sent.
    fn take_grad<C: EngineComm<B>>(
        &mut self,
        comm: &C,
        tracer: &Tracer,
        i: usize,
        mem: DynBuf<B>,
        add: bool,
    ) -> Result<u64> {
        let buf = self.give_back(i, mem)?;
        self.state[i] = GradState::Ready;
        if let (true, Some(gs)) = (add, self.gswap.as_mut()) {
            // Its stored gradient is read while the bucket fills and
            // reduces.
            gs.prefetch(i);
        }
        if self.stage == 1 {
            self.grads[i] = Some(buf);
            self.deferred.push(i);
            return Ok(0);
        }
        self.add_to_bucket(comm, tracer, i, buf, add)
    }

    /// Unit `i`'s gradient buffer, not zeroed.
    fn take_buffer<C: EngineComm<B>>(
        &mut self,
        comm: &C,
        tracker: &MemoryTracker,
        tracer: &Tracer,
        i: usize,
        add: bool,
    ) -> Result<DevBuf<B>> {
        if self.stage <= 1 {
            self.wait_for_home(comm, tracer, i, add)?;
            return Ok(self.grads[i].take().expect("grad buffer is home"));
        }
        let len = self.padded[i];
        if let Some(b) = self.pool.get_mut(&len).and_then(Vec::pop) {
            return Ok(b);
        }
        let label = format!("grad buffer of {len} elements");
        let b = DevBuf::alloc(&self.backend, comm, self.pdt, len, &label)?;
        // Transient gradient buffers stay in the pool: accounted as
        // gradients for as long as they exist.
        self.allocs
            .push(tracker.allocate(Tier::Device, Category::Grads, b.bytes()));
        Ok(b)
    }

    /// Stage 0/1: the unit's gradient buffer may sit in a bucket (stage 0
    /// with reductions in flight): drain until it is home.
    fn wait_for_home<C: EngineComm<B>>(
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

    /// Packs unit `i`'s gradient into the open bucket on the compute
    /// stream (converting to the communication dtype) and gives the
    /// gradient buffer back at once (stages 2/3: to the pool, so only the
    /// units in flight hold full gradients; its next user writes it on the
    /// compute stream, after the pack). The bucket starts its reduction
    /// when full. Layout: stage 0 puts the units one after another; stages
    /// 1–3 group the units' shards by rank, in sections of
    /// `stride = capacity / N`:
    ///
    /// ```text
    ///  units a, b:   a = [a0 a1]  b = [b0 b1]     (shard r of each unit)
    ///  buffer:       [a0 b0 .. | a1 b1 ..]  → rank r receives section r
    /// ```
    fn add_to_bucket<C: EngineComm<B>>(
        &mut self,
        comm: &C,
        tracer: &Tracer,
        i: usize,
        grad: DevBuf<B>,
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
            let f = self.free.pop().expect("a bucket buffer is free");
            // The compute stream packs into it only after the unpack of
            // its last reduction read it.
            if let Some(ev) = &f.after {
                self.backend.wait(Stream::Compute, ev)?;
            }
            self.open = Some(OpenBucket {
                buf: f.buf,
                units: Vec::new(),
                elems: 0,
            });
        }
        let b = self.open.as_mut().expect("opened above");
        if self.stage == 0 {
            pack(&self.backend, &grad, 0, &mut b.buf, b.elems, n)?;
        } else {
            let shard = n / world;
            let at = b.elems / world;
            for r in 0..world {
                pack(
                    &self.backend,
                    &grad,
                    r * shard,
                    &mut b.buf,
                    r * stride + at,
                    shard,
                )?;
            }
        }
        b.units.push(i);
        b.elems += n;
        let full = b.elems >= self.bucket_size.min(self.bucket_cap);
        if self.stage <= 1 {
            self.grads[i] = Some(grad);
        } else {
            self.pool.entry(n).or_default().push(grad);
        }
        if full {
            sent += self.launch_open(comm, tracer, add)?;
        }
        Ok(sent)
    }

    /// Starts the reduction of the open bucket: all-reduce (stage 0) or
    /// reduce-scatter of the rank sections (stages 1–3), after closing the
    /// gaps between sections of a bucket that is not full (on the compute
    /// stream), on the communication stream after the event recorded
    /// after the packing. Returns the bytes sent.
    fn launch_open<C: EngineComm<B>>(
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
        let elems = open.elems;
        let section = elems / world;
        if self.stage > 0 {
            let stride = self.bucket_cap / world;
            if section < stride {
                for r in 1..world {
                    move_down(&self.backend, &mut buf, r * stride, r * section, section)?;
                }
            }
        }
        let backend = &self.backend;
        let packed = if self.skip == Some(SkipWait::PackBeforeReduce) {
            backend.record(Stream::Comm)?
        } else {
            backend.record(Stream::Compute)?
        };
        let all_reduce = self.stage == 0 || !self.reduce_scatter;
        let work = if all_reduce {
            // Stage 0; or `reduce_scatter: false`: all-reduce, keep this
            // rank's section (the same sums, twice the traffic).
            map_dev!(buf, DynWork, b => comm.device_all_reduce(backend, b, elems, ReduceOp::Sum, &packed))
        } else {
            let counts = vec![section; world];
            map_dev!(buf, DynWork, b => comm.device_reduce_scatter(backend, b, &counts, ReduceOp::Sum, &packed))
        };
        if work.is_refused() {
            // Refused (a hazard on the bucket, bad arguments): the bucket
            // is gone with it; report why now, before a later collective
            // fails on the failed communicator.
            return Err(work.wait(tracer, self.rank).err().unwrap_or_else(|| {
                self.internal("a refused reduction of the gradient bucket succeeded")
            }));
        }
        let sent = if all_reduce {
            ring_bytes(elems, world, self.cdt) * 2
        } else {
            ring_bytes(elems, world, self.cdt)
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

    /// Waits for the oldest bucket and, on the communication stream after
    /// its completion event, stores its result in the units' homes
    /// (`add`: adds it).
    fn complete_oldest(&mut self, tracer: &Tracer, add: bool) -> Result<()> {
        let Some(f) = self.inflight.pop_front() else {
            return Ok(());
        };
        let (buf, done) = f.work.wait(tracer, self.rank)?;
        // With optimizer offload the accumulated shard is host memory:
        // this is the device→host copy of the reduced gradient.
        let _span = self
            .offloading
            .then(|| tracer.span(self.rank, "grad to host", "offload"));
        let backend = &self.backend;
        backend.wait(Stream::Comm, &done)?;
        if let Some(copied) = self.homes_copied.take() {
            // The homes were copied down in the last step: rewrite them
            // after that.
            backend.wait(Stream::Comm, &copied)?;
        }
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
                unpack(backend, &buf, off, dst, 0, n, add)?;
                off += n;
            }
        } else {
            let elems: usize = f.units.iter().map(|&i| self.padded[i]).sum();
            let section = elems / world;
            let mut off = rank * section;
            for &i in &f.units {
                let s = self.shard[i];
                if let (Some(gs), Some(w)) = (self.gswap.as_mut(), self.window.as_mut()) {
                    let wh = self.window_host.as_mut();
                    let _span = tracer.span(rank, "grad to swap", "offload");
                    with_dev!(&mut *w, b => {
                        let h = wh.and_then(|h| h.typed_mut());
                        store_unit(backend, gs, (b, h), (&buf, off), (i, s, add))?
                    });
                    off += s;
                    continue;
                }
                match self.acc[i].as_mut() {
                    Some(acc) => unpack(backend, &buf, off, acc, 0, s, add)?,
                    None => {
                        let g = self.grads[i].as_mut().expect("stage 1 grads are home");
                        unpack(backend, &buf, off, g, rank * s, s, add)?;
                    }
                }
                off += s;
            }
        }
        let unpacked = backend.record(Stream::Comm)?;
        if self.last_micro && !self.staged.is_empty() {
            // The offloaded optimizer on a device: these units' homes are
            // final; down to the host while the backward pass goes on.
            backend.wait(Stream::DeviceToHost, &unpacked)?;
            for &i in &f.units {
                let home = self.acc[i]
                    .as_ref()
                    .expect("offloading keeps separate homes");
                home.copy_to_host(
                    backend,
                    Stream::DeviceToHost,
                    &mut self.staged[i],
                    home.len(),
                )?;
            }
            let copied = backend.record(Stream::DeviceToHost)?;
            self.staged_copies = Some(copied.clone());
            self.homes_copied = Some(copied);
        }
        self.free.push(FreeBucket {
            buf,
            after: Some(unpacked.clone()),
        });
        self.unpacked = Some(unpacked);
        Ok(())
    }

    /// The host waits for the last unpack into the homes: from here on it
    /// may read and write them.
    fn sync_homes(&mut self) -> Result<()> {
        if let Some(ev) = self.unpacked.take() {
            self.backend.sync(&ev)?;
        }
        Ok(())
    }

    /// Reduces what is left of this micro-batch (stage 1's deferred units,
    /// the open bucket), waits for everything and makes the compute stream
    /// wait for the last unpack into the homes (the optimizer's kernels
    /// read them there; the host reads them only after the norm's sync).
    /// Every unit must have been handed back. `add` and `last` as in
    /// [`GradReducer::hand_back`]; timed into `stats` under a `reduce`
    /// span.
    pub(crate) fn finish<C: EngineComm<B>>(
        &mut self,
        (comm, tracer, stats): (&C, &Tracer, &mut EngineStats),
        (add, last): (bool, bool),
    ) -> Result<()> {
        self.set_last_micro(last);
        self.timed(tracer, stats, |r| r.finish_micro(comm, tracer, add))
    }

    /// [`GradReducer::finish`]'s work; the bytes sent.
    fn finish_micro<C: EngineComm<B>>(
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
        for s in self.state.iter_mut().filter(|s| **s != GradState::Frozen) {
            *s = GradState::Empty;
        }
        // The optimizer's kernels (norm, AdamW) read the homes on the
        // compute stream.
        match self.unpacked.take() {
            Some(_) if self.skip == Some(SkipWait::HomesBeforeOptimizer) => {}
            Some(ev) => self.backend.wait(Stream::Compute, &ev)?,
            None => {}
        }
        Ok(sent)
    }

    /// Takes back unit `i`'s gradient buffer that the trainer dropped
    /// without handing it back (an error path): the unit has no gradient
    /// in this micro-batch, and the buffer is home again.
    pub(crate) fn take_back_unused(&mut self, i: usize, mem: DynBuf<B>) -> Result<()> {
        let buf = self.give_back(i, mem)?;
        if self.state[i] == GradState::Lent {
            self.state[i] = GradState::Empty;
        }
        if self.stage <= 1 {
            self.grads[i] = Some(buf);
        } else {
            self.pool.entry(buf.len()).or_default().push(buf);
        }
        Ok(())
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
            // Its last access was a pack on the compute stream: the next
            // pack into it is ordered after that.
            self.free.push(FreeBucket {
                buf: open.buf,
                after: None,
            });
        }
        self.deferred.clear();
        self.zero()
    }

    /// Drops the accumulated gradients: the host syncs the last unpack and
    /// every pack (the gradient buffers are read by packs), then zeroes the
    /// homes.
    pub(crate) fn zero(&mut self) -> Result<()> {
        for s in self.state.iter_mut().filter(|s| **s != GradState::Frozen) {
            *s = GradState::Empty;
        }
        self.sync_homes()?;
        if let Some(copied) = self.homes_copied.take() {
            self.backend.sync(&copied)?;
        }
        let packed = self.backend.record(Stream::Compute)?;
        self.backend.sync(&packed)?;
        let backend = &self.backend;
        for h in self.acc.iter_mut().chain(self.grads.iter_mut()).flatten() {
            h.host_zero(backend)?;
        }
        if let Some(gs) = self.gswap.as_mut() {
            gs.reset();
        }
        Ok(())
    }
}

impl<B: HostAccess> Drop for GradReducer<B> {
    /// Buffers still used by a stream (an error left work unsynced) are
    /// waited for before they are freed; an error is not reported here
    /// (`Drop` never fails).
    fn drop(&mut self) {
        let _ = self.backend.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zero_core::backend::{Backend, CpuBackend, CpuMode};

    /// `move_down` is `copy_within` (memmove) on the backend, also when
    /// the ranges overlap (the backend copies disjoint ranges only), on a
    /// checked backend.
    #[test]
    fn move_down_is_memmove() {
        for mode in [
            CpuMode::Inline,
            CpuMode::Checked,
            CpuMode::Chaos { seed: 7 },
        ] {
            let dev = CpuBackend::new(mode).unwrap();
            for (src, dst, len) in [(10, 0, 5), (10, 8, 7), (10, 9, 20), (64, 1, 64), (5, 4, 1)] {
                let n = src + len + 3;
                let init: Vec<f32> = (0..n).map(|x| x as f32).collect();
                let mut mem = zero_core::HostBuffer::<f32>::zeros(n).unwrap();
                mem.copy_from_slice(&init);
                let mut buf = DevBuf::F32(dev.wrap(mem, "bucket").unwrap());
                move_down(&dev, &mut buf, src, dst, len).unwrap();
                let done = dev.record(Stream::Compute).unwrap();
                dev.sync(&done).unwrap();
                let mut want = init.clone();
                want.copy_within(src..src + len, dst);
                let got = buf.host_ref::<f32>(&dev).unwrap().unwrap();
                assert_eq!(got, &want[..], "{mode:?} {src} {dst} {len}");
            }
        }
    }
}
