//! Building an [`Engine`](super::Engine): the [`EngineBuilder`] collects the config, the
//! communicator, the backend and the registered units; [`EngineBuilder::build`]
//! checks that every rank agrees, allocates every buffer of the memory plan
//! and initialises this rank's parameters.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use zero_comm::agree::exchange_u64;
use zero_comm::Communicator;
use zero_core::backend::{CpuBackend, Stream};
use zero_core::config::{CheckFor, FrozenParams, OffloadDevice, Precision, ResolvedConfig};
use zero_core::memory::{Category, MemoryTracker, Tier};
use zero_core::optim::LossScaler;
use zero_core::partition::{PartitionPlan, UnitLayout, UnitSpec};
use zero_core::{DType, Device, HostBuffer};
use zero_offload::{check_free_space, DiskNeed};

use super::backend::{EngineBackend, EngineComm};
use super::ctx::Ctx;
use super::devbuf::DevBuf;
use super::faults::FaultPlan;
use super::gatherer::{FrozenHome, ParamGatherer};
use super::grad_swap::{self, GradSwap};
use super::groups::{group_of, relative, GroupMap};
use super::groups::{is_bias_norm_or_embedding, GroupPredicate, ParamGroup};
use super::init::Init;
use super::init::{fnv1a, mix};
use super::offload::{self, Offload, UnitRanges};
use super::optimizer::{Moments, OptimizerShard};
use super::param_offload::{self, ParamOffload};
use super::reducer::{GradReducer, SkipWait};
use super::saving::SaveHow;
use super::staging::{OffloadStage, ParamStepStage};
use super::state::store_as;
use super::step::OptimizerStep;
use super::unit::{Params, Unit, UnitId, Units};
use crate::agree::agree_on_setup;
use crate::trace::Tracer;
use crate::{Error, Result};

/// What [`EngineBuilder::build`] makes: the engine's components, built and
/// initialised, that the coordinator takes over (`Engine::assemble`).
pub(super) struct Built<C, B: EngineBackend> {
    pub(super) cx: Ctx<C, B>,
    pub(super) units: Units<B>,
    pub(super) reducer: GradReducer<B>,
    pub(super) scaler: Option<LossScaler>,
    pub(super) s3: ParamGatherer<B>,
    pub(super) opt: OptimizerShard<B>,
    pub(super) optimizer: OptimizerStep<B>,
    pub(super) poff: Option<ParamOffload>,
    /// What checkpoints record and keep besides the state.
    pub(super) saving: SaveHow,
    /// The config's own warnings (from its JSON, `config: ` first) and the
    /// components', in that order; the engine gives each once.
    pub(super) warnings: Vec<String>,
}

/// Builds an [`Engine`](super::Engine): register every unit, then [`EngineBuilder::build`].
pub struct EngineBuilder<C: Communicator, B: EngineBackend = CpuBackend> {
    pub(super) comm: C,
    /// The device backend every buffer lives on (`None`: the one
    /// [`EngineBackend::for_engine`] makes).
    backend: Option<B>,
    /// Everything else (the same whatever the communicator and backend).
    pub(super) s: Settings,
}

/// What an [`EngineBuilder`] collects besides its communicator and backend.
pub(super) struct Settings {
    cfg: ResolvedConfig,
    /// The device asked for (`None`: the backend's).
    device: Option<Device>,
    seed: u64,
    pub(super) specs: Vec<(UnitSpec, Vec<Init>)>,
    id: u64,
    optimizer_threads: Option<usize>,
    swap_faults: Option<FaultPlan>,
    param_swap_faults: Option<FaultPlan>,
    grad_swap_faults: Option<FaultPlan>,
    pub(super) tracer: Tracer,
    keep_last: usize,
    /// Test-only: a wait of the gradient path left out.
    skip_wait: Option<SkipWait>,
    /// Parameter groups, in the order added, with their predicates.
    groups: Vec<(ParamGroup, GroupPredicate)>,
    /// The device memory per rank `frozen_params: "auto"` plans for
    /// (`None`: this rank's share of the host's available memory).
    device_budget: Option<u64>,
    /// Device bytes the trainer allocates per micro-batch at most
    /// (activations and workspaces), reserved with the memory plan.
    device_workspace: u64,
    /// Checkpoints hold the frozen tensors too.
    save_frozen: bool,
    /// Set by [`Engine::load_checkpoint`](super::Engine::load_checkpoint): the load fills the master, m, v
    /// and parameters completely, so the build leaves their pages to be
    /// faulted in by the load instead of pre-faulting them.
    pub(super) for_load: bool,
    /// Test-only: the offloaded optimizer stages its gradients and
    /// parameters through host buffers on the copy streams, as on a GPU,
    /// also on the CPU backend.
    stage_offload: bool,
}

static NEXT_ENGINE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl<C: Communicator> EngineBuilder<C> {
    /// A builder with the defaults ([`Engine::builder`](super::Engine::builder)).
    pub(super) fn new(cfg: ResolvedConfig, comm: C) -> Self {
        EngineBuilder {
            comm,
            backend: None,
            s: Settings {
                cfg,
                device: None,
                seed: 0,
                specs: Vec::new(),
                id: NEXT_ENGINE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                optimizer_threads: None,
                swap_faults: None,
                param_swap_faults: None,
                grad_swap_faults: None,
                tracer: Tracer::disabled(),
                keep_last: 0,
                skip_wait: None,
                groups: Vec::new(),
                for_load: false,
                stage_offload: false,
                device_budget: None,
                device_workspace: 0,
                save_frozen: false,
            },
        }
    }
}

