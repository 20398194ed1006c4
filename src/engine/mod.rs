//! The ZeRO engine: stages 0–3 over any [`Communicator`].
//!
//! A trainer registers its parameters as *units* (a layer, an embedding),
//! each one flat buffer of named tensors, then drives every micro-batch:
//!
//! ```text
//!  forward:   gather(u) → params(u) → … → release(u)        for each unit
//!  backward:  gather(u) → grad_buffer(u) → write grads → release(u)
//!             → grad_ready(u, grads)                        (reverse order)
//!  step()     after every micro-batch; the optimizer runs on the
//!             gradient_accumulation_steps-th
//! ```
//!
//! What each stage keeps per rank (Ψ parameters, N ranks; P, A, C the
//! parameter, gradient-accumulation and communication dtypes):
//!
//! | stage | params (P) | grads | fp32 master, m, v | gradient reduction |
//! |---|---|---|---|---|
//! | 0 | full | full P (+ full A) | full | all-reduce per bucket during backward |
//! | 1 | full | full P (+ shard A) | shard | reduce-scatter after backward, in buckets |
//! | 2 | full | shard A | shard | reduce-scatter per bucket during backward |
//! | 3 | shard, units gathered on demand | shard A | shard | as stage 2 |
//!
//! The separate A buffer of stages 0 and 1 is not needed (the reduced
//! gradient stays in the P buffer) when A = P and there is no gradient
//! accumulation: then model states are exactly ZeRO's 16Ψ, 4Ψ+12Ψ/N,
//! 2Ψ+14Ψ/N, 16Ψ/N for bf16, plus the padding of [`zero_core::partition`].
//!
//! # Arithmetic (identical in every stage)
//! Per micro-batch, each unit's gradient is converted to C, summed over
//! ranks in rank order with f32 accumulation (the communicator's reference
//! reduction), and stored in A (the first micro-batch of a step writes,
//! later ones add in f32). At the step, the gradient norm is the sum over
//! ranks (in rank order) of each rank's [`sum_squares`](zero_core::optim::sum_squares) over its shard of
//! every unit (in unit order); the AdamW update is
//! [`adamw_reference`](zero_core::optim::adamw_reference) with `grad_scale = clip / (loss_scale · N · GA)`.
//! Every stage performs these operations on the same values in the same
//! order, so all stages give bit-identical parameters and optimizer state
//! at the same world size.
//!
//! # Optimizer offload (ZeRO-Offload)
//! With `zero_optimization.offload_optimizer.device` `"cpu"` or `"nvme"`
//! (any stage; the JSON parser asks for stage 1–3, as DeepSpeed), the
//! rank's fp32 master, `m` and `v` leave the device tier: they live in
//! page-aligned, pre-faulted host buffers (`pin_memory` locks them) or in
//! a per-rank swap file under `nvme_path`, and the accumulated gradient
//! shard is host memory. AdamW runs tile by tile (`sub_group_size`
//! elements of the rank's flat state, across units), pipelined with the
//! reads and writes of the swap file (`buffer_count` host buffers). The
//! results are bit-identical to those without offload. See
//! `src/engine/offload.rs` for the layout and the pipeline.
//!
//! A swap-file error (truncated, corrupted, deleted or foreign file, a
//! failed write) fails the step on every rank: the rank whose file failed
//! reports the file, the others name that rank. From then on
//! [`Engine::step`] and the gradient calls return an error saying so,
//! while [`Engine::gather`], [`Engine::params`] and [`Engine::release`]
//! keep working. What the state is then depends on the error:
//!
//! - A failed *write* (disk full, an I/O error) loses nothing: the tiles
//!   whose write failed are kept in host memory and the step completes
//!   on every rank (parameters, step count, parameter all-gather), then
//!   returns the error. The state after that step stays readable in full:
//!   [`Engine::unit_state`], [`Engine::save_checkpoint`] (to another
//!   disk) and [`Engine::export_safetensors`] work, and a run resumed from
//!   that checkpoint continues bit-identically.
//! - Any other error (a failed read; the file truncated, corrupted,
//!   deleted or foreign) loses the optimizer state: no rank's parameters
//!   change in that step (updated parameters are committed only once every
//!   rank's tiles were read, updated and written, or kept), gather/params
//!   give the parameters of the last completed step, and
//!   [`Engine::unit_state`] and the checkpoint calls return an error.

//!
//! # Parameter offload (ZeRO-Infinity, stage 3)
//! With `zero_optimization.offload_param.device` `"cpu"` or `"nvme"`
//! (stage 3 only; other stages refuse it with an error naming the key),
//! the rank's shard of every unit, in the parameter dtype, lives in a
//! host pool (`cpu`, `pin_memory` honoured) or in the rank's parameter
//! swap file under `offload_param.nvme_path` (`nvme`), never on the device
//! tier. A gather copies the shard into the gathered unit (with `nvme`
//! from a read issued further ahead along the recorded order than the
//! all-gather prefetch, through `buffer_count` staging buffers of
//! `buffer_size` elements), and the optimizer step writes the updated
//! shard back home. With `nvme`, `offload_param.max_in_cpu` elements
//! (DeepSpeed's default 1e9) of shards are also cached in host memory
//! (filled at build, LRU, write-through): a cached shard is gathered
//! without a swap read ([`EngineStats::param_swap_reads`],
//! [`EngineStats::param_cache_hits`]); `max_in_cpu = 0` caches nothing.
//! Results are bit-identical to those without offload, with any optimizer
//! offload and any `max_in_cpu`. See `src/engine/param_offload.rs`.
//!
//! A parameter swap-file error (a failed read in a micro-batch, a
//! truncated or deleted file, a failed write-back) fails the next
//! [`Engine::step`] on every rank (the rank whose file failed names it);
//! the micro-batch that saw a failed read ran on zeros for that shard and
//! nothing of it is applied. The shards live only in the files, so from
//! then on [`Engine::gather`] refuses as well ("the parameters are lost").
//! With `offload_param` `"cpu"` and an optimizer swap-file error, the
//! shards are written home only after every rank's optimizer step
//! succeeded: the parameters of the last completed step stay readable.

mod checkpoint;
mod dynbuf;
mod export;
mod faults;
mod init;
mod offload;
mod param_offload;
mod stage3;

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use faults::FaultPlan;
use zero_comm::{Communicator, Work};
use zero_core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero_core::memory::{Allocation, Category, MemoryReport, MemoryTracker, Tier};
use zero_core::optim::{clip_coefficient, AdamWSlices, AdamWStep, CpuAdamW, LossScaler};
use zero_core::partition::{PartitionPlan, UnitLayout, UnitSpec};
use zero_core::{bf16, f16, DType, Device, Element, HostBuffer};

use crate::trace::Tracer;
use crate::{Error, Result};
pub use checkpoint::{CHECKPOINT_FORMAT, CHECKPOINT_VERSION};
use dynbuf::DynBuf;
pub use export::{export_checkpoint, ExportDtype};
pub use init::Init;
use init::{fnv1a, mix};
use offload::{Offload, UnitRanges};
use param_offload::ParamOffload;
use stage3::Stage3;

/// A registered unit of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnitId {
    engine: u64,
    index: usize,
}

impl UnitId {
    /// The unit's position in registration order.
    pub fn index(self) -> usize {
        self.index
    }
}

/// What [`Engine::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Whether this call ended a gradient-accumulation window (the
    /// optimizer ran or was skipped); `false` for the other micro-batches.
    pub boundary: bool,
    /// Whether the update was skipped (fp16 overflow, or a non-finite
    /// gradient norm in any precision): parameters are unchanged.
    pub skipped: bool,
    /// The global gradient norm (after unscaling, before clipping), at a
    /// boundary.
    pub grad_norm: Option<f64>,
    /// The learning rate the update used (or would have used).
    pub lr: f64,
    /// The loss scale for the next micro-batch.
    pub loss_scale: f32,
    /// Optimizer steps applied so far.
    pub steps: u64,
}

/// Time and traffic counters, for benchmarks and logs. Times are wall
/// time this rank spent in each phase; bytes are what this rank sent, as a
/// ring algorithm moves them ((N-1)/N of the buffer per reduce-scatter or
/// all-gather, twice that per all-reduce).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Waiting for, and storing, gradient reductions.
    pub reduce_time: Duration,
    /// Norm, clipping and AdamW.
    pub optimizer_time: Duration,
    /// Parameter all-gathers (stages 1–2 after the step; stage 3 gathers
    /// the trainer waited for).
    pub gather_time: Duration,
    /// Bytes sent for gradient reductions.
    pub reduce_bytes: u64,
    /// Bytes sent for parameter all-gathers.
    pub gather_bytes: u64,
    /// Bytes this rank read from a checkpoint's rank files in
    /// [`Engine::load_checkpoint`]: whole CRC blocks, those that hold the
    /// elements the rank needs, each read once without offload (with
    /// offload a block two ranges share may be read again, and with both
    /// optimizer and parameter offload the master twice).
    pub checkpoint_read_bytes: u64,
    /// Stage 3: most elements ever gathered at once (in use, kept for
    /// reuse, prefetched or persistent).
    pub peak_live_elems: usize,
    /// Stage 3: all-gathers issued ahead of use.
    pub prefetches: u64,
    /// Stage 3: gathers that found their unit already resident or in flight.
    pub prefetch_hits: u64,
    /// Stage 3 with `offload_param.device = "nvme"`: gathers whose shard
    /// read from the swap file was issued ahead of them.
    pub param_reads_ahead: u64,
    /// Stage 3 with `offload_param.device = "nvme"`: shard reads from the
    /// parameter swap file (a gather whose shard was not in the host cache
    /// of `offload_param.max_in_cpu` elements).
    pub param_swap_reads: u64,
    /// Stage 3 with `offload_param.device = "nvme"`: gathers whose shard
    /// came from the host cache (`offload_param.max_in_cpu`), with no swap
    /// read.
    pub param_cache_hits: u64,
    /// Stage 3: micro-batches whose gather order differed from the recorded
    /// one (or ended early), so that their order was recorded instead.
    pub gather_order_changes: u64,
}

/// The full (unsharded) state of one unit, read out for evaluation and
/// tests; real elements only (no padding).
#[derive(Debug, Clone, PartialEq)]
pub struct UnitState {
    /// The parameters in their training dtype, as f32.
    pub params: Vec<f32>,
    /// fp32 master weights.
    pub master: Vec<f32>,
    /// AdamW first moment.
    pub m: Vec<f32>,
    /// AdamW second moment.
    pub v: Vec<f32>,
}