impl<C: EngineComm<B>, B: EngineBackend> EngineBuilder<C, B> {
    /// The device for parameters, gradients and optimizer state: `build`
    /// refuses a backend on another device (default: the backend's).
    pub fn device(mut self, device: Device) -> Self {
        self.s.device = Some(device);
        self
    }

    /// The seed of the deterministic initialisers (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.s.seed = seed;
        self
    }

    /// Threads for the optimizer step and the gradient-norm pass (the CPU
    /// kernels of [`CpuAdamW`](zero_core::optim::CpuAdamW)). Default: this machine's cores divided by
    /// the ranks running on it ([`Communicator::ranks_on_host`]), at least
    /// one, so that ranks sharing a machine do not oversubscribe its cores.
    /// It configures the default backend's kernels: with
    /// [`EngineBuilder::backend`] set the threads there instead
    /// ([`CpuBackend::with_adamw`]; `build` refuses both).
    pub fn optimizer_threads(mut self, threads: usize) -> Self {
        self.s.optimizer_threads = Some(threads.max(1));
        self
    }

    /// Faults to inject into the optimizer swap file
    /// (`offload_optimizer.device = "nvme"`), for testing the error paths:
    /// a failed block write, or a filesystem that rejects `O_DIRECT`. Not
    /// for production use. Ignored without nvme offload.
    #[cfg(feature = "testing")]
    pub fn swap_faults(mut self, faults: FaultPlan) -> Self {
        self.s.swap_faults = Some(faults);
        self
    }

    /// Faults to inject into the parameter swap file (stage 3 with
    /// `offload_param.device = "nvme"`), for testing the error paths: a
    /// failed block write (counted from the build, which writes each unit
    /// shard once), or a filesystem that rejects `O_DIRECT`. Not for
    /// production use. Ignored without nvme parameter offload.
    #[cfg(feature = "testing")]
    pub fn param_swap_faults(mut self, faults: FaultPlan) -> Self {
        self.s.param_swap_faults = Some(faults);
        self
    }

    /// Faults to inject into the gradient swap file
    /// (`offload_optimizer.swap_gradients`), for testing the error paths:
    /// a failed block write (counted from the first gradient stored). Not
    /// for production use. Ignored without the gradient swap.
    #[cfg(feature = "testing")]
    pub fn grad_swap_faults(mut self, faults: FaultPlan) -> Self {
        self.s.grad_swap_faults = Some(faults);
        self
    }

    /// Records this rank's phases into `tracer` (default
    /// [`Tracer::disabled`]): `gather` and `reduce` (cat `comm`),
    /// `optimizer`, and the offload spans (cat `offload`); see
    /// [`crate::trace`]. With the threads backend every rank may get a
    /// clone of one tracer.
    pub fn tracer(mut self, tracer: Tracer) -> Self {
        self.s.tracer = tracer;
        self
    }

    /// How many checkpoints [`Engine::save_checkpoint`](super::Engine::save_checkpoint) keeps under its
    /// root: after a save, the oldest `step*` directories beyond the
    /// newest `n` are deleted. Default 0: keep all.
    pub fn keep_last_checkpoints(mut self, n: usize) -> Self {
        self.s.keep_last = n;
        self
    }

    /// The device backend every buffer of the engine lives on and every
    /// operation is enqueued on: parameters and their all-gathers,
    /// gradient buckets and homes, the fp32 master and moments with the
    /// norm and AdamW kernels (see the streams and events in
    /// `src/engine/reducer.rs`, `gatherer.rs` and `optimizer.rs`).
    /// Default: `CpuBackend::with_adamw(CpuMode::Inline, ..)` with
    /// [`EngineBuilder::optimizer_threads`], which checks nothing and
    /// costs nothing; tests pass `CpuMode::Checked` or
    /// `CpuMode::Chaos` to have every ordering decision proved by the
    /// hazard checker. Give each rank its own backend: one host thread
    /// drives a backend (its clones share it).
    pub fn backend<B2: EngineBackend>(self, backend: B2) -> EngineBuilder<C, B2>
    where
        C: EngineComm<B2>,
    {
        self.rebuild(|c| c, Some(backend))
    }

    /// The communicator the engine will be built over (e.g. to bootstrap
    /// device collectives from it before [`EngineBuilder::map_comm`]).
    pub fn comm(&self) -> &C {
        &self.comm
    }

    /// The same builder over another communicator: `f` wraps or replaces
    /// this one (e.g. pairs it with device collectives,
    /// [`zero_comm::Paired`], before [`EngineBuilder::backend`] moves the
    /// builder to a GPU). Every rank must map its communicator alike.
    pub fn map_comm<C2: EngineComm<B>>(self, f: impl FnOnce(C) -> C2) -> EngineBuilder<C2, B> {
        let backend = self.backend.clone();
        self.rebuild(f, backend)
    }

    /// This builder with `comm` mapped by `f` and backend `backend`.
    fn rebuild<C2: EngineComm<B2>, B2: EngineBackend>(
        self,
        f: impl FnOnce(C) -> C2,
        backend: Option<B2>,
    ) -> EngineBuilder<C2, B2> {
        EngineBuilder {
            comm: f(self.comm),
            backend,
            s: self.s,
        }
    }

    /// Test-only (feature `testing`): leaves out one wait of the gradient
    /// path, so that a test can prove the backend's hazard checker catches
    /// it.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn skip_wait_for_tests(mut self, which: SkipWait) -> Self {
        self.s.skip_wait = Some(which);
        self
    }

    /// Test-only (feature `testing`): the offloaded optimizer (without
    /// parameter offload or `swap_gradients`) stages its gradients and
    /// parameters through host buffers on the copy streams, offloaded
    /// parameter shards go up to their gathers through host buffers, the
    /// `swap_gradients` window through one, and with parameter offload
    /// alone AdamW writes device slots that go down to the homes, as on a
    /// GPU, also on the CPU backend, so that the hazard checker proves
    /// those paths' order.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn stage_offload_for_tests(mut self) -> Self {
        self.s.stage_offload = true;
        self
    }

    /// Adds a parameter group: the tensors for which `member(unit, tensor)`
    /// holds (and no group added before holds) are updated with the
    /// scheduled learning rate times `group.lr_scale` and `group`'s
    /// weight decay (PyTorch's optimizer `param_groups`). The others keep
    /// the config's. Every rank must add the same groups (`build`
    /// checks). AdamW is elementwise: a tensor's update is the same as in
    /// a run whose config had its group's values.
    pub fn param_group(
        mut self,
        group: ParamGroup,
        member: impl Fn(&str, &str) -> bool + Send + 'static,
    ) -> Self {
        self.s.groups.push((group, Box::new(member)));
        self
    }

    /// Whether [`Engine::save_checkpoint`](super::Engine::save_checkpoint) also writes the frozen tensors
    /// (`frozen.safetensors` in the parameter dtype, in the checkpoint
    /// directory, recorded in its manifest with its CRC32; every rank
    /// reads it on load, and its values replace the registered ones).
    /// Default false: checkpoints hold the trainable state, and a load
    /// takes the frozen tensors from the registration (the base model's
    /// own files).
    pub fn checkpoint_frozen(mut self, include: bool) -> Self {
        self.s.save_frozen = include;
        self
    }

    /// The device memory per rank that `zero_optimization.frozen_params:
    /// "auto"` may plan for at stage 3 (default: on the CPU, this rank's
    /// share of the host's available memory, `MemAvailable` over the ranks
    /// on this machine, once the engine's other buffers are allocated). See
    /// [`FrozenParams`] for the rule.
    pub fn device_budget(mut self, bytes: u64) -> Self {
        self.s.device_budget = Some(bytes);
        self
    }

    /// The device memory the trainer allocates at most in a micro-batch
    /// besides the engine's buffers (its activations and workspaces, e.g.
    /// `zero_llama::device::workspace_bytes`): `build` checks it against
    /// the free memory and reserves it in the backend's pool with the
    /// engine's memory plan, so that the trainer's buffers do not ask the
    /// driver for memory in a step either. Default 0.
    pub fn device_workspace(mut self, bytes: u64) -> Self {
        self.s.device_workspace = bytes;
        self
    }

    /// No weight decay on biases, norms and embeddings (a group named
    /// `no_decay`, by the names of units and tensors:
    /// [`is_bias_norm_or_embedding`]), as Hugging Face trainers do.
    pub fn no_decay_on_biases_norms_and_embeddings(self) -> Self {
        self.param_group(
            ParamGroup::with_weight_decay("no_decay", 0.0),
            is_bias_norm_or_embedding,
        )
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
            let given = match i {
                Init::Values(v) => Some(("Init::Values holds", v.len())),
                Init::Source(s) => Some(("its Init::Source has", s.numel())),
                _ => None,
            };
            if let Some((what, n)) = given.filter(|&(_, n)| n != t.numel()) {
                return Err(usage(format!(
                    "register(`{}`): tensor `{}` has {} elements but {what} {n}",
                    spec.name,
                    t.name,
                    t.numel(),
                )));
            }
        }
        if self.s.specs.iter().any(|(s, _)| s.name == spec.name) {
            return Err(usage(format!(
                "register(`{}`): a unit of that name is already registered",
                spec.name
            )));
        }
        self.s.specs.push((spec, init));
        Ok(UnitId {
            engine: self.s.id,
            index: self.s.specs.len() - 1,
        })
    }

    /// The components [`EngineBuilder::build`] hands the coordinator.
    pub(super) fn into_parts(self) -> Result<Built<C, B>> {
        let EngineBuilder {
            comm,
            backend,
            s:
                Settings {
                    cfg,
                    device,
                    seed,
                    specs,
                    id,
                    optimizer_threads,
                    swap_faults,
                    param_swap_faults,
                    grad_swap_faults,
                    tracer,
                    keep_last,
                    skip_wait,
                    groups,
                    for_load,
                    device_budget,
                    device_workspace,
                    save_frozen,
                    stage_offload,
                },
        } = self;
        let rank = comm.rank();
        let world = comm.world_size();
        if cfg.world_size != world {
            return Err(Error::Usage {
                rank,
                what: format!(
                    "the config was resolved for world_size {} but the communicator has {world} ranks",
                    cfg.world_size
                ),
            });
        }
        check_agreement(&comm, &cfg, seed, &specs, &groups)?;

        let unit_specs: Vec<UnitSpec> = specs.iter().map(|(s, _)| s.clone()).collect();
        let plan = PartitionPlan::new(&unit_specs, world)?;
        cfg.check_runnable(&plan, CheckFor::Engine)?;
        let tracker = MemoryTracker::new(rank);
        let stage = cfg.zero.stage;
        let pdt = match cfg.precision {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        };
        // Before any work: room for the swap files on every nvme_path.
        agree_on_setup(
            &comm,
            check_disk_space(&cfg, &plan, rank, pdt, comm.ranks_on_host()),
            "swap files (nvme_path",
        )?;
        let offloading = cfg.zero.offload_optimizer.device != OffloadDevice::None;
        let param_offloading = stage == 3 && cfg.zero.offload_param.device != OffloadDevice::None;
        let threads = optimizer_threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / comm.ranks_on_host().max(1)).max(1)
        });
        let backend = match backend {
            Some(_) if optimizer_threads.is_some() => {
                return Err(Error::Usage {
                    rank,
                    what: "EngineBuilder: both optimizer_threads and backend were given; the \
                           optimizer runs on the backend's kernels, so set the threads there \
                           (CpuBackend::with_adamw(mode, CpuAdamW::new().with_threads(n)))"
                        .into(),
                })
            }
            Some(b) => b,
            None => B::for_engine(threads)?,
        };
        // Before anything is allocated, on every rank: the memory plan
        // against the device's free memory, an error naming the rank, the
        // largest buffers and the bytes missing; then the plan reserved in
        // the backend's pool, so that no allocation of it asks the driver
        // for memory in a step.
        if let Some(free) = backend.device_free().transpose() {
            // The ranks on this rank's device (ranks sharing a GPU split
            // its free memory): every rank says which device it is on.
            let id = backend.device_id();
            let word = match &id {
                Ok(Some([lo, hi])) => [1, *lo, *hi],
                _ => [0, rank as u64, 0],
            };
            let ids = exchange_u64(&comm, &word)?;
            let sharing = ids.iter().filter(|w| w[..] == word[..]).count().max(1) as u64;
            let fits = id.and(free).and_then(|free| {
                let model = crate::estimate::Model::from_units(unit_specs.clone())?;
                let work = crate::estimate::Workload::default();
                let plan = crate::estimate::estimate(&model, &cfg, &work)?
                    .device_plan_with(rank, device_workspace)?;
                plan.check_capacity(free / sharing)
                    .map_err(|e| shared_device(e, sharing, free))?;
                backend
                    .reserve_device(plan.total_bytes())
                    .map_err(|e| plan.refused(free, &e.to_string()).into())
            });
            agree_on_setup(
                &comm,
                fits,
                "device memory (the memory plan against the free memory",
            )?;
        }
        if let Some(d) = device.filter(|d| d.to_string() != backend.device().to_string()) {
            return Err(Error::Unsupported {
                what: format!(
                    "EngineBuilder::device({d}) but the backend runs on {}: give the engine a \
                     backend on {d} (EngineBuilder::backend)",
                    backend.device()
                ),
            });
        }
        // The initial values, computed on demand: offloaded state and
        // shards are written tile by tile and shard by shard straight to
        // their tier, so the whole model is never in memory.
        let initial = Initial {
            specs: &specs,
            layouts: plan.units(),
            seed,
            failed: RefCell::new(None),
        };
        // Unit `i`'s first element of this rank's optimizer state, and of
        // its parameters.
        let state_base = |l: &UnitLayout| if stage == 0 { 0 } else { rank * l.shard_len };
        let param_base = |l: &UnitLayout| if stage == 3 { rank * l.shard_len } else { 0 };
        let mut ranges = Vec::new();
        let mut moments = Vec::with_capacity(specs.len());
        let mut units = Vec::with_capacity(specs.len());
        for (u, ((spec, _), layout)) in specs.iter().zip(plan.units()).enumerate() {
            let full = layout.padded_numel;
            let shard = layout.shard_len;
            let mut allocs = Vec::new();
            let mut track = |tier: Tier, cat: Category, bytes: u64| {
                allocs.push(tracker.allocate(tier, cat, bytes));
            };
            // The element ranges this rank's optimizer state and parameters
            // cover.
            let state_start = state_base(layout);
            let state_len = if stage == 0 { full } else { shard };
            let p_start = param_base(layout);
            // Of the trainable segment; stages 0–2 hold the frozen segment
            // after it in the same buffer.
            let p_len = if stage == 3 { shard } else { full };
            let mlen = if offloading { 0 } else { state_len };
            let mut master = HostBuffer::<f32>::zeros(mlen)?;
            let mut params = if param_offloading {
                None
            } else {
                let label = format!("params `{}`", spec.name);
                let len = if stage == 3 {
                    p_len
                } else {
                    layout.param_len()
                };
                Some(DevBuf::alloc(&backend, &comm, pdt, len, &label)?)
            };
            // Stages 0–2: the frozen segment follows in the same buffer
            // (stage 3 keeps it apart, see below).
            let frozen_seg = layout.frozen_range();
            if let (Some(p), false, true) = (params.as_mut(), frozen_seg.is_empty(), stage < 3) {
                if initial.has_values(u) {
                    let mut values = vec![0f32; frozen_seg.len()];
                    initial.fill_or_keep(u, frozen_seg.clone(), &mut values);
                    p.store_slice(&backend, frozen_seg.start, &values)?;
                }
            }
            // Initialise only what this rank stores here: the union of its
            // master and parameter ranges (new buffers are zero already).
            let mut stored = Vec::new();
            if mlen > 0 {
                stored.push(state_start..state_start + state_len);
            }
            if params.is_some() {
                stored.push(p_start..p_start + p_len);
            }
            let lo = stored.iter().map(|r| r.start).min();
            let hi = stored.iter().map(|r| r.end).max();
            if let (Some(lo), Some(hi), true) = (lo, hi, initial.has_values(u)) {
                let mut values = vec![0f32; hi - lo];
                initial.fill_or_keep(u, lo..hi, &mut values);
                if mlen > 0 {
                    master.copy_from_slice(&values[state_start - lo..][..state_len]);
                }
                if let Some(p) = params.as_mut() {
                    p.store_slice(&backend, 0, &values[p_start - lo..][..p_len])?;
                }
            }
            // Large buffers are fresh mappings: fault every page in now so
            // that the step takes no page faults — except what a checkpoint
            // load is about to fill completely.
            if !for_load {
                master.prefault();
                if let Some(p) = params.as_mut() {
                    p.prefault(&backend)?;
                }
            }
            if !offloading {
                track(Tier::Device, Category::Master, (state_len * 4) as u64);
                track(Tier::Device, Category::Moments, (state_len * 8) as u64);
            }
            if let Some(p) = &params {
                track(Tier::Device, Category::Params, p.bytes());
            }
            let (mut m, mut v) = (HostBuffer::zeros(mlen)?, HostBuffer::zeros(mlen)?);
            if !for_load {
                m.prefault();
                v.prefault();
            }
            let name = &spec.name;
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
            }
            moments.push(Moments {
                master: backend.adopt(master, &format!("master `{name}`"))?,
                m: backend.adopt(m, &format!("m `{name}`"))?,
                v: backend.adopt(v, &format!("v `{name}`"))?,
            });
            units.push(Unit {
                layout: Arc::new(layout.clone()),
                params: match params {
                    Some(p) => Params::Home(Arc::new(p)),
                    None => Params::Offloaded,
                },
                gathers: 0,
                _allocs: allocs,
            });
        }

        initial.agree(&comm)?;
        let gswap = if cfg.zero.offload_optimizer.swap_gradients {
            let options = offload::swap_options(&cfg, rank, "gradients");
            let built = GradSwap::new(&cfg, &plan, (rank, options), &tracker, grad_swap_faults);
            Some(
                agree_on_setup(
                    &comm,
                    built,
                    "the gradient swap (zero_optimization.offload_optimizer.swap_gradients",
                )?
                .traced(tracer.clone(), rank),
            )
        } else {
            None
        };
        let mut reducer = GradReducer::new(
            &cfg,
            &plan,
            &comm,
            &tracker,
            (backend.clone(), backend.device_free()?.is_none()),
            skip_wait,
            gswap,
        )?;
        // What the parameter all-gathers start after: the compute stream's
        // work (the shard copied in, AdamW), unless a test removes that wait.
        let gather_after = match skip_wait {
            Some(SkipWait::ParamsBeforeGather) => Stream::Comm,
            _ => Stream::Compute,
        };
        let offload = if offloading {
            let master = |i: usize, r: Range<usize>, out: &mut [f32]| {
                let base = state_base(&plan.units()[i]);
                initial.fill(i, base + r.start..base + r.end, out)
            };
            let built = Offload::new(&cfg, rank, pdt, ranges, &master, &tracker, swap_faults);
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
        initial.agree(&comm)?;
        let poff = if param_offloading {
            let size = pdt.size_in_bytes();
            let bytes = plan.units().iter().map(|l| l.shard_len * size).collect();
            let shard = |i: usize, out: &mut [u8]| {
                let l = &plan.units()[i];
                let mut values = vec![0f32; l.shard_len];
                let base = param_base(l);
                initial.fill(i, base..base + l.shard_len, &mut values)?;
                store_as(pdt, &values, out);
                Ok(())
            };
            let built =
                ParamOffload::new(&cfg, rank, pdt, bytes, &shard, &tracker, param_swap_faults);
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
        // Stage 3: where the frozen segments live, once everything else is
        // allocated (the `auto` policy weighs them against what is left).
        let frozen_policy = choose_frozen_policy(&cfg, &plan, &comm, &tracker, pdt, device_budget)?;
        let mut frozen = Vec::with_capacity(specs.len());
        let mut frozen_allocs = Vec::new();
        for (u, layout) in plan.units().iter().enumerate() {
            let seg = layout.frozen_range();
            if stage < 3 || seg.is_empty() {
                frozen.push(None);
                continue;
            }
            // The resident segment, or this rank's shard of it.
            let r = match frozen_policy {
                FrozenParams::Resident => seg.clone(),
                _ => {
                    let fs = layout.frozen_shard_len();
                    seg.start + rank * fs..seg.start + (rank + 1) * fs
                }
            };
            let mut values = vec![0f32; r.len()];
            initial.fill_or_keep(u, r.clone(), &mut values);
            let label = format!("frozen params `{}`", layout.name);
            let home = match frozen_policy {
                FrozenParams::Resident => {
                    // The unit's own gathered buffer, its frozen segment
                    // filled once.
                    let label = format!("gathered `{}`", layout.name);
                    let mut f = DevBuf::alloc(&backend, &comm, pdt, layout.param_len(), &label)?;
                    if !for_load {
                        f.prefault(&backend)?;
                    }
                    f.store_slice(&backend, seg.start, &values)?;
                    let size = pdt.size_in_bytes() as u64;
                    frozen_allocs.push(tracker.allocate(
                        Tier::Device,
                        Category::Params,
                        seg.len() as u64 * size,
                    ));
                    frozen_allocs.push(tracker.allocate(
                        Tier::Device,
                        Category::GatheredParams,
                        seg.start as u64 * size,
                    ));
                    FrozenHome::Resident(Some(f))
                }
                FrozenParams::Offload => {
                    let mut bytes = vec![0u8; r.len() * pdt.size_in_bytes()];
                    store_as(pdt, &values, &mut bytes);
                    frozen_allocs.push(tracker.allocate(
                        Tier::Host,
                        Category::Params,
                        bytes.len() as u64,
                    ));
                    FrozenHome::Host(bytes)
                }
                _ => {
                    let mut f = DevBuf::alloc(&backend, &comm, pdt, r.len(), &label)?;
                    if !for_load {
                        f.prefault(&backend)?;
                    }
                    f.store_slice(&backend, 0, &values)?;
                    frozen_allocs.push(tracker.allocate(Tier::Device, Category::Params, f.bytes()));
                    FrozenHome::Shard(f)
                }
            };
            frozen.push(Some(home));
        }
        initial.agree(&comm)?;
        if let Some(u) = units.first_mut() {
            u._allocs.extend(frozen_allocs);
        }
        if cfg.zero.offload_optimizer.swap_gradients
            && (stage_offload || backend.device_free()?.is_some())
        {
            reducer.stage_window(&tracker)?;
        }
        let mut s3 = ParamGatherer::new(&cfg, &plan, frozen);
        if skip_wait == Some(SkipWait::FrozenBeforeRead) {
            s3.skip_frozen_wait();
        }
        // On a device, shards kept in host memory go up to the gathered
        // buffers through host buffers (pinned on a GPU) on the
        // host-to-device stream.
        let ring = crate::plan::upload_ring(
            &cfg,
            &plan,
            param_offloading,
            frozen_policy == FrozenParams::Offload,
        );
        if let (3, Some((count, len))) = (stage, ring) {
            // (On the CPU backend the host writes them into the gathers.)
            if stage_offload || backend.device_free()?.is_some() {
                s3.stage_uploads(&backend, &tracker, (count, len, pdt))?;
            }
        }
        let adam = backend.host_adamw(threads);
        // The offloaded optimizer on a device: pinned copies of the
        // gradient homes and of the parameters (parameter offload and
        // swap_gradients keep theirs in host memory already).
        let offload_stage = if offloading
            && !param_offloading
            && !cfg.zero.offload_optimizer.swap_gradients
            && reducer.home_dtype().is_some()
            && (stage_offload || backend.device_free()?.is_some())
        {
            reducer.stage_homes(&tracker)?;
            let params: Vec<_> = units
                .iter()
                .map(|u| (pdt, u.home().map_or(0, |p| p.len())))
                .collect();
            Some(OffloadStage::new(&backend, &tracker, &params)?)
        } else {
            None
        };
        // Parameter offload with the optimizer state on a device: AdamW
        // stays on the device and the updated shards go down through two
        // slots of the largest shard.
        let param_stage = if param_offloading
            && !offloading
            && reducer.home_dtype().is_some()
            && (stage_offload || backend.device_free()?.is_some())
        {
            let largest = plan.units().iter().map(|l| l.shard_len).max();
            Some(ParamStepStage::new(
                &backend,
                &comm,
                &tracker,
                pdt,
                largest.unwrap_or(0),
            )?)
        } else {
            None
        };
        let opt = OptimizerShard::new(
            stage,
            rank,
            plan.units(),
            moments,
            |i| reducer.has_acc(i),
            (adam, offload, GroupMap::new(plan.units(), &groups)),
        );
        let optimizer = OptimizerStep::new(
            opt.offload().is_some(),
            reducer.grad_swap().is_some(),
            poff.is_some(),
            offload_stage,
            param_stage,
        );
        let mut warnings: Vec<String> = cfg
            .warnings
            .0
            .iter()
            .map(|w| format!("config: {w}"))
            .collect();
        warnings.extend(opt.offload().map(Offload::warnings).unwrap_or_default());
        warnings.extend(
            poff.as_ref()
                .map(ParamOffload::warnings)
                .unwrap_or_default(),
        );
        warnings.extend(
            reducer
                .grad_swap()
                .map(GradSwap::warnings)
                .unwrap_or_default(),
        );
        let saving = SaveHow {
            model: cfg.zero.gather_16bit_weights_on_model_save,
            frozen: save_frozen,
            keep_last,
            seed,
        };
        let (rank, world) = (comm.rank(), comm.world_size());
        let cx = Ctx {
            id,
            comm,
            backend,
            cfg,
            plan,
            tracker,
            tracer,
            rank,
            world,
            stage,
            pdt,
            gather_after,
            frozen_policy,
        };
        Ok(Built {
            cx,
            warnings,
            units: Units::new(units),
            reducer,
            scaler,
            s3,
            opt,
            optimizer,
            poff,
            saving,
        })
    }
}

/// The initial values of the registered units, computed (or read from
/// their sources) for any element range on demand.
struct Initial<'a> {
    specs: &'a [(UnitSpec, Vec<Init>)],
    layouts: &'a [UnitLayout],
    seed: u64,
    /// The first source error of [`Initial::fill_or_keep`], for
    /// [`Initial::agree`].
    failed: RefCell<Option<Error>>,
}

impl Initial<'_> {
    /// Whether unit `u` has any initialiser but zeros.
    fn has_values(&self, u: usize) -> bool {
        self.specs[u].1.iter().any(|i| !matches!(i, Init::Zeros))
    }

    /// Unit `u`'s elements `r` (of the padded unit) into `out`; padding is
    /// zero. A source's error is returned.
    fn fill(&self, u: usize, r: Range<usize>, out: &mut [f32]) -> Result<()> {
        out.fill(0.0);
        if !self.has_values(u) {
            return Ok(());
        }
        let (spec, inits) = &self.specs[u];
        let key = fnv1a(spec.name.as_bytes());
        for t in &self.layouts[u].tensors {
            // The initialiser and its stream are the registered tensor's
            // (the layout puts frozen tensors after the trainable ones).
            let Some(ti) = spec.tensors.iter().position(|s| s.name == t.name) else {
                continue;
            };
            let (lo, hi) = (t.offset.max(r.start), (t.offset + t.numel).min(r.end));
            if lo < hi {
                let out = &mut out[lo - r.start..hi - r.start];
                inits[ti].fill(self.seed, key, ti, lo - t.offset..hi - t.offset, out)?;
            }
        }
        Ok(())
    }

    /// [`Initial::fill`] where the caller cannot return an error (and must
    /// not: the other ranks go on to a collective): the first error is
    /// kept for [`Initial::agree`], and later fills give zeros.
    fn fill_or_keep(&self, u: usize, r: Range<usize>, out: &mut [f32]) {
        if self.failed.borrow().is_some() {
            out.fill(0.0);
        } else if let Err(e) = self.fill(u, r, out) {
            *self.failed.borrow_mut() = Some(e);
        }
    }

    /// Every rank learns whether any rank's [`Initial::fill_or_keep`]
    /// failed so far, and all return the error together (a collective).
    fn agree<C: Communicator>(&self, comm: &C) -> Result<()> {
        let mine = self.failed.borrow_mut().take().map_or(Ok(()), Err);
        agree_on_setup(comm, mine, "initial parameter values (Init::Source")
    }
}