/// Builds an [`Engine`]: register every unit, then [`EngineBuilder::build`].
pub struct EngineBuilder<C: Communicator> {
    cfg: ResolvedConfig,
    comm: C,
    device: Device,
    seed: u64,
    specs: Vec<(UnitSpec, Vec<Init>)>,
    id: u64,
    optimizer_threads: Option<usize>,
    swap_faults: Option<FaultPlan>,
    param_swap_faults: Option<FaultPlan>,
    tracer: Tracer,
    keep_last: usize,
    /// Set by [`Engine::load_checkpoint`]: the load fills the master, m, v
    /// and parameters completely, so the build leaves their pages to be
    /// faulted in by the load instead of pre-faulting them.
    pub(crate) for_load: bool,
}

/// The per-unit state.
struct Unit {
    layout: UnitLayout,
    /// Stage 0–2: the full padded unit; stage 3: this rank's shard. `None`
    /// only while a collective holds it.
    params: Option<DynBuf>,
    /// fp32 master, m, v: full (stage 0) or shard; empty when the
    /// optimizer state is offloaded (it lives in [`Offload`]).
    master: HostBuffer<f32>,
    m: HostBuffer<f32>,
    v: HostBuffer<f32>,
    /// Stage 0/1: the persistent full gradient buffer in P (`None` while
    /// lent to the trainer or in a bucket). Stage 2/3: `None`.
    grad: Option<DynBuf>,
    /// The accumulated gradient in A: full (stage 0) or shard; `None` when
    /// it lives in `grad` (A = P without accumulation, stages 0/1, no
    /// optimizer offload). With optimizer offload it is the host-side
    /// gradient shard that feeds the CPU AdamW (accounted in the host tier).
    acc: Option<DynBuf>,
    /// The trainer holds this unit's gradient buffer.
    lent: bool,
    /// `grad_ready` was called in this micro-batch.
    ready: bool,
    /// How many `gather`s are not yet `release`d.
    gathers: usize,
    /// Stages 1–2: the updated parameters' all-gather is queued or in
    /// flight (the local copy is stale or lent to the collective).
    stale: bool,
    _allocs: Vec<Allocation>,
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

/// The sharded data-parallel engine of one rank.
pub struct Engine<C: Communicator> {
    id: u64,
    comm: C,
    cfg: ResolvedConfig,
    plan: PartitionPlan,
    tracker: MemoryTracker,
    rank: usize,
    world: usize,
    stage: u8,
    pdt: DType,
    cdt: DType,
    units: Vec<Unit>,
    // Gradient reduction.
    bucket_cap: usize,
    free_buckets: Vec<DynBuf>,
    open: Option<OpenBucket>,
    inflight: VecDeque<InFlight>,
    deferred: Vec<usize>,
    /// Stages 1–2: the all-gathers of updated parameters in flight (unit,
    /// handle), in launch order, and their padded elements …
    param_gathers: VecDeque<(usize, Work<DynBuf>)>,
    param_gather_elems: usize,
    /// … and the units whose all-gather is not launched yet (over
    /// `allgather_bucket_size`). With `overlap_comm` both drain during the
    /// next forward pass, as `gather` asks for each unit.
    param_gather_queue: VecDeque<usize>,
    grad_pool: HashMap<usize, Vec<DynBuf>>,
    _bucket_allocs: Vec<Allocation>,
    // Steps.
    micro: usize,
    steps: u64,
    /// Optimizer-step boundaries, skipped steps included.
    global_steps: u64,
    scaler: Option<LossScaler>,
    last: StepOutcome,
    s3: Stage3,
    stats: EngineStats,
    warned: Vec<String>,
    /// The first communication error; the engine refuses work after it.
    failed: Option<String>,
    /// The CPU AdamW and norm kernels (SIMD, threads).
    adam: CpuAdamW,
    /// The offloaded optimizer state (`offload_optimizer.device` cpu or
    /// nvme).
    offload: Option<Offload>,
    /// The first swap-file error: the optimizer state is lost, the
    /// parameters of the last completed step stay readable (unless
    /// `params_lost`), or, with `swap_rescued`, the whole state after the
    /// step stays readable.
    swap_failed: Option<String>,
    /// `swap_failed` was a failed optimizer swap write that every rank
    /// rescued (see [`Offload::rescued`]): the step completed and the
    /// state after it is complete, so the calls that only read it
    /// ([`READS_AFTER_RESCUE`]) still work.
    swap_rescued: bool,
    /// The error of a rescued step, returned by `step()` once the step is
    /// finished (parameter all-gather included).
    rescued_error: Option<Error>,
    /// Stage 3 parameter offload (`offload_param.device` cpu or nvme): the
    /// home of every unit's shard.
    poff: Option<ParamOffload>,
    /// A parameter swap-file error: the shards cannot be read any more, so
    /// `gather` refuses too.
    params_lost: bool,
    /// Spans of this rank's phases (disabled unless
    /// [`EngineBuilder::tracer`]).
    tracer: Tracer,
    /// The seed of the initialisers (recorded in checkpoints).
    seed: u64,
    /// Checkpoints kept by [`Engine::save_checkpoint`] (0: all).
    keep_last: usize,
}

/// Every rank learns whether every rank could set up `what`, so that all
/// fail together instead of hanging in the next collective: this rank's own
/// error, or one naming the first rank that failed.
fn agree_on_setup<C: Communicator, T>(comm: &C, built: Result<T>, what: &str) -> Result<T> {
    let failed = first_failure(comm, built.as_ref().err())?;
    let ok = built?;
    match failed {
        Some((r, why)) => Err(Error::Usage {
            rank: comm.rank(),
            what: format!("rank {r} could not set up its {what}): {why}"),
        }),
        None => Ok(ok),
    }
}

/// Every rank learns the lowest rank whose `local` error is set, and that
/// error's text (a collective: every rank calls it at the same point).
pub(crate) fn first_failure<C: Communicator>(
    comm: &C,
    local: Option<&Error>,
) -> Result<Option<(usize, String)>> {
    let text = local.map(|e| e.to_string()).unwrap_or_default();
    let head = exchange_words(comm, &[u64::from(local.is_some()), text.len() as u64])?;
    let Some(r) = head.iter().position(|w| w[0] != 0) else {
        return Ok(None);
    };
    let words = (head[r][1] as usize).div_ceil(8).max(1);
    let mut mine = vec![0u64; words];
    if comm.rank() == r {
        for (w, chunk) in mine.iter_mut().zip(text.as_bytes().chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
    }
    let all = exchange_words(comm, &mine)?;
    let bytes: Vec<u8> = all[r].iter().flat_map(|w| w.to_le_bytes()).collect();
    let why = String::from_utf8_lossy(&bytes[..head[r][1] as usize]).into_owned();
    Ok(Some((r, why)))
}

static NEXT_ENGINE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl<C: Communicator> Engine<C> {
    /// Starts building an engine for `cfg` (resolved for this world size)
    /// over `comm`. Parameters live on `Device::Cpu` until the CUDA backend
    /// lands ([`EngineBuilder::device`]).
    pub fn builder(cfg: ResolvedConfig, comm: C) -> EngineBuilder<C> {
        EngineBuilder {
            cfg,
            comm,
            device: Device::Cpu,
            seed: 0,
            specs: Vec::new(),
            id: NEXT_ENGINE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            optimizer_threads: None,
            swap_faults: None,
            param_swap_faults: None,
            tracer: Tracer::disabled(),
            keep_last: 0,
            for_load: false,
        }
    }
}

impl<C: Communicator> EngineBuilder<C> {
    /// The device for parameters, gradients and optimizer state.
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// The seed of the deterministic initialisers (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Threads for the optimizer step and the gradient-norm pass (the CPU
    /// kernels of [`CpuAdamW`]). Default: this machine's cores divided by
    /// the ranks running on it ([`Communicator::ranks_on_host`]), at least
    /// one, so that ranks sharing a machine do not oversubscribe its cores.
    pub fn optimizer_threads(mut self, threads: usize) -> Self {
        self.optimizer_threads = Some(threads.max(1));
        self
    }

    /// Faults to inject into the optimizer swap file
    /// (`offload_optimizer.device = "nvme"`), for testing the error paths:
    /// a failed block write, or a filesystem that rejects `O_DIRECT`. Not
    /// for production use. Ignored without nvme offload.
    #[cfg(feature = "testing")]
    pub fn swap_faults(mut self, faults: FaultPlan) -> Self {
        self.swap_faults = Some(faults);
        self
    }

    /// Faults to inject into the parameter swap file (stage 3 with
    /// `offload_param.device = "nvme"`), for testing the error paths: a
    /// failed block write (counted from the build, which writes each unit
    /// shard once), or a filesystem that rejects `O_DIRECT`. Not for
    /// production use. Ignored without nvme parameter offload.
    #[cfg(feature = "testing")]
    pub fn param_swap_faults(mut self, faults: FaultPlan) -> Self {
        self.param_swap_faults = Some(faults);
        self
    }

    /// Records this rank's phases into `tracer` (default
    /// [`Tracer::disabled`]): `gather` and `reduce` (cat `comm`),
    /// `optimizer`, and the offload spans (cat `offload`); see
    /// [`crate::trace`]. With the threads backend every rank may get a
    /// clone of one tracer.
    pub fn tracer(mut self, tracer: Tracer) -> Self {
        self.tracer = tracer;
        self
    }

    /// How many checkpoints [`Engine::save_checkpoint`] keeps under its
    /// root: after a save, the oldest `step*` directories beyond the
    /// newest `n` are deleted. Default 0: keep all.
    pub fn keep_last_checkpoints(mut self, n: usize) -> Self {
        self.keep_last = n;
        self
    }

    /// Registers a unit with one initialiser per tensor. Every rank must
    /// register the same units in the same order ([`EngineBuilder::build`]
    /// checks).
    pub fn register(&mut self, spec: UnitSpec, init: Vec<Init>) -> Result<UnitId> {
        let rank = self.comm.rank();
        let usage = |what: String| Error::Usage { rank, what };
        if init.len() != spec.tensors.len() {
            return Err(usage(format!(
                "register(`{}`): {} initialisers for {} tensors (one per tensor)",
                spec.name,
                init.len(),
                spec.tensors.len()
            )));
        }
        for (t, i) in spec.tensors.iter().zip(&init) {
            if let Init::Values(v) = i {
                if v.len() != t.numel() {
                    return Err(usage(format!(
                        "register(`{}`): tensor `{}` has {} elements but Init::Values holds {}",
                        spec.name,
                        t.name,
                        t.numel(),
                        v.len()
                    )));
                }
            }
        }
        if self.specs.iter().any(|(s, _)| s.name == spec.name) {
            return Err(usage(format!(
                "register(`{}`): a unit of that name is already registered",
                spec.name
            )));
        }
        self.specs.push((spec, init));
        Ok(UnitId {
            engine: self.id,
            index: self.specs.len() - 1,
        })
    }

    /// Checks that every rank registered the same units with the same
    /// config (a collective), allocates every buffer of the memory plan and
    /// initialises this rank's parameters.
    pub fn build(self) -> Result<Engine<C>> {
        let EngineBuilder {
            cfg,
            comm,
            device,
            seed,
            specs,
            id,
            optimizer_threads,
            swap_faults,
            param_swap_faults,
            tracer,
            keep_last,
            for_load,
        } = self;
        let rank = comm.rank();
        let world = comm.world_size();
        if !matches!(device, Device::Cpu) {
            return Err(Error::Unsupported {
                what: format!("device {device:?}: the engine runs on the CPU for now"),
            });
        }
        if cfg.world_size != world {
            return Err(Error::Usage {
                rank,
                what: format!(
                    "the config was resolved for world_size {} but the communicator has {world} ranks",
                    cfg.world_size
                ),
            });
        }
        check_offload(&cfg)?;
        check_agreement(&comm, &cfg, seed, &specs)?;

        let unit_specs: Vec<UnitSpec> = specs.iter().map(|(s, _)| s.clone()).collect();
        let plan = PartitionPlan::new(&unit_specs, world)?;
        let tracker = MemoryTracker::new(rank);
        let stage = cfg.zero.stage;
        let pdt = match cfg.precision {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        };
        let adt = cfg.grad_accum_dtype;
        let cdt = cfg.communication_data_type;
        let ga = cfg.gradient_accumulation_steps;
        let offloading = cfg.zero.offload_optimizer.device != OffloadDevice::None;
        let alias = stage <= 1 && adt == pdt && ga == 1 && !offloading;
        let param_offloading = stage == 3 && cfg.zero.offload_param.device != OffloadDevice::None;
        if param_offloading {
            check_param_offload(&cfg, &plan)?;
        }
        let mut masters = Vec::new();
        let mut ranges = Vec::new();

        let mut units = Vec::with_capacity(specs.len());
        for ((spec, inits), layout) in specs.iter().zip(plan.units()) {
            let key = fnv1a(spec.name.as_bytes());
            let full = layout.padded_numel;
            let shard = layout.shard_len;
            let mut allocs = Vec::new();
            let mut track = |tier: Tier, cat: Category, bytes: u64| {
                allocs.push(tracker.allocate(tier, cat, bytes));
            };
            // The element range this rank's optimizer state covers.
            let (state_start, state_len) = if stage == 0 {
                (0, full)
            } else {
                (rank * shard, shard)
            };
            let (p_start, p_len) = if stage == 3 {
                (rank * shard, shard)
            } else {
                (0, full)
            };
            let mut master = HostBuffer::<f32>::zeros(state_len)?;
            let mut params = DynBuf::alloc(&comm, pdt, p_len)?;
            // Initialise only what this rank stores: the union of its
            // master and parameter ranges (new buffers are zero already).
            if inits.iter().any(|i| *i != Init::Zeros) {
                let lo = state_start.min(p_start);
                let hi = (state_start + state_len).max(p_start + p_len);
                let mut values = vec![0f32; hi - lo];
                for (ti, t) in layout.tensors.iter().enumerate() {
                    let r = t.offset.max(lo)..(t.offset + t.numel).min(hi);
                    for i in r {
                        values[i - lo] = inits[ti].value(seed, key, ti, i - t.offset);
                    }
                }
                master.copy_from_slice(&values[state_start - lo..state_start - lo + state_len]);
                params.store_slice(0, &values[p_start - lo..p_start - lo + p_len]);
            }
            // Large buffers are fresh mappings: fault every page in now so
            // that the step takes no page faults — except what a checkpoint
            // load is about to fill completely (and what offload copies
            // out and drops here).
            if !for_load && !offloading {
                master.prefault();
            }
            if !for_load && !param_offloading {
                params.prefault();
            }
            if !offloading {
                track(Tier::Device, Category::Master, (state_len * 4) as u64);
                track(Tier::Device, Category::Moments, (state_len * 8) as u64);
            }
            if !param_offloading {
                track(Tier::Device, Category::Params, params.capacity_bytes());
            }
            let grad = if stage <= 1 {
                let mut g = DynBuf::alloc(&comm, pdt, full)?;
                g.prefault();
                track(Tier::Device, Category::Grads, g.capacity_bytes());
                Some(g)
            } else {
                None
            };
            let acc = if alias {
                None
            } else {
                let len = if stage == 0 { full } else { shard };
                let mut a = DynBuf::alloc(&comm, adt, len)?;
                a.prefault();
                // With optimizer offload the gradient shard feeding AdamW
                // is host memory (device→host as buckets complete).
                let tier = if offloading { Tier::Host } else { Tier::Device };
                track(tier, Category::Grads, a.capacity_bytes());
                Some(a)
            };
            let moments = if offloading { 0 } else { state_len };
            let (mut m, mut v) = (HostBuffer::zeros(moments)?, HostBuffer::zeros(moments)?);
            if !for_load {
                m.prefault();
                v.prefault();
            }
            if offloading {
                let abs = if stage == 0 {
                    0..layout.numel
                } else {
                    layout.real_range(rank)
                };
                let real = relative(abs.clone(), state_start);
                ranges.push(UnitRanges {
                    state_len,
                    params: if stage == 3 { real.clone() } else { abs },
                    real,
                });
                masters.push(master);
                master = HostBuffer::zeros(0)?;
            }
            units.push(Unit {
                layout: layout.clone(),
                params: Some(params),
                master,
                m,
                v,
                grad,
                acc,
                lent: false,
                ready: false,
                gathers: 0,
                stale: false,
                _allocs: allocs,
            });
        }

        // Bucket buffers: as large as reduce_bucket_size (no larger than
        // the model) and at least the largest unit; two when reductions
        // overlap the backward pass.
        let largest = plan
            .units()
            .iter()
            .map(|u| u.padded_numel)
            .max()
            .unwrap_or(0);
        let bucket_cap = cfg
            .zero
            .reduce_bucket_size
            .min(plan.padded_numel())
            .max(largest);
        let n_buckets = if overlaps(&cfg) { 2 } else { 1 };
        let mut free_buckets = Vec::new();
        let mut bucket_allocs = Vec::new();
        for _ in 0..n_buckets {
            let mut b = DynBuf::alloc(&comm, cdt, bucket_cap)?;
            b.prefault();
            bucket_allocs.push(tracker.allocate(
                Tier::Device,
                Category::CommBuffers,
                b.capacity_bytes(),
            ));
            free_buckets.push(b);
        }
        let offload = if offloading {
            let views: Vec<&[f32]> = masters.iter().map(|m| &m[..]).collect();
            let built = Offload::new(&cfg, rank, pdt, ranges, &views, &tracker, swap_faults);
            drop(views);
            drop(masters);
            Some(
                agree_on_setup(
                    &comm,
                    built,
                    "optimizer offload (zero_optimization.offload_optimizer",
                )?
                .traced(tracer.clone(), rank),
            )
        } else {
            None
        };
        let poff = if param_offloading {
            let init: Vec<DynBuf> = units
                .iter_mut()
                .map(|u| u.params.take().expect("params are home at build"))
                .collect();
            let views: Vec<&DynBuf> = init.iter().collect();
            let built = ParamOffload::new(&cfg, rank, pdt, &views, &tracker, param_swap_faults);
            drop(views);
            drop(init);
            Some(
                agree_on_setup(
                    &comm,
                    built,
                    "parameter offload (zero_optimization.offload_param",
                )?
                .traced(tracer.clone(), rank),
            )
        } else {
            None
        };
        let scaler = cfg.loss_scale.map(LossScaler::new);
        let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale());
        let lr = cfg.scheduler.lr_at(0);
        let s3 = Stage3::new(&cfg, &plan);
        let threads = optimizer_threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / comm.ranks_on_host().max(1)).max(1)
        });
        let adam = CpuAdamW::new().with_threads(threads);
        let mut engine = Engine {
            id,
            comm,
            plan,
            tracker,
            rank,
            world,
            stage,
            pdt,
            cdt,
            units,
            bucket_cap,
            free_buckets,
            open: None,
            inflight: VecDeque::new(),
            deferred: Vec::new(),
            param_gathers: VecDeque::new(),
            param_gather_elems: 0,
            param_gather_queue: VecDeque::new(),
            grad_pool: HashMap::new(),
            _bucket_allocs: bucket_allocs,
            micro: 0,
            steps: 0,
            global_steps: 0,
            scaler,
            last: StepOutcome {
                boundary: false,
                skipped: false,
                grad_norm: None,
                lr,
                loss_scale,
                steps: 0,
            },
            s3,
            stats: EngineStats::default(),
            warned: Vec::new(),
            failed: None,
            adam,
            offload,
            swap_failed: None,
            swap_rescued: false,
            rescued_error: None,
            poff,
            params_lost: false,
            tracer,
            cfg,
            seed,
            keep_last,
        };
        if let Some(off) = &engine.offload {
            for w in off.warnings() {
                engine.warn(w);
            }
        }
        if let Some(po) = &engine.poff {
            for w in po.warnings() {
                engine.warn(w);
            }
        }
        if engine.stage == 3 {
            engine.gather_persistent()?;
        }
        Ok(engine)
    }
}