/// `e`, an error of a memory plan checked against `1/sharing` of the
/// `free` bytes of a device that `sharing` ranks use, saying so.
fn shared_device(e: zero_core::Error, sharing: u64, free: u64) -> Error {
    match e {
        zero_core::Error::OutOfDeviceMemory {
            rank,
            needed,
            available,
            msg,
        } if sharing > 1 => Error::from(zero_core::Error::OutOfDeviceMemory {
            rank,
            needed,
            available,
            msg: format!(
                "{msg} ({sharing} ranks share this device: each has 1/{sharing} of its {free} \
                 free bytes)"
            ),
        }),
        e => Error::from(e),
    }
}

/// Stage 3: where the frozen segments live (`zero_optimization.frozen_params`,
/// never `Auto` in the answer). `auto` is `resident` when the device memory
/// the engine has allocated so far (its tracker) plus the buffers resident
/// units keep (each such unit's gathered buffer: its frozen segment in full
/// and its trainable segment) fits the budget — `device_budget`, or else this rank's
/// share of the host's available memory (`MemAvailable` over the ranks on
/// this machine: the engine's buffers are allocated and faulted in by then,
/// so only the frozen segments are weighed) — on every rank; else `offload`
/// with `offload_param.device` `"cpu"`, else `shard`. All ranks take the
/// same decision (a collective).
fn choose_frozen_policy<C: Communicator>(
    cfg: &ResolvedConfig,
    plan: &PartitionPlan,
    comm: &C,
    tracker: &MemoryTracker,
    pdt: DType,
    budget: Option<u64>,
) -> Result<FrozenParams> {
    if cfg.zero.stage < 3 || plan.frozen_numel() == 0 {
        return Ok(FrozenParams::Resident);
    }
    if cfg.zero.frozen_params != FrozenParams::Auto {
        return Ok(cfg.zero.frozen_params);
    }
    // The buffers resident units keep: both segments.
    let resident: u64 = plan
        .units()
        .iter()
        .filter(|l| l.frozen_padded > 0)
        .map(|l| (l.param_len() * pdt.size_in_bytes()) as u64)
        .sum();
    let fits = match budget {
        Some(b) => tracker.tier_current(Tier::Device).saturating_add(resident) <= b,
        None => {
            let available = crate::host::mem_available().unwrap_or(u64::MAX);
            resident <= available / comm.ranks_on_host().max(1) as u64
        }
    };
    let all = exchange_u64(comm, &[u64::from(fits)])?;
    Ok(if all.iter().all(|w| w[0] == 1) {
        FrozenParams::Resident
    } else if cfg.zero.offload_param.device == OffloadDevice::Cpu {
        FrozenParams::Offload
    } else {
        FrozenParams::Shard
    })
}