/// The calls that only read the state, allowed after a rescued swap
/// write failure (see [`Engine::check_swap`]).
const READS_AFTER_RESCUE: &[&str] = &["unit_state", "save_checkpoint", "export_safetensors"];

/// The offload settings the engine can run, checked again here for
/// configs built in code (the JSON parser checks most of them): errors
/// name the key.
fn check_offload(cfg: &ResolvedConfig) -> Result<()> {
    const OO: &str = "zero_optimization.offload_optimizer";
    const OP: &str = "zero_optimization.offload_param";
    let name = |d: OffloadDevice| match d {
        OffloadDevice::None => "none",
        OffloadDevice::Cpu => "cpu",
        OffloadDevice::Nvme => "nvme",
    };
    let op = &cfg.zero.offload_param;
    if op.device != OffloadDevice::None {
        if cfg.zero.stage != 3 {
            return Err(config(
                format!("{OP}.device"),
                format!(
                    "parameter offload (\"{}\") needs ZeRO stage 3, but zero_optimization.stage is {}",
                    name(op.device),
                    cfg.zero.stage
                ),
            ));
        }
        if op.device == OffloadDevice::Nvme {
            require_nvme_path(OP, op.nvme_path.as_deref())?;
        }
    }
    let oo = &cfg.zero.offload_optimizer;
    if oo.device == OffloadDevice::None {
        return Ok(());
    }
    if oo.ratio < 1.0 {
        return Err(Error::Unsupported {
            what: format!(
                "config key `{OO}.ratio` is {}: partial optimizer offload is not implemented; \
                 use 1.0",
                oo.ratio
            ),
        });
    }
    if oo.device == OffloadDevice::Nvme {
        require_nvme_path(OO, oo.nvme_path.as_deref())?;
    }
    Ok(())
}

/// An error naming the config key `key`.
fn config(key: String, msg: String) -> Error {
    Error::Core(zero_core::Error::Config { key, msg })
}

/// `{block}.nvme_path` must name a directory when the device is nvme.
fn require_nvme_path(block: &str, path: Option<&std::path::Path>) -> Result<()> {
    if path.is_none_or(|p| p.as_os_str().is_empty()) {
        return Err(config(
            format!("{block}.nvme_path"),
            "required when device is \"nvme\": a directory on the NVMe drive".into(),
        ));
    }
    Ok(())
}

/// The parameter-offload settings that depend on the units: `buffer_size`
/// (nvme) must hold the largest unit shard; `max_in_cpu` (cpu) must hold
/// every shard of the rank (all of them live in host memory).
fn check_param_offload(cfg: &ResolvedConfig, plan: &PartitionPlan) -> Result<()> {
    const OP: &str = "zero_optimization.offload_param";
    let op = &cfg.zero.offload_param;
    let largest = plan.units().iter().map(|u| u.shard_len).max().unwrap_or(0);
    let total: usize = plan.units().iter().map(|u| u.shard_len).sum();
    match op.device {
        OffloadDevice::Nvme if op.buffer_size < largest => Err(config(
            format!("{OP}.buffer_size"),
            format!(
                "{} elements cannot hold the largest unit shard ({largest} elements); \
                 raise it to at least {largest}",
                op.buffer_size
            ),
        )),
        OffloadDevice::Cpu if op.max_in_cpu < total => Err(config(
            format!("{OP}.max_in_cpu"),
            format!(
                "{} elements, but with device \"cpu\" every parameter shard of the rank \
                 ({total} elements) lives in host memory; raise it to at least {total} or use \
                 device \"nvme\"",
                op.max_in_cpu
            ),
        )),
        _ => Ok(()),
    }
}

/// Whether gradient reductions overlap the backward pass: stage 0 always
/// (as DDP), stages 2–3 with `overlap_comm`; stage 1 reduces after it.
fn overlaps(cfg: &ResolvedConfig) -> bool {
    match cfg.zero.stage {
        0 => true,
        1 => false,
        _ => cfg.zero.overlap_comm,
    }
}

/// Every rank must register the same units (names, tensors, shapes) with
/// the same config and seed. All ranks learn the verdict, so all fail
/// together instead of hanging in a later collective.
fn check_agreement<C: Communicator>(
    comm: &C,
    cfg: &ResolvedConfig,
    seed: u64,
    specs: &[(UnitSpec, Vec<Init>)],
) -> Result<()> {
    let rank = comm.rank();
    let world = comm.world_size();
    let cfg_digest = fnv1a(cfg.to_json_pretty().as_bytes()) ^ mix(seed);
    let digests: Vec<u64> = specs
        .iter()
        .map(|(s, _)| {
            let mut text = s.name.clone();
            for t in &s.tensors {
                text.push_str(&format!("|{}:{:?}", t.name, t.shape));
            }
            fnv1a(text.as_bytes())
        })
        .collect();
    // Round 1: counts (as exact small floats) and the config digest.
    let mut head = vec![specs.len() as u64, cfg_digest];
    let all = exchange_words(comm, &head)?;
    let counts: Vec<u64> = all.iter().map(|w| w[0]).collect();
    if let Some(r) = (0..world).find(|&r| all[r][1] != cfg_digest) {
        return Err(Error::Disagreement {
            rank,
            what: format!(
                "rank {r} resolved a different config or seed than rank {rank} \
                 (compare the resolved configs the ranks print)"
            ),
        });
    }
    let max = counts.iter().copied().max().unwrap_or(0) as usize;
    head.clear();
    let mut mine = digests.clone();
    mine.resize(max, 0);
    let all = exchange_words(comm, &mine)?;
    for i in 0..max {
        if let Some(r) = (0..world).find(|&r| all[r][i] != mine[i]) {
            let here = specs
                .get(i)
                .map_or("nothing".to_string(), |(s, _)| format!("`{}`", s.name));
            let there = if (i as u64) < counts[r] {
                "a different unit (name, tensors or shapes)"
            } else {
                "nothing"
            };
            return Err(Error::Disagreement {
                rank,
                what: format!(
                    "unit #{i}: rank {rank} registered {here}, rank {r} registered {there} \
                     (ranks registered {counts:?} units)"
                ),
            });
        }
    }
    Ok(())
}

/// Waits for a collective and records, on the tracer's `collective` track,
/// when it ran on the progress thread (so that a trace shows how much of
/// it overlapped compute).
pub(crate) fn wait_traced<R: 'static>(tracer: &Tracer, rank: usize, work: Work<R>) -> Result<R> {
    let op = work.op();
    let (r, timing) = work.wait_timed()?;
    if let Some(t) = timing {
        tracer.record(rank, op, "collective", t.started, t.finished);
    }
    Ok(r)
}

/// All-gathers `words.len()` u64 per rank (the same length on every rank),
/// bit-exactly (carried as bf16 bit patterns, which collectives copy).
pub(crate) fn exchange_words<C: Communicator>(comm: &C, words: &[u64]) -> Result<Vec<Vec<u64>>> {
    let n = words.len() * 4;
    let world = comm.world_size();
    let send = HostBuffer::from_fn(n, |i| {
        bf16::from_bits((words[i / 4] >> (16 * (i % 4))) as u16)
    })?;
    let recv = HostBuffer::<bf16>::zeros(n * world)?;
    let (_, recv) = comm.all_gather(send, recv, &vec![n; world]).wait()?;
    Ok((0..world)
        .map(|r| {
            (0..words.len())
                .map(|w| {
                    (0..4).fold(0u64, |acc, k| {
                        acc | (u64::from(recv[r * n + w * 4 + k].to_bits()) << (16 * k))
                    })
                })
                .collect()
        })
        .collect())
}