/// The swap files this rank's setup will create under each `nvme_path`
/// (`offload_optimizer`, and `offload_param` at stage 3), times the ranks
/// on this machine (each writes its own files there), against the free
/// space of each filesystem: too little is an error naming the path and
/// both figures, before anything is allocated or written.
fn check_disk_space(
    cfg: &ResolvedConfig,
    plan: &PartitionPlan,
    rank: usize,
    pdt: DType,
    ranks_here: usize,
) -> Result<()> {
    let z = &cfg.zero;
    let ranks_here = ranks_here.max(1);
    let mut needs = Vec::new();
    let mut need = |dir: &Option<std::path::PathBuf>, per_rank: u64, what: &str| {
        needs.push(DiskNeed {
            path: dir.clone().unwrap_or_default(),
            bytes: per_rank.saturating_mul(ranks_here as u64),
            what: format!("{what} swap files ({per_rank} bytes × {ranks_here} rank(s) here)"),
        });
    };
    if z.offload_optimizer.device == OffloadDevice::Nvme {
        let lens: Vec<usize> = plan
            .units()
            .iter()
            .map(|l| {
                if z.stage == 0 {
                    l.padded_numel
                } else {
                    l.shard_len
                }
            })
            .collect();
        let len = offload::swap_file_len(cfg, rank, &lens)?;
        need(&z.offload_optimizer.nvme_path, len, "optimizer");
        if z.offload_optimizer.swap_gradients {
            let options = offload::swap_options(cfg, rank, "gradients");
            let len = grad_swap::swap_file_len(&options, &crate::plan::grad_home_bytes(cfg, plan))?;
            need(&z.offload_optimizer.nvme_path, len, "gradient");
        }
    }
    if z.stage == 3 && z.offload_param.device == OffloadDevice::Nvme {
        let bytes: Vec<usize> = plan
            .units()
            .iter()
            .map(|l| l.shard_len * pdt.size_in_bytes())
            .collect();
        let len = param_offload::swap_file_len(cfg, rank, &bytes)?;
        need(&z.offload_param.nvme_path, len, "parameter");
    }
    Ok(check_free_space(&needs)?)
}

/// Every rank must register the same units (names, tensors, shapes) with
/// the same config and seed. All ranks learn the verdict, so all fail
/// together instead of hanging in a later collective.
fn check_agreement<C: Communicator>(
    comm: &C,
    cfg: &ResolvedConfig,
    seed: u64,
    specs: &[(UnitSpec, Vec<Init>)],
    groups: &[(ParamGroup, GroupPredicate)],
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
                if !t.trainable {
                    text.push_str(":frozen");
                }
                if let Some(i) = group_of(groups, &s.name, &t.name).checked_sub(1) {
                    let g = &groups[i].0;
                    text.push_str(&format!(
                        "@{}:{:?}:{:?}",
                        g.name, g.lr_scale, g.weight_decay
                    ));
                }
            }
            fnv1a(text.as_bytes())
        })
        .collect();
    // Round 1: counts (as exact small floats) and the config digest.
    let mut head = vec![specs.len() as u64, cfg_digest];
    let all = exchange_u64(comm, &head)?;
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
    let all = exchange_u64(comm, &mine)?;
    for i in 0..max {
        if let Some(r) = (0..world).find(|&r| all[r][i] != mine[i]) {
            let here = specs
                .get(i)
                .map_or("nothing".to_string(), |(s, _)| format!("`{}`", s.name));
            let there = if (i as u64) < counts[r] {
                "a different unit (name, tensors, shapes, frozen tensors or parameter groups)"
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
    check_initial_values(comm, specs)
}

/// Round 3 of [`check_agreement`] (the units agree by now): every rank must
/// register the same initialisers, [`Init::Values`] with the same values
/// (a per-thread RNG would otherwise train a different model on each rank,
/// unnoticed at stage 0). One word per tensor ([`Init::digest`]); the error
/// names the first tensor that differs and the ranks, the same on every
/// rank.
fn check_initial_values<C: Communicator>(comm: &C, specs: &[(UnitSpec, Vec<Init>)]) -> Result<()> {
    let mine: Vec<u64> = specs
        .iter()
        .flat_map(|(_, inits)| inits.iter().map(Init::digest))
        .collect();
    let all = exchange_u64(comm, &mine)?;
    let tensors = specs
        .iter()
        .flat_map(|(s, _)| s.tensors.iter().map(move |t| (s, t)));
    for (k, (unit, tensor)) in tensors.enumerate() {
        if let Some(r) = (1..all.len()).find(|&r| all[r][k] != all[0][k]) {
            return Err(Error::Disagreement {
                rank: comm.rank(),
                what: format!(
                    "the initial values of tensor `{}` of unit `{}` differ: rank 0 and rank {r} \
                     registered different ones (Init::Values with other values, or another \
                     initialiser); every rank must start from the same model: draw \
                     Init::Values from an RNG seeded alike on every rank, or read them from \
                     the same file",
                    tensor.name, unit.name
                ),
            });
        }
    }
    Ok(())
}