impl<C: Communicator> Engine<C> {
    // ------------------------------------------------------------------
    // Introspection

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The communicator (for the trainer's own collectives, e.g. averaging
    /// the loss for logging).
    pub fn comm(&self) -> &C {
        &self.comm
    }

    /// The tracer this engine records its spans into
    /// ([`EngineBuilder::tracer`]; disabled by default). A trainer can
    /// record its own spans (forward, backward) into it too.
    pub fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    /// The resolved config.
    pub fn config(&self) -> &ResolvedConfig {
        &self.cfg
    }

    /// The partition plan.
    pub fn plan(&self) -> &PartitionPlan {
        &self.plan
    }

    /// The dtype of parameters and of the gradients the trainer writes.
    pub fn param_dtype(&self) -> DType {
        self.pdt
    }

    /// The unit registered as `name`.
    pub fn unit_id(&self, name: &str) -> Option<UnitId> {
        self.plan.find(name).map(|index| UnitId {
            engine: self.id,
            index,
        })
    }

    /// Every unit, in registration order.
    pub fn unit_ids(&self) -> Vec<UnitId> {
        (0..self.units.len())
            .map(|index| UnitId {
                engine: self.id,
                index,
            })
            .collect()
    }

    /// The layout of a unit (its tensors' names, shapes and offsets).
    pub fn layout(&self, unit: UnitId) -> Result<&UnitLayout> {
        let i = self.check(unit, "layout")?;
        Ok(&self.units[i].layout)
    }

    /// This rank's optimizer swap file (`offload_optimizer.device =
    /// "nvme"`), named `zero-swap-optimizer-rank<r>-<run id>.swp` under
    /// `nvme_path` and removed when the engine is dropped; `None` without
    /// nvme offload.
    pub fn optimizer_swap_path(&self) -> Option<&std::path::Path> {
        self.offload.as_ref().and_then(|o| o.swap_path())
    }

    /// This rank's parameter swap file (`offload_param.device = "nvme"`,
    /// stage 3), named `zero-swap-params-rank<r>-<run id>.swp` under
    /// `offload_param.nvme_path` and removed when the engine is dropped;
    /// `None` otherwise.
    pub fn param_swap_path(&self) -> Option<&std::path::Path> {
        self.poff.as_ref().and_then(|p| p.swap_path())
    }

    /// The memory tracker (the trainer reports activations through it).
    pub fn tracker(&self) -> &MemoryTracker {
        &self.tracker
    }

    /// The memory report of this rank.
    pub fn memory_report(&self) -> MemoryReport {
        self.tracker.report()
    }

    /// Time and traffic counters since the start (or the last reset).
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Resets [`Engine::stats`] (the live-parameter peak included).
    pub fn reset_stats(&mut self) {
        self.stats = EngineStats::default();
        self.stats.peak_live_elems = self.s3.live;
    }

    /// The loss scale the trainer multiplies its loss by (1 unless fp16).
    pub fn loss_scale(&self) -> f32 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale())
    }

    /// The learning rate of the next optimizer step.
    pub fn lr(&self) -> f64 {
        self.cfg.scheduler.lr_at(self.steps)
    }

    /// Optimizer steps applied so far (skipped steps not counted).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Optimizer-step boundaries so far, skipped steps included
    /// (DeepSpeed's `global_steps`): [`Engine::save_checkpoint`] names
    /// its directory after it.
    pub fn global_steps(&self) -> u64 {
        self.global_steps
    }

    /// What the last [`Engine::step`] did.
    pub fn last_step(&self) -> StepOutcome {
        self.last
    }

    /// Warnings given so far (each once), e.g. a stage-3 gather order that
    /// differs from the recorded one.
    pub fn warnings(&self) -> &[String] {
        &self.warned
    }

    fn warn(&mut self, msg: String) {
        if !self.warned.contains(&msg) {
            if self.rank == 0 {
                eprintln!("zero: warning: {msg}");
            }
            self.warned.push(msg);
        }
    }

    /// Runs a call that may run collectives. After a communication error
    /// the engine's buffers may still be held by the failed collective, so
    /// every later call fails with that error instead of touching them.
    fn guard<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        if let Some(first) = &self.failed {
            return Err(self.usage(format!(
                "the engine cannot continue after a communication error: {first}"
            )));
        }
        let r = f(self);
        if let Err(Error::Comm(e)) = &r {
            self.failed = Some(e.to_string());
        }
        r
    }

    /// After a swap-file error only reading parameters works, and reading
    /// the whole state ([`READS_AFTER_RESCUE`]) after a rescued write
    /// failure.
    fn check_swap(&self, call: &str) -> Result<()> {
        let Some(first) = &self.swap_failed else {
            return Ok(());
        };
        let rescued = self.swap_rescued && !self.params_lost;
        if rescued && READS_AFTER_RESCUE.contains(&call) {
            return Ok(());
        }
        Err(self.usage(if rescued {
            format!(
                "{call}: the engine cannot train after a swap-file error; the state after step \
                 {} is complete (what the swap file could not take is kept in host memory): \
                 save it with save_checkpoint to another disk and resume from there: {first}",
                self.steps
            )
        } else {
            format!(
                "{call}: the engine cannot continue after a swap-file error (the optimizer state \
                 is lost; the parameters of step {} stay readable with gather/params): {first}",
                self.steps
            )
        }))
    }

    fn usage(&self, what: String) -> Error {
        Error::Usage {
            rank: self.rank,
            what,
        }
    }

    fn check(&self, unit: UnitId, call: &str) -> Result<usize> {
        if unit.engine != self.id || unit.index >= self.units.len() {
            return Err(self.usage(format!(
                "{call}: unknown unit #{} (it was not registered with this engine)",
                unit.index
            )));
        }
        Ok(unit.index)
    }

    fn name(&self, i: usize) -> &str {
        &self.units[i].layout.name
    }

    // ------------------------------------------------------------------
    // Parameters

    /// Makes a unit's full parameters available (stage 3: all-gathers
    /// them, or waits for the prefetch; stages 0–2 hold them anyway).
    /// Every `gather` needs a matching [`Engine::release`] before `step`.
    pub fn gather(&mut self, unit: UnitId) -> Result<()> {
        self.guard(|e| e.gather_inner(unit))
    }

    fn gather_inner(&mut self, unit: UnitId) -> Result<()> {
        let i = self.check(unit, "gather")?;
        if self.params_lost {
            let first = self.swap_failed.clone().unwrap_or_default();
            return Err(self.usage(format!(
                "gather(`{}`): the parameters are lost with the parameter swap file \
                 (offload_param.device \"nvme\"): {first}",
                self.name(i)
            )));
        }
        if self.stage == 3 {
            let _span = self.tracer.span(self.rank, "gather", "comm");
            let t = Instant::now();
            self.s3_gather(i)?;
            self.stats.gather_time += t.elapsed();
        } else if self.units[i].stale {
            // Stages 1–2 with overlap_comm: the all-gather of this unit's
            // updated parameters started in step(); wait for it (and keep
            // launching the next ones).
            let _span = self.tracer.span(self.rank, "gather", "comm");
            let t = Instant::now();
            self.advance_param_gathers(Some(i))?;
            self.stats.gather_time += t.elapsed();
        } else if !self.param_gather_queue.is_empty() {
            self.advance_param_gathers(None)?;
        }
        self.units[i].gathers += 1;
        Ok(())
    }

    /// Ends one use of a unit's parameters (stage 3 frees them unless they
    /// are persistent or needed again soon).
    pub fn release(&mut self, unit: UnitId) -> Result<()> {
        self.guard(|e| e.release_inner(unit))
    }

    fn release_inner(&mut self, unit: UnitId) -> Result<()> {
        let i = self.check(unit, "release")?;
        if self.units[i].gathers == 0 {
            return Err(self.usage(format!(
                "release(`{}`): the unit is not gathered",
                self.name(i)
            )));
        }
        self.units[i].gathers -= 1;
        if self.stage == 3 && self.units[i].gathers == 0 {
            self.s3_release(i)?;
        }
        Ok(())
    }

    /// The full parameters of a gathered unit (real elements, no padding),
    /// in the training dtype `T`.
    pub fn params<T: Element>(&self, unit: UnitId) -> Result<&[T]> {
        let i = self.check(unit, "params")?;
        let u = &self.units[i];
        if u.gathers == 0 {
            return Err(self.usage(format!(
                "params(`{}`): the unit is not gathered; call gather first",
                u.layout.name
            )));
        }
        let buf = if self.stage == 3 {
            self.s3.full[i].as_ref()
        } else {
            u.params.as_ref()
        };
        let buf = buf.ok_or_else(|| {
            self.usage(format!(
                "params(`{}`): the parameters are in use by a collective",
                u.layout.name
            ))
        })?;
        let s = buf.slice::<T>().ok_or(zero_core::Error::DTypeMismatch {
            op: "Engine::params",
            expected: self.pdt,
            got: T::DTYPE,
        })?;
        Ok(&s[..u.layout.numel])
    }

    /// One tensor of a gathered unit.
    pub fn param<T: Element>(&self, unit: UnitId, tensor: &str) -> Result<&[T]> {
        let all = self.params::<T>(unit)?;
        let l = &self.units[unit.index].layout;
        let t = l.tensor(tensor).ok_or_else(|| {
            self.usage(format!("param(`{}`, `{tensor}`): no such tensor", l.name))
        })?;
        Ok(&all[t.offset..t.offset + t.numel])
    }

    /// The full state of a unit (parameters, fp32 master, m, v), real
    /// elements only. A collective in stages 1–3: every rank must call it.
    /// With nvme offload it reads the unit's tiles from the swap file.
    /// After a swap-file error it returns an error (the optimizer state is
    /// lost; read the parameters with [`Engine::gather`] and
    /// [`Engine::params`] instead), except after a failed swap write,
    /// which loses nothing: then it returns the state after that step.
    pub fn unit_state(&mut self, unit: UnitId) -> Result<UnitState> {
        self.guard(|e| e.unit_state_inner(unit))
    }

    fn unit_state_inner(&mut self, unit: UnitId) -> Result<UnitState> {
        let i = self.check(unit, "unit_state")?;
        self.check_swap("unit_state")?;
        self.finish_param_gathers()?;
        let numel = self.units[i].layout.numel;
        let shard = self.units[i].layout.shard_len;
        let gather_f32 = |this: &Self, local: &[f32]| -> Result<Vec<f32>> {
            if this.stage == 0 {
                return Ok(local[..numel].to_vec());
            }
            let send = HostBuffer::from_slice(local)?;
            let recv = HostBuffer::<f32>::zeros(shard * this.world)?;
            let (_, recv) = this
                .comm
                .all_gather(send, recv, &vec![shard; this.world])
                .wait()?;
            Ok(recv[..numel].to_vec())
        };
        let (master, m, v) = match &self.offload {
            None => {
                let u = &self.units[i];
                (
                    gather_f32(self, &u.master)?,
                    gather_f32(self, &u.m)?,
                    gather_f32(self, &u.v)?,
                )
            }
            Some(off) => {
                let local = off.read_unit(i);
                if off.is_nvme() {
                    self.swap_verdict(local.as_ref().err(), "optimizer")?;
                }
                let (master, m, v) = local?;
                (
                    gather_f32(self, &master)?,
                    gather_f32(self, &m)?,
                    gather_f32(self, &v)?,
                )
            }
        };
        if let Some(po) = &self.poff {
            let local = po.shard_f32(i, self.pdt);
            if po.is_nvme() {
                self.swap_verdict(local.as_ref().err(), "parameter")?;
            }
            let params = gather_f32(self, &local?)?;
            return Ok(UnitState {
                params,
                master,
                m,
                v,
            });
        }
        let u = &self.units[i];
        let mut params = Vec::with_capacity(numel);
        let p = u
            .params
            .as_ref()
            .expect("params are home outside collectives");
        if self.stage == 3 {
            let mut local = Vec::with_capacity(shard);
            p.extend_f32(0..shard, &mut local);
            params = gather_f32(self, &local)?;
            // gather_f32 returns real elements of the full unit.
        } else {
            p.extend_f32(0..numel, &mut params);
        }
        Ok(UnitState {
            params,
            master,
            m,
            v,
        })
    }

    // ------------------------------------------------------------------
    // Gradients

    /// The buffer for a unit's gradient in this micro-batch: the full unit
    /// (real elements and padding), zeroed, in the training dtype. The
    /// trainer writes (or accumulates) the gradient of its micro-batch loss
    /// — multiplied by [`Engine::loss_scale`] — and hands it back with
    /// [`Engine::grad_ready`].
    pub fn grad_buffer<T: Element>(&mut self, unit: UnitId) -> Result<HostBuffer<T>> {
        self.guard(|e| e.grad_buffer_inner(unit))
    }

    fn grad_buffer_inner<T: Element>(&mut self, unit: UnitId) -> Result<HostBuffer<T>> {
        let i = self.check(unit, "grad_buffer")?;
        self.check_swap("grad_buffer")?;
        if T::DTYPE != self.pdt {
            return Err(zero_core::Error::DTypeMismatch {
                op: "Engine::grad_buffer",
                expected: self.pdt,
                got: T::DTYPE,
            }
            .into());
        }
        let u = &self.units[i];
        if u.ready {
            return Err(self.usage(format!(
                "grad_buffer(`{}`): grad_ready was already called for this unit in this micro-batch",
                u.layout.name
            )));
        }
        if u.lent {
            return Err(self.usage(format!(
                "grad_buffer(`{}`): the buffer is already lent; hand it back with grad_ready",
                u.layout.name
            )));
        }
        let mut buf = self.take_grad_buffer(i)?;
        buf.fill_zero();
        self.units[i].lent = true;
        match buf {
            DynBuf::F32(b) => Ok(cast_buf(b)),
            DynBuf::Bf16(b) => Ok(cast_buf(b)),
            DynBuf::F16(b) => Ok(cast_buf(b)),
        }
    }

    /// Hands a unit's gradient back: it joins the current bucket, which is
    /// reduced as soon as it is full (stages 0, 2, 3 while backward goes
    /// on; stage 1 after backward, in [`Engine::step`]).
    pub fn grad_ready<T: Element>(&mut self, unit: UnitId, grad: HostBuffer<T>) -> Result<()> {
        self.guard(|e| e.grad_ready_inner(unit, grad))
    }

    fn grad_ready_inner<T: Element>(&mut self, unit: UnitId, grad: HostBuffer<T>) -> Result<()> {
        let i = self.check(unit, "grad_ready")?;
        self.check_swap("grad_ready")?;
        let u = &self.units[i];
        if u.ready {
            return Err(self.usage(format!(
                "grad_ready(`{}`) called twice in one micro-batch",
                u.layout.name
            )));
        }
        if !u.lent {
            return Err(self.usage(format!(
                "grad_ready(`{}`): take the buffer with grad_buffer first",
                u.layout.name
            )));
        }
        if grad.len() != u.layout.padded_numel || T::DTYPE != self.pdt {
            return Err(self.usage(format!(
                "grad_ready(`{}`): expected the {}-element {} buffer from grad_buffer, got {} elements of {}",
                u.layout.name,
                u.layout.padded_numel,
                self.pdt,
                grad.len(),
                T::DTYPE
            )));
        }
        let buf = to_dyn(grad);
        let u = &mut self.units[i];
        u.lent = false;
        u.ready = true;
        if self.stage == 1 {
            u.grad = Some(buf);
            self.deferred.push(i);
            return Ok(());
        }
        let _span = self.tracer.span(self.rank, "reduce", "comm");
        let t = Instant::now();
        let r = self.add_to_bucket(i, buf);
        self.stats.reduce_time += t.elapsed();
        r
    }

    /// Unit `i`'s gradient buffer: the persistent one (stages 0/1) or one
    /// from the pool (stages 2/3). Not zeroed.
    fn take_grad_buffer(&mut self, i: usize) -> Result<DynBuf> {
        if self.stage <= 1 {
            self.wait_for_grad_home(i)?;
            Ok(self.units[i].grad.take().expect("grad buffer is home"))
        } else {
            self.pooled_grad(self.units[i].layout.padded_numel)
        }
    }

    fn pooled_grad(&mut self, len: usize) -> Result<DynBuf> {
        if let Some(b) = self.grad_pool.get_mut(&len).and_then(Vec::pop) {
            return Ok(b);
        }
        let b = DynBuf::alloc(&self.comm, self.pdt, len)?;
        // Transient gradient buffers stay in the pool: accounted as
        // gradients for as long as they exist.
        self._bucket_allocs.push(self.tracker.allocate(
            Tier::Device,
            Category::Grads,
            b.capacity_bytes(),
        ));
        Ok(b)
    }

    /// Stage 0/1: the unit's gradient buffer may sit in a bucket (stage 0
    /// with reductions in flight): drain until it is home.
    fn wait_for_grad_home(&mut self, i: usize) -> Result<()> {
        while self.units[i].grad.is_none() {
            if self.open.as_ref().is_some_and(|b| b.units.contains(&i)) {
                self.launch_open()?;
            }
            if self.inflight.is_empty() {
                break;
            }
            self.complete_oldest()?;
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
    fn add_to_bucket(&mut self, i: usize, grad: DynBuf) -> Result<()> {
        let n = self.units[i].layout.padded_numel;
        let world = self.world;
        let stride = self.bucket_cap / world;
        let fits = |elems: usize| {
            if self.stage == 0 {
                elems + n <= self.bucket_cap
            } else {
                (elems + n) / world <= stride
            }
        };
        if self.open.as_ref().is_some_and(|b| !fits(b.elems)) {
            self.launch_open()?;
        }
        if self.open.is_none() {
            if self.free_buckets.is_empty() {
                self.complete_oldest()?;
            }
            let buf = self.free_buckets.pop().expect("a bucket buffer is free");
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
        let full = b.elems >= self.cfg.zero.reduce_bucket_size.min(self.bucket_cap);
        if self.stage <= 1 {
            self.units[i].grad = Some(grad);
        } else {
            self.grad_pool.entry(grad.len()).or_default().push(grad);
        }
        if full {
            self.launch_open()?;
        }
        Ok(())
    }

    /// Starts the reduction of the open bucket: all-reduce (stage 0) or
    /// reduce-scatter of the rank sections (stages 1–3), after closing the
    /// gaps between sections of a bucket that is not full.
    fn launch_open(&mut self) -> Result<()> {
        let Some(open) = self.open.take() else {
            return Ok(());
        };
        let mut buf = open.buf;
        let world = self.world;
        let work = if self.stage == 0 {
            buf.set_len(open.elems)?;
            self.stats.reduce_bytes += ring_bytes(open.elems, world, self.cdt) * 2;
            buf.all_reduce(&self.comm)
        } else {
            let section = open.elems / world;
            let stride = self.bucket_cap / world;
            if section < stride {
                for r in 1..world {
                    buf.copy_within(r * stride..r * stride + section, r * section);
                }
            }
            buf.set_len(open.elems)?;
            if self.cfg.zero.reduce_scatter {
                self.stats.reduce_bytes += ring_bytes(open.elems, world, self.cdt);
                buf.reduce_scatter(&self.comm, &vec![section; world])
            } else {
                // `reduce_scatter: false`: all-reduce, keep this rank's
                // section (the same sums, twice the traffic).
                self.stats.reduce_bytes += ring_bytes(open.elems, world, self.cdt) * 2;
                buf.all_reduce(&self.comm)
            }
        };
        let units = open.units;
        self.inflight.push_back(InFlight { work, units });
        if !overlaps(&self.cfg) {
            self.complete_oldest()?;
        }
        Ok(())
    }

    /// Waits for the oldest bucket and stores its result in the units'
    /// accumulated gradients.
    fn complete_oldest(&mut self) -> Result<()> {
        let Some(f) = self.inflight.pop_front() else {
            return Ok(());
        };
        let buf = wait_traced(&self.tracer, self.rank, f.work)?;
        // With optimizer offload the accumulated shard is host memory:
        // this is the device→host copy of the reduced gradient.
        let _span = self
            .offload
            .is_some()
            .then(|| self.tracer.span(self.rank, "grad to host", "offload"));
        let add = self.micro > 0;
        let world = self.world;
        let rank = self.rank;
        if self.stage == 0 {
            let mut off = 0;
            for &i in &f.units {
                let u = &mut self.units[i];
                let n = u.layout.padded_numel;
                let dst = u.acc.as_mut().or(u.grad.as_mut()).expect("a gradient home");
                dst.store_from(0, &buf, off, n, add);
                off += n;
            }
        } else {
            let section = buf.len() / world;
            let mut off = rank * section;
            for &i in &f.units {
                let u = &mut self.units[i];
                let s = u.layout.shard_len;
                match u.acc.as_mut() {
                    Some(acc) => acc.store_from(0, &buf, off, s, add),
                    None => u.grad.as_mut().expect("stage 1 grads are home").store_from(
                        rank * s,
                        &buf,
                        off,
                        s,
                        add,
                    ),
                }
                off += s;
            }
        }
        let mut buf = buf;
        buf.set_len(buf.capacity())?;
        self.free_buckets.push(buf);
        Ok(())
    }

    /// Reduces what is left of this micro-batch: units nobody called
    /// `grad_ready` for (as zeros, so that every rank runs the same
    /// collectives), stage 1's deferred units, the open bucket; then waits
    /// for everything.
    fn finish_reductions(&mut self) -> Result<()> {
        for i in 0..self.units.len() {
            if !self.units[i].ready {
                let mut buf = self.take_grad_buffer(i)?;
                buf.fill_zero();
                self.units[i].ready = true;
                if self.stage == 1 {
                    self.units[i].grad = Some(buf);
                    self.deferred.push(i);
                } else {
                    self.add_to_bucket(i, buf)?;
                }
            }
        }
        for i in std::mem::take(&mut self.deferred) {
            let buf = self.units[i].grad.take().expect("deferred grads are home");
            self.add_to_bucket(i, buf)?;
        }
        self.launch_open()?;
        while !self.inflight.is_empty() {
            self.complete_oldest()?;
        }
        Ok(())
    }

    // ------------------------------------------------------------------
    // The step

    /// Ends a micro-batch: finishes its gradient reductions and, every
    /// `gradient_accumulation_steps` calls, runs the optimizer step
    /// (global norm, clipping, fp16 overflow check and loss-scale update,
    /// AdamW on this rank's shard, then the parameter all-gather where the
    /// stage needs it).
    pub fn step(&mut self) -> Result<StepOutcome> {
        self.guard(Self::step_inner)
    }

    fn step_inner(&mut self) -> Result<StepOutcome> {
        self.check_swap("step")?;
        for u in &self.units {
            if u.gathers > 0 {
                return Err(self.usage(format!(
                    "step() while unit `{}` is still gathered; release it first",
                    u.layout.name
                )));
            }
            if u.lent {
                return Err(self.usage(format!(
                    "step() while the gradient buffer of unit `{}` is still out; hand it back with grad_ready",
                    u.layout.name
                )));
            }
        }
        self.finish_param_gathers()?;
        let span = self.tracer.span(self.rank, "reduce", "comm");
        let t = Instant::now();
        self.finish_reductions()?;
        self.stats.reduce_time += t.elapsed();
        drop(span);
        for u in &mut self.units {
            u.ready = false;
        }
        if self.stage == 3 {
            self.s3_end_micro_batch()?;
        }
        self.param_swap_check()?;
        self.micro += 1;
        if self.micro < self.cfg.gradient_accumulation_steps {
            if self.stage == 3 {
                self.s3_prefetch_next()?;
            }
            self.last = StepOutcome {
                boundary: false,
                skipped: false,
                grad_norm: None,
                lr: self.lr(),
                loss_scale: self.loss_scale(),
                steps: self.steps,
            };
            return Ok(self.last);
        }
        self.micro = 0;
        let span = self.tracer.span(self.rank, "optimizer", "optimizer");
        let t = Instant::now();
        let outcome = self.optimizer_step()?;
        self.global_steps += 1;
        self.stats.optimizer_time += t.elapsed();
        drop(span);
        if !outcome.skipped {
            let _span = self.tracer.span(self.rank, "gather", "comm");
            let t = Instant::now();
            self.gather_updated_params()?;
            self.stats.gather_time += t.elapsed();
        }
        if self.stage == 3 {
            self.s3_prefetch_next()?;
        }
        self.last = outcome;
        // A failed swap write that every rank rescued: the step is done,
        // and it still fails.
        if let Some(e) = self.rescued_error.take() {
            return Err(e);
        }
        Ok(outcome)
    }

    /// The accumulated gradient of unit `i` as a typed slice over this
    /// rank's real elements, with the matching ranges of the optimizer
    /// state and of the parameters.
    fn ranges(&self, i: usize) -> (Range<usize>, Range<usize>, Range<usize>) {
        let l = &self.units[i].layout;
        let abs = if self.stage == 0 {
            0..l.numel
        } else {
            l.real_range(self.rank)
        };
        let base = if self.stage == 0 {
            0
        } else {
            self.rank * l.shard_len
        };
        let state = relative(abs.clone(), base);
        let grad = if self.units[i].acc.is_some() {
            state.clone()
        } else {
            abs.clone()
        };
        let params = if self.stage == 3 { state.clone() } else { abs };
        (state, grad, params)
    }

    /// Each unit's sum of squares of its gradient home over `ranges`, in
    /// one parallel region (every home holds `G`).
    fn unit_sum_squares<G: Element>(&self, ranges: &[Range<usize>]) -> Vec<f64> {
        let slices: Vec<&[G]> = (0..self.units.len())
            .map(|i| {
                let b = self.grad_home(i).slice::<G>().expect("one gradient dtype");
                &b[ranges[i].clone()]
            })
            .collect();
        self.adam.sum_squares_many(&slices)
    }

    /// AdamW on this rank's part of every unit, in one parallel region,
    /// writing the updated parameters in the parameter dtype.
    fn adamw_update(&mut self, k: &AdamWStep) -> Result<()> {
        let Some(first) = self.units.first() else {
            return Ok(());
        };
        let gdt = first
            .acc
            .as_ref()
            .or(first.grad.as_ref())
            .expect("a gradient home")
            .dtype();
        match gdt {
            DType::F32 => self.adamw_for_grad::<f32>(k),
            DType::BF16 => self.adamw_for_grad::<bf16>(k),
            DType::F16 => self.adamw_for_grad::<f16>(k),
        }
    }

    fn adamw_for_grad<G: Element>(&mut self, k: &AdamWStep) -> Result<()> {
        match self.pdt {
            DType::F32 => self.adamw_typed::<G, f32>(k),
            DType::BF16 => self.adamw_typed::<G, bf16>(k),
            DType::F16 => self.adamw_typed::<G, f16>(k),
        }
    }

    fn adamw_typed<G: Element, P: Element>(&mut self, k: &AdamWStep) -> Result<()> {
        if self.offload.is_some() {
            return self.offload_typed::<G, P>(k);
        }
        if self.poff.is_some() {
            return self.adamw_param_offload::<G, P>(k);
        }
        if !self.cfg.zero.overlap_comm || self.stage == 0 {
            let ranges: Vec<_> = (0..self.units.len()).map(|i| self.ranges(i)).collect();
            let mut parts = Vec::with_capacity(self.units.len());
            for (u, (state, grad, params)) in self.units.iter_mut().zip(ranges) {
                parts.push(adamw_slices::<G, P>(u, state, grad, params));
            }
            self.adam.step_many(k, parts)?;
            return Ok(());
        }
        // overlap_comm: unit by unit, so that the all-gathers of updated
        // parameters start while AdamW runs on the next units — every
        // unit's at stages 1–2, the head of the recorded order (what the
        // next forward gathers first) at stage 3. AdamW is elementwise: the
        // same bits as one call over all units.
        let head = self.s3_head();
        for i in 0..self.units.len() {
            let (state, grad, params) = self.ranges(i);
            let part = adamw_slices::<G, P>(&mut self.units[i], state, grad, params);
            self.adam.step_many(k, vec![part])?;
            if self.stage < 3 {
                self.param_gather_queue.push_back(i);
                self.units[i].stale = true;
                self.advance_param_gathers(None)?;
            } else if head == Some(i + 1) {
                self.s3_prefetch()?;
            }
        }
        Ok(())
    }

    /// AdamW with the optimizer state on the device tier and the parameter
    /// shards offloaded: with `cpu` AdamW writes the parameters straight
    /// into their host buffers (one parallel region, as without offload);
    /// with `nvme` unit by unit into a staging buffer that is then written
    /// to the unit's swap region (AdamW is elementwise, so the bits are
    /// the same).
    fn adamw_param_offload<G: Element, P: Element>(&mut self, k: &AdamWStep) -> Result<()> {
        let ranges: Vec<_> = (0..self.units.len()).map(|i| self.ranges(i)).collect();
        let Engine {
            units, poff, adam, ..
        } = self;
        let Some(po) = poff.as_mut() else {
            return Ok(());
        };
        if let Some(homes) = po.host_shards::<P>()? {
            let mut parts = Vec::with_capacity(units.len());
            for ((u, (state, grad, params)), home) in units.iter_mut().zip(ranges).zip(homes) {
                let g = u.acc.as_ref().or(u.grad.as_ref()).expect("a gradient home");
                parts.push(AdamWSlices {
                    master: &mut u.master[state.clone()],
                    grad: &g.slice::<G>().expect("one gradient dtype")[grad],
                    m: &mut u.m[state.clone()],
                    v: &mut u.v[state],
                    low: Some(&mut home[params]),
                });
            }
            adam.step_many(k, parts)?;
            return Ok(());
        }
        let mut r = Ok(());
        for (i, (u, (state, grad, params))) in units.iter_mut().zip(ranges).enumerate() {
            let g = u.acc.as_ref().or(u.grad.as_ref()).expect("a gradient home");
            let g = &g.slice::<G>().expect("one gradient dtype")[grad];
            let (master, m, v) = (&mut u.master, &mut u.m, &mut u.v);
            r = po.write_with::<P>(i, |home| {
                let part = AdamWSlices {
                    master: &mut master[state.clone()],
                    grad: g,
                    m: &mut m[state.clone()],
                    v: &mut v[state],
                    low: Some(&mut home[params]),
                };
                adam.step_many(k, vec![part])?;
                Ok(())
            });
            if r.is_err() {
                break;
            }
        }
        let flushed = po.flush();
        self.param_write_verdict(r.and(flushed))
    }

    /// nvme parameter offload, after the write-back of a step: every rank
    /// learns whether every rank's writes worked. On an error anywhere the
    /// engine is failed and the parameters are lost (some units were
    /// written, others not).
    fn param_write_verdict(&mut self, r: Result<()>) -> Result<()> {
        if !self.poff.as_ref().is_some_and(ParamOffload::is_nvme) {
            return r;
        }
        let failed = first_failure(&self.comm, r.as_ref().err())?;
        if let Err(e) = r {
            self.swap_failed = Some(e.to_string());
            self.params_lost = true;
            return Err(e);
        }
        if let Some((bad, why)) = failed {
            let msg = format!(
                "the parameter swap file of rank {bad} failed in step {} ({why}); the \
                 parameters are lost",
                self.steps + 1
            );
            self.swap_failed = Some(msg.clone());
            self.params_lost = true;
            return Err(self.usage(msg));
        }
        Ok(())
    }

    /// nvme parameter offload, at the end of every micro-batch: every rank
    /// learns whether every rank could read its parameter shards in it
    /// (a failed read fed zeros to the gather so that no rank left the
    /// collectives) and whether its swap file is intact. On an error
    /// anywhere nothing is updated, the engine is failed and the
    /// parameters are lost.
    fn param_swap_check(&mut self) -> Result<()> {
        let Some(po) = self.poff.as_mut().filter(|p| p.is_nvme()) else {
            return Ok(());
        };
        let r = po.check();
        let failed = first_failure(&self.comm, r.as_ref().err())?;
        if let Err(e) = r {
            self.swap_failed = Some(e.to_string());
            self.params_lost = true;
            return Err(e);
        }
        if let Some((bad, why)) = failed {
            let msg = format!(
                "the parameter swap file of rank {bad} could not be read in step {} ({why}); \
                 nothing was updated and the parameters are lost",
                self.steps + 1
            );
            self.swap_failed = Some(msg.clone());
            self.params_lost = true;
            return Err(self.usage(msg));
        }
        Ok(())
    }

    /// Writes the updated shards from the optimizer offload's staging
    /// buffer to their home (parameter offload with optimizer offload).
    fn param_write_back<P: Element>(&mut self) -> Result<()> {
        let (Some(off), Some(po)) = (self.offload.as_ref(), self.poff.as_mut()) else {
            return Ok(());
        };
        let mut r = Ok(());
        for i in 0..self.units.len() {
            let src = match off.staged::<P>(i) {
                Ok(s) => s,
                Err(e) => {
                    r = Err(e);
                    break;
                }
            };
            r = po.write_with::<P>(i, |home| {
                home.copy_from_slice(src);
                Ok(())
            });
            if r.is_err() {
                break;
            }
        }
        let flushed = po.flush();
        self.param_write_verdict(r.and(flushed))
    }

    /// AdamW on the offloaded optimizer state, tile by tile (see
    /// [`offload`]). With nvme, every rank learns whether every rank's swap
    /// file worked before any parameter changes: on an error anywhere that
    /// lost a rank's state, no rank's parameters change, and the engine is
    /// failed. If every error was a failed write whose tiles the rank kept
    /// in host memory ([`Offload::rescued`]), every rank commits the step
    /// (its parameters match the state kept) and `step()` returns the
    /// error once the step is finished; the state stays readable.
    fn offload_typed<G: Element, P: Element>(&mut self, k: &AdamWStep) -> Result<()> {
        let param_home = self.poff.is_some();
        let Some(off) = self.offload.as_mut() else {
            return Ok(());
        };
        let mut grads: Vec<&[G]> = Vec::with_capacity(self.units.len());
        let mut params: Vec<&mut [P]> = Vec::with_capacity(self.units.len());
        for u in self.units.iter_mut() {
            let Unit { acc, params: p, .. } = u;
            let acc: &Option<DynBuf> = acc;
            grads.push(
                acc.as_ref()
                    .expect("offload keeps an accumulation buffer")
                    .slice::<G>()
                    .expect("one gradient dtype"),
            );
            // With parameter offload the shards are not here: the updated
            // parameters stay in the staging buffer and are written back
            // to their home below.
            if !param_home {
                params.push(
                    p.as_mut()
                        .expect("params are home")
                        .slice_mut::<P>()
                        .expect("the parameter dtype"),
                );
            }
        }
        let r = off.step(&self.adam, k, &grads, &mut params);
        if !off.is_nvme() {
            drop(grads);
            drop(params);
            r?;
            return self.param_write_back::<P>();
        }
        drop(grads);
        // 0: done; 1: a failed write, the tiles kept (the step completed);
        // 2: the state is lost.
        let word = match &r {
            Ok(()) => 0,
            Err(_) if off.rescued() => 1,
            Err(_) => 2,
        };
        let verdict = exchange_words(&self.comm, &[word])?;
        let rank = self.rank;
        let usage = |what: String| Error::Usage { rank, what };
        if verdict.iter().any(|w| w[0] == 2) {
            let lost = first_failure(&self.comm, r.as_ref().err().filter(|_| word == 2))?;
            let (lost, why) = lost.expect("a rank lost its state");
            let msg = format!(
                "the optimizer swap file of rank {lost} failed in step {} ({why}); no rank's \
                 parameters changed",
                self.steps + 1
            );
            let e = match r {
                Err(e) if word == 2 => e,
                Err(e) => usage(format!("{e}; but {msg}, and the state is lost")),
                Ok(()) => usage(msg),
            };
            self.swap_failed = Some(e.to_string());
            return Err(e);
        }
        if verdict.iter().any(|w| w[0] == 1) {
            let failed = first_failure(&self.comm, r.as_ref().err())?;
            let (bad, why) = failed.expect("a rank's write failed");
            let e = match r {
                Err(e) => e,
                Ok(()) => usage(format!(
                    "a write to the optimizer swap file of rank {bad} failed in step {} ({why}); \
                     the step completed and rank {bad} keeps the state it could not write in \
                     host memory",
                    self.steps + 1
                )),
            };
            self.swap_failed = Some(e.to_string());
            self.swap_rescued = true;
            self.rescued_error = Some(e);
        }
        off.commit(&mut params)?;
        drop(params);
        self.param_write_back::<P>()
    }

    /// Outside the step (`unit_state`): every rank learns whether every
    /// rank could read its swap file; on an error the engine is failed
    /// (also after a rescued write failure: the state is lost now).
    fn swap_verdict(&mut self, local: Option<&Error>, what: &str) -> Result<()> {
        let failed = first_failure(&self.comm, local)?;
        if let Some(e) = local {
            self.swap_failed = Some(e.to_string());
            self.swap_rescued = false;
            return Ok(());
        }
        if let Some((bad, why)) = failed {
            let msg = format!("the {what} swap file of rank {bad} could not be read: {why}");
            self.swap_failed = Some(msg.clone());
            self.swap_rescued = false;
            return Err(self.usage(msg));
        }
        Ok(())
    }

    fn grad_home(&self, i: usize) -> &DynBuf {
        let u = &self.units[i];
        u.acc.as_ref().or(u.grad.as_ref()).expect("a gradient home")
    }

    fn optimizer_step(&mut self) -> Result<StepOutcome> {
        // This rank's part of the squared norm: its shard of every unit, in
        // unit order (stage 0 too, so that every stage adds the same terms).
        let ranges: Vec<Range<usize>> = (0..self.units.len())
            .map(|i| {
                let l = &self.units[i].layout;
                let abs = l.real_range(self.rank);
                if self.units[i].acc.is_some() && self.stage > 0 {
                    relative(abs, self.rank * l.shard_len)
                } else {
                    abs
                }
            })
            .collect();
        let sums = match self.units.first().map(|_| self.grad_home(0).dtype()) {
            None => Vec::new(),
            Some(DType::F32) => self.unit_sum_squares::<f32>(&ranges),
            Some(DType::BF16) => self.unit_sum_squares::<bf16>(&ranges),
            Some(DType::F16) => self.unit_sum_squares::<f16>(&ranges),
        };
        let local = sums.iter().fold(0f64, |a, s| a + s);
        let parts = exchange_words(&self.comm, &[local.to_bits()])?;
        let sumsq = parts.iter().fold(0f64, |a, w| a + f64::from_bits(w[0]));
        let loss_scale = self.loss_scale();
        let ga = self.cfg.gradient_accumulation_steps;
        let base = 1.0 / (f64::from(loss_scale) * self.world as f64 * ga as f64);
        let norm = sumsq.sqrt() * base;
        let overflow = !sumsq.is_finite();
        let lr = self.cfg.scheduler.lr_at(self.steps);
        let skipped = match self.scaler.as_mut() {
            Some(s) => s.update(overflow),
            None => overflow,
        };
        if overflow && self.scaler.is_none() {
            self.warn(format!(
                "step {}: the gradient norm is not finite; the update was skipped",
                self.steps + 1
            ));
        }
        if !skipped {
            let clip = clip_coefficient(norm, self.cfg.gradient_clipping);
            let grad_scale = (base * clip) as f32;
            let k = AdamWStep::new(&self.cfg.optimizer, lr, self.steps + 1, grad_scale);
            self.adamw_update(&k)?;
            self.steps += 1;
        }
        Ok(StepOutcome {
            boundary: true,
            skipped,
            grad_norm: Some(norm),
            lr,
            loss_scale: self.loss_scale(),
            steps: self.steps,
        })
    }

    /// Stages 1 and 2: every rank updated its shard of the full parameters;
    /// all-gather them in place, unit by unit, with up to
    /// `allgather_bucket_size` elements in flight. With `overlap_comm` this
    /// only starts them: the next forward pass waits for each unit in
    /// `gather` (as FSDP's forward all-gather), so the transfer hides
    /// behind the compute of the units before it. Stage 3 refreshes its
    /// persistent units.
    fn gather_updated_params(&mut self) -> Result<()> {
        match self.stage {
            0 => Ok(()),
            3 => self.gather_persistent(),
            _ => {
                // (With overlap_comm and the optimizer state on the device
                // tier, AdamW queued each unit as it finished it.)
                for i in 0..self.units.len() {
                    if !self.units[i].stale {
                        self.param_gather_queue.push_back(i);
                        self.units[i].stale = true;
                    }
                }
                if self.cfg.zero.overlap_comm {
                    self.advance_param_gathers(None)
                } else {
                    self.finish_param_gathers()
                }
            }
        }
    }

    /// Launches queued parameter all-gathers while they fit in
    /// `allgather_bucket_size` (at least one in flight), completing the
    /// oldest to make room, until unit `until` is home; with `None`, only
    /// launches what fits now.
    fn advance_param_gathers(&mut self, until: Option<usize>) -> Result<()> {
        let limit = self.cfg.zero.allgather_bucket_size;
        loop {
            while let Some(&j) = self.param_gather_queue.front() {
                let l = &self.units[j].layout;
                let (n, s) = (l.padded_numel, l.shard_len);
                if !self.param_gathers.is_empty() && self.param_gather_elems + n > limit {
                    break;
                }
                self.param_gather_queue.pop_front();
                let p = self.units[j].params.take().expect("params are home");
                self.stats.gather_bytes += ring_bytes(n, self.world, self.pdt);
                let work = p.all_gather(&self.comm, &vec![s; self.world]);
                self.param_gathers.push_back((j, work));
                self.param_gather_elems += n;
            }
            match until {
                Some(i) if self.units[i].stale => {}
                _ => return Ok(()),
            }
            let (j, w) = self
                .param_gathers
                .pop_front()
                .expect("a stale unit has its all-gather queued or in flight");
            self.param_gather_elems -= self.units[j].layout.padded_numel;
            self.units[j].params = Some(wait_traced(&self.tracer, self.rank, w)?);
            self.units[j].stale = false;
        }
    }

    /// Completes every parameter all-gather still queued or in flight
    /// (before anything reads or writes the parameters as a whole).
    pub(crate) fn finish_param_gathers(&mut self) -> Result<()> {
        while !self.param_gathers.is_empty() || !self.param_gather_queue.is_empty() {
            let last = self.param_gather_queue.back().copied();
            match last {
                Some(j) => self.advance_param_gathers(Some(j))?,
                None => {
                    let (j, w) = self.param_gathers.pop_front().expect("not empty");
                    self.param_gather_elems -= self.units[j].layout.padded_numel;
                    self.units[j].params = Some(wait_traced(&self.tracer, self.rank, w)?);
                    self.units[j].stale = false;
                }
            }
        }
        Ok(())
    }

    /// Drops the gradients accumulated since the last optimizer step (all
    /// ranks must call it at the same point).
    pub fn zero_grad(&mut self) -> Result<()> {
        self.check_swap("zero_grad")?;
        if self.units.iter().any(|u| u.lent) || self.open.is_some() || !self.inflight.is_empty() {
            return Err(self.usage(
                "zero_grad() with gradients of this micro-batch still out or in flight; call step() first"
                    .into(),
            ));
        }
        self.micro = 0;
        for u in &mut self.units {
            u.ready = false;
            if let Some(a) = u.acc.as_mut() {
                a.fill_zero();
            }
            if let Some(g) = u.grad.as_mut() {
                g.fill_zero();
            }
        }
        Ok(())
    }
}

/// The AdamW slices of unit `u` for the given ranges of its state,
/// gradient and parameters.
fn adamw_slices<G: Element, P: Element>(
    u: &mut Unit,
    state: Range<usize>,
    grad: Range<usize>,
    params: Range<usize>,
) -> AdamWSlices<'_, G, f32, P> {
    let g = u.acc.as_ref().or(u.grad.as_ref()).expect("a gradient home");
    let p = u.params.as_mut().expect("params are home");
    AdamWSlices {
        master: &mut u.master[state.clone()],
        grad: &g.slice::<G>().expect("one gradient dtype")[grad],
        m: &mut u.m[state.clone()],
        v: &mut u.v[state],
        low: Some(&mut p.slice_mut::<P>().expect("the parameter dtype")[params]),
    }
}

/// `range` shifted down by `base` (an empty range anywhere maps to 0..0:
/// a shard made only of padding).
fn relative(range: Range<usize>, base: usize) -> Range<usize> {
    if range.is_empty() {
        0..0
    } else {
        range.start - base..range.end - base
    }
}

/// Bytes a rank sends for a reduce-scatter or all-gather of `elems`
/// elements of `dtype` with a ring algorithm.
fn ring_bytes(elems: usize, world: usize, dtype: DType) -> u64 {
    (elems * (world - 1) / world.max(1) * dtype.size_in_bytes()) as u64
}

fn to_dyn<T: Element>(b: HostBuffer<T>) -> DynBuf {
    let mut b = Some(b);
    let any = &mut b as &mut dyn std::any::Any;
    if let Some(x) = any.downcast_mut::<Option<HostBuffer<f32>>>() {
        return DynBuf::F32(x.take().expect("set"));
    }
    if let Some(x) = any.downcast_mut::<Option<HostBuffer<bf16>>>() {
        return DynBuf::Bf16(x.take().expect("set"));
    }
    if let Some(x) = any.downcast_mut::<Option<HostBuffer<zero_core::f16>>>() {
        return DynBuf::F16(x.take().expect("set"));
    }
    unreachable!("Element is implemented for f32, bf16 and f16 only")
}

/// `HostBuffer<S>` as `HostBuffer<T>` when they are the same type (checked
/// by the caller through the dtype).
fn cast_buf<S: Element, T: Element>(b: HostBuffer<S>) -> HostBuffer<T> {
    let mut b = Some(b);
    (&mut b as &mut dyn std::any::Any)
        .downcast_mut::<Option<HostBuffer<T>>>()
        .and_then(Option::take)
        .expect("the caller checked the dtype")
}

impl<C: Communicator> std::fmt::Debug for Engine<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("stage", &self.stage)
            .field("units", &self.units.len())
            .field("param_dtype", &self.pdt)
            .field("steps", &self.steps)
            .finish()
    }
}
