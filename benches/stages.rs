//! The trade-off per ZeRO stage on a real model: the Llama model of
//! `examples/llama_sft.rs` (its `SftModel`, data and engine config),
//! trained on 2 ranks of the threads backend in bf16 under stage 0, 1, 2,
//! 3, 3 + `offload_optimizer` cpu, 3 + `offload_optimizer` and
//! `offload_param` cpu, and 3 + nvme (both, swap files in a fresh
//! directory under the temp dir).
//!
//! With `--lora R` the model trains LoRA adapters of rank R (alpha 2R) on
//! all seven projections with the base frozen (issue 20's experiment:
//! stage 3 with optimizer and parameter offload ≤ 1.3× stage 0, device
//! memory at most stage 2's).
//!
//! Per setup: `--warmup W` steps (default 2), then `--steps N` timed steps
//! (default 8), one micro-batch of `--batch B` samples per rank each
//! (default 16, the example's). Reported:
//!
//! - **step**: the median over the timed steps of the slowest rank's step
//!   time (`train_micro_batch` + `step`), and its ratio to stage 0 in the
//!   same run, against the targets of issue 8 (stages 1–2 ≤ 1.05, stage 3
//!   ≤ 1.15, 3 + optimizer and parameter offload to cpu ≤ 1.5);
//! - **tokens/s** (padded tokens of every rank), **achieved FLOP/s**
//!   (3 × `forward_flops`, summed over ranks) and **MFU** against the fp32
//!   GEMM peak measured on every rank at once (the example's
//!   `llama::train::measure_gemm_peak`) right before each setup runs; the best of those
//!   measurements is the machine's peak (one taken while something else
//!   ran is low);
//! - **bytes sent per rank per step** (`EngineStats::reduce_bytes +
//!   gather_bytes`, ring convention; counters reset after the warm-up);
//! - **peak device / host / NVMe bytes per rank** from the engine's memory
//!   tracker (largest rank), next to `zero::estimate`'s prediction for the
//!   same model, config and sequence length, and the device model states
//!   once built (ZeRO's figure); the device ordering
//!   0 > 1 > 2 > 3 > 3+opt cpu > 3+opt+param cpu is checked for the peaks
//!   and the model states, measured and estimated;
//! - **CPU utilization**: process CPU time (`getrusage(RUSAGE_SELF)`, user +
//!   system) over the timed steps ÷ (wall time × cores);
//! - **communication and compute**, from a [`Tracer`] per setup (events of
//!   the timed steps only), per rank (the table shows the mean over ranks),
//!   by [`zero::trace::overlap`]:
//!   - `coll ms`: time per step in which the rank's collectives ran on its
//!     communicator's progress thread (the `collective` spans: parameter
//!     all-gathers and gradient reductions, from their start to their
//!     result);
//!   - `wait ms`: time per step the trainer was blocked waiting for them
//!     (the engine's `comm` spans, bucket copies included);
//!   - `hidden`: the share of `coll` during which the trainer computed
//!     (inside its forward/backward or the optimizer, not blocked in a
//!     wait) — the overlap of communication with compute. Issue 8's target
//!     is ≥ 80% at stages 2 and 3.
//!   - `bare ms`: the same bytes in bare collectives on an idle machine
//!     (all-reduce at stage 0, else reduce-scatter, in the communication
//!     dtype; all-gather in bf16; each on a buffer of Ψ elements, measured
//!     right before the setup), for scale: the engine's collectives
//!     compete with compute for the 2 cores, so they run longer.
//!
//! The engine config is llama_sft's (bf16, its optimizer settings) tuned
//! for overlap as a user tuning for speed would: `overlap_comm` on at
//! stages 1–3 (gradient reductions during backward at stages 2–3; the
//! all-gather of updated parameters during the next forward at stages
//! 1–2), and `reduce_bucket_size`, `allgather_bucket_size`,
//! `stage3_prefetch_bucket_size` and `stage3_max_reuse_distance` at
//! Ψ ÷ (layers + 1), a bit under one transformer block: a bucket then
//! holds one block's gradient and starts reducing as soon as that block's
//! backward is done, stage 3 prefetches the next block, and keeps a
//! released block only when it is used again within about a block (the
//! last block between forward and backward). (DeepSpeed's defaults, 5e8,
//! 5e7 and 1e9 elements, are sized for billion-parameter models: here one
//! bucket would hold the whole model, nothing could overlap, and stage 3
//! would keep the whole model gathered.)
//!
//! Output: the tables on stdout, `target/zero-bench/stages.json` and
//! `stages.csv`, a Chrome trace of each setup's timed steps
//! (`stages-trace-<setup>.json`, `+` and spaces as `_`), and `target/zero-bench/stages.svg` (peak device and host
//! memory per rank against median step time, one labelled point per
//! setup: the picture to choose from).
//!
//! `cargo bench --bench stages [-- options]`; options: `--steps N`,
//! `--warmup W`, `--batch B`, `--model tiny|task|bench|small` (default
//! `bench`: the `small` preset's widths with 6 layers, ~17 M parameters, about
//! a second per step on 2 cores), `--dim`, `--layers`, `--heads`,
//! `--kv-heads`, `--hidden` (override the preset), `--setups 0,1,2,3,3o,3op,3n`
//! (a subset), `--reps R` (repetitions of the bare collectives, default 3).
//!
//! The developer and CI machines have 2 cores, and CI builds may run beside
//! this benchmark: timings drift 10–25% between runs, which is why every
//! ratio is taken against baselines of the same run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use zero::comm::{even_counts, Communicator, ReduceOp, ThreadComm, ThreadGroup};
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::Tier;
use zero::core::optim::{LrSchedule, WarmupType};
use zero::core::{bf16, f16, DType, Element};
use zero::estimate::{estimate, LlamaDims, Lora, Model, Setup, Workload, LORA_TARGETS};
use zero::trace::{overlap, write_chrome_trace};
use zero::{Engine, Tracer};
use zero_llama as llama;

use llama::data;
use llama::lora::LoraConfig;
use llama::train::{forward_flops, LoraSetup, SftModel};
use llama::Config;

const RANKS: usize = 2;
const SEED: u64 = 42;
const MIB: f64 = (1u64 << 20) as f64;

struct Args {
    steps: usize,
    warmup: usize,
    batch: usize,
    model: String,
    dim: Option<usize>,
    layers: Option<usize>,
    heads: Option<usize>,
    kv_heads: Option<usize>,
    hidden: Option<usize>,
    setups: Vec<Setup>,
    reps: usize,
    /// `--lora R`: LoRA of rank R (alpha 2R) on all seven projections,
    /// the base frozen (issue 20's experiment).
    lora: Option<usize>,
}

/// `--setups` short names.
fn setup_by_name(s: &str) -> Setup {
    match s {
        "0" => Setup::Stage0,
        "1" => Setup::Stage1,
        "2" => Setup::Stage2,
        "3" => Setup::Stage3,
        "3o" => Setup::Stage3OffloadOptimizer,
        "3op" => Setup::Stage3OffloadAll,
        "3n" => Setup::Stage3Nvme,
        _ => panic!("--setups: one of 0,1,2,3,3o,3op,3n, not `{s}`"),
    }
}

fn parse_args() -> Args {
    let mut a = Args {
        steps: 8,
        warmup: 2,
        batch: 16,
        model: "bench".into(),
        dim: None,
        layers: None,
        heads: None,
        kv_heads: None,
        hidden: None,
        setups: Setup::ALL.to_vec(),
        reps: 3,
        lora: None,
    };
    let mut it = std::env::args().skip(1);
    let num = |s: Option<String>, what: &str| -> usize {
        s.and_then(|s| s.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or_else(|| panic!("{what} needs a positive integer"))
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--steps" => a.steps = num(it.next(), "--steps"),
            "--warmup" => a.warmup = num(it.next(), "--warmup"),
            "--batch" => a.batch = num(it.next(), "--batch"),
            "--reps" => a.reps = num(it.next(), "--reps"),
            "--model" => a.model = it.next().expect("--model needs a preset name"),
            "--dim" => a.dim = Some(num(it.next(), "--dim")),
            "--layers" => a.layers = Some(num(it.next(), "--layers")),
            "--heads" => a.heads = Some(num(it.next(), "--heads")),
            "--kv-heads" => a.kv_heads = Some(num(it.next(), "--kv-heads")),
            "--hidden" => a.hidden = Some(num(it.next(), "--hidden")),
            "--lora" => a.lora = Some(num(it.next(), "--lora")),
            "--setups" => {
                a.setups = it
                    .next()
                    .expect("--setups needs a comma-separated list")
                    .split(',')
                    .map(|s| setup_by_name(s.trim()))
                    .collect()
            }
            _ => {} // cargo passes --bench; ignore what we do not know
        }
    }
    a
}

/// The model: a preset of `llama_sft` (or `bench`), the overrides, the
/// task's vocabulary and room for `seq` tokens.
fn model_config(a: &Args, seq: usize) -> Config {
    let mut c = match a.model.as_str() {
        "tiny" => Config::tiny(),
        "task" => Config {
            dim: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            hidden: 344,
            ..Config::tiny()
        },
        "small" => Config::small(),
        "bench" => Config {
            n_layers: 6,
            ..Config::small()
        },
        other => panic!("--model: tiny, task, bench or small, not `{other}`"),
    };
    c.vocab = data::VOCAB;
    c.max_seq = seq;
    c.dim = a.dim.unwrap_or(c.dim);
    c.n_layers = a.layers.unwrap_or(c.n_layers);
    c.n_heads = a.heads.unwrap_or(c.n_heads);
    c.n_kv_heads = a.kv_heads.unwrap_or(c.n_kv_heads);
    c.hidden = a.hidden.unwrap_or(c.hidden);
    c.validate();
    c
}

fn dims(c: &Config) -> LlamaDims {
    LlamaDims {
        vocab: c.vocab,
        hidden: c.dim,
        intermediate: c.hidden,
        layers: c.n_layers,
        heads: c.n_heads,
        kv_heads: c.n_kv_heads,
    }
}

/// `engine_config` of `llama_sft.rs` without `--config`:
/// `ResolvedConfig::simple`, bf16, the example's optimizer settings, then
/// the setup's stage and offload devices (swap files under `nvme`), with
/// `overlap_comm` on and the bucket and prefetch sizes at `bucket`
/// elements (see the module docs).
fn engine_config(
    setup: Setup,
    micro: usize,
    steps: usize,
    bucket: usize,
    nvme: &Path,
) -> ResolvedConfig {
    let lr = 3e-3;
    let mut c = ResolvedConfig::simple(3, RANKS, micro);
    c.precision = Precision::Bf16;
    c.optimizer.lr = lr;
    c.optimizer.beta2 = 0.95;
    c.optimizer.weight_decay = 0.0;
    c.gradient_clipping = 1.0;
    c.scheduler = LrSchedule::WarmupCosineLr {
        base_lr: lr,
        total_steps: steps as u64,
        warmup_min_ratio: 0.0,
        warmup_steps: (steps as u64 / 20).max(1),
        cos_min_ratio: 0.1,
        warmup_type: WarmupType::Linear,
    };
    let (stage, oo, op) = setup.parts();
    c.zero.stage = stage;
    c.zero.overlap_comm = true;
    c.zero.reduce_bucket_size = bucket;
    c.zero.allgather_bucket_size = bucket;
    c.zero.prefetch_bucket_size = bucket;
    c.zero.max_reuse_distance = bucket;
    c.zero.offload_optimizer.device = oo;
    c.zero.offload_param.device = op;
    if oo == OffloadDevice::Nvme {
        c.zero.offload_optimizer.nvme_path = Some(nvme.to_path_buf());
    }
    if op == OffloadDevice::Nvme {
        c.zero.offload_param.nvme_path = Some(nvme.to_path_buf());
    }
    c
}

// ----------------------------------------------------------------------
// Baselines measured next to each setup

#[derive(Clone, Copy)]
enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// Seconds per byte a rank sends (ring convention, as `EngineStats`
/// counts) in one bare collective of `n` elements of `T`: median of `reps`.
fn coll_rate<T: Element, C: Communicator>(comm: &C, n: usize, reps: usize, op: Coll) -> f64 {
    let world = comm.world_size();
    let counts = even_counts(n, world);
    let mut buf = Some(comm.alloc::<T>(n).expect("alloc"));
    let mut run = || {
        let b = buf.take().expect("buffer");
        let w = match op {
            Coll::AllReduce => comm.all_reduce(b, ReduceOp::Sum),
            Coll::ReduceScatter => comm.reduce_scatter_in_place(b, &counts, ReduceOp::Sum),
            Coll::AllGather => comm.all_gather_in_place(b, &counts),
        };
        buf = Some(w.wait().expect("collective"));
    };
    run();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            comm.barrier().wait().expect("barrier");
            let t0 = Instant::now();
            run();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    let ring = (world - 1) as f64 / world as f64;
    let factor = match op {
        Coll::AllReduce => 2.0 * ring,
        _ => ring,
    };
    t[t.len() / 2] / (factor * (n * T::DTYPE.size_in_bytes()) as f64)
}

fn coll_rate_dt<C: Communicator>(comm: &C, dt: DType, n: usize, reps: usize, op: Coll) -> f64 {
    match dt {
        DType::F32 => coll_rate::<f32, C>(comm, n, reps, op),
        DType::BF16 => coll_rate::<bf16, C>(comm, n, reps, op),
        DType::F16 => coll_rate::<f16, C>(comm, n, reps, op),
    }
}

/// User + system CPU time of this process (every rank's thread).
fn cpu_time() -> Duration {
    // SAFETY: `getrusage` only writes the `rusage` it is given, which is a
    // valid, writable, zero-initialised struct owned by this frame.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut u) != 0 {
            return Duration::ZERO;
        }
        u
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, 1000 * t.tv_usec as u32);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

// ----------------------------------------------------------------------
// One setup

/// What one rank measured.
struct RankRun {
    /// Per timed step: this rank's wall time.
    step: Vec<f64>,
    /// Per timed step: training FLOPs of this rank (3 × forward).
    flops: Vec<f64>,
    /// This rank's fp32 GEMM peak (FLOP/s).
    peak: f64,
    /// Seconds per byte sent: the reduction this setup issues (all-reduce
    /// at stage 0, else reduce-scatter, in the communication dtype), and
    /// all-gather in bf16.
    reduce_rate: f64,
    gather_rate: f64,
    reduce_bytes: u64,
    gather_bytes: u64,
    /// Peak bytes per tier (device, host, nvme) over the whole run.
    peaks: [u64; 3],
    /// Device model states (params, grads, master, moments) once built.
    states: u64,
    /// Rank 0: process CPU time and wall time of the timed steps.
    cpu: Option<(Duration, Duration)>,
    numel: usize,
}

fn run_rank(
    comm: ThreadComm,
    a: &Args,
    cfg: &ResolvedConfig,
    model_cfg: Config,
    seq: usize,
    tracer: &Tracer,
) -> zero::Result<RankRun> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / comm.ranks_on_host().max(1)).max(1);
    let micro = cfg.micro_batch_size;

    // Baselines, every rank at once, right before the setup runs.
    let peak = llama::train::measure_gemm_peak(threads);
    let psi = llama::param_count(&model_cfg);
    let reduce_rate = if cfg.zero.stage == 0 {
        coll_rate_dt(
            &comm,
            cfg.communication_data_type,
            psi,
            a.reps,
            Coll::AllReduce,
        )
    } else {
        coll_rate_dt(
            &comm,
            cfg.communication_data_type,
            psi,
            a.reps,
            Coll::ReduceScatter,
        )
    };
    let gather_rate = coll_rate::<bf16, _>(&comm, psi, a.reps, Coll::AllGather);

    let train = data::addition_task(SEED).train;
    let order = data::epoch_order(train.len(), 0, SEED);
    let mut b = Engine::builder(cfg.clone(), comm)
        .seed(SEED)
        .tracer(tracer.clone());
    let model = SftModel::register_lora(&mut b, model_cfg, None, lora_setup(a), threads, false)?;
    let mut e = b.build()?;
    let numel = e.plan().numel();
    let states = e.tracker().model_states(Tier::Device);

    let mut step = Vec::with_capacity(a.steps);
    let mut flops = Vec::with_capacity(a.steps);
    let mut start = None;
    for s in 0..a.warmup + a.steps {
        if s == a.warmup {
            // Forget the warm-up: counters, spans (every rank is past its
            // warm-up between the barriers).
            e.comm().barrier().wait()?;
            if rank == 0 {
                tracer.clear();
                start = Some((cpu_time(), Instant::now()));
            }
            e.reset_stats();
            e.comm().barrier().wait()?;
        }
        let first = (s * world + rank) * micro;
        let samples: Vec<&data::Sample> = (first..first + micro)
            .map(|i| &train[order[i % order.len()]])
            .collect();
        let (tokens, targets) =
            data::make_batch(&samples, seq).map_err(|what| zero::Error::Usage { rank, what })?;
        let t = Instant::now();
        let st =
            model.train_micro_batch::<bf16, _>(&mut e, &tokens, &targets, micro, seq, tracer)?;
        e.step()?;
        if s >= a.warmup {
            step.push(t.elapsed().as_secs_f64());
            flops.push(3.0 * forward_flops(&model_cfg, micro, seq, st.target_tokens));
        }
    }
    e.comm().barrier().wait()?;
    let cpu = start.map(|(c, t)| (cpu_time() - c, t.elapsed()));
    let stats = e.stats().clone();
    let tr = e.tracker();
    Ok(RankRun {
        step,
        flops,
        peak,
        reduce_rate,
        gather_rate,
        reduce_bytes: stats.reduce_bytes,
        gather_bytes: stats.gather_bytes,
        peaks: Tier::ALL.map(|t| tr.tier_peak(t)),
        states,
        cpu,
        numel,
    })
}

/// One setup's row.
struct Row {
    setup: Setup,
    /// The run trained LoRA adapters (`--lora`).
    lora: bool,
    label: String,
    /// Median over steps of the slowest rank's step time (s).
    step: f64,
    tokens_per_s: f64,
    flops_per_s: f64,
    /// The fp32 GEMM peak of all ranks, measured right before the setup.
    peak: f64,
    /// Achieved / the best peak measured in the run (set by `main`).
    mfu: f64,
    /// Bytes sent per rank per step (mean over ranks).
    bytes_per_step: f64,
    /// Peak bytes per rank (largest rank) and the estimate, per tier.
    peaks: [u64; 3],
    estimated: [u64; 3],
    /// Device model states once built (largest rank) and the estimate.
    states: u64,
    states_estimated: u64,
    cpu_util: f64,
    /// Mean over ranks: time per step the collectives ran (s).
    coll: f64,
    /// Mean over ranks: time per step the trainer waited for them (s).
    wait: f64,
    /// Mean over ranks: the time per step of the same bytes in bare
    /// collectives (s).
    bare: f64,
    /// Mean over ranks: the share of the collectives' time hidden behind
    /// compute (`None` without collectives).
    hidden: Option<f64>,
    wall: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The LoRA of `--lora R`: rank R, alpha 2R, no dropout, all seven
/// projections (the experiment's targets).
fn lora_setup(a: &Args) -> Option<LoraSetup> {
    a.lora.map(|r| LoraSetup {
        cfg: LoraConfig::new(r, 2.0 * r as f32, 0.0, &LORA_TARGETS).expect("valid LoRA"),
        seed: SEED,
        adapters: None,
    })
}

/// The estimator's model: the Llama, with `--lora`'s adapters and the base
/// frozen.
fn estimate_model(a: &Args, c: &Config) -> Model {
    match a.lora {
        None => Model::llama(dims(c)),
        Some(rank) => Model::llama_lora(
            dims(c),
            &Lora {
                rank,
                targets: LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
            },
        ),
    }
    .expect("valid dims")
}

fn run_setup(a: &Args, setup: Setup, model_cfg: Config, seq: usize, nvme: &Path) -> Row {
    let t0 = Instant::now();
    let bucket = llama::param_count(&model_cfg) / (model_cfg.n_layers + 1);
    let cfg = engine_config(setup, a.batch, a.warmup + a.steps, bucket, nvme);
    let est = estimate(
        &estimate_model(a, &model_cfg),
        &cfg,
        &Workload {
            seq_len: seq,
            activation_checkpointing: false,
        },
    )
    .expect("estimate");
    let tracer = Tracer::new();
    let runs: Vec<RankRun> = ThreadGroup::run(RANKS, |comm| {
        run_rank(comm, a, &cfg, model_cfg, seq, &tracer)
    })
    .expect("thread group")
    .into_iter()
    .enumerate()
    .map(|(r, x)| x.unwrap_or_else(|e| panic!("{} rank {r}: {e}", setup.label())))
    .collect();
    let steps = a.steps as f64;
    let step = median(
        (0..a.steps)
            .map(|s| runs.iter().map(|r| r.step[s]).fold(0.0, f64::max))
            .collect(),
    );
    let flops_step: f64 = runs
        .iter()
        .map(|r| r.flops.iter().sum::<f64>())
        .sum::<f64>()
        / steps;
    let peak: f64 = runs.iter().map(|r| r.peak).sum();
    let (cpu, wall) = runs[0].cpu.expect("rank 0 timed the steps");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let events = tracer.events();
    let trace_file = out_dir().join(format!(
        "stages-trace-{}.json",
        setup.label().replace(['+', ' '], "_")
    ));
    if let Err(e) =
        std::fs::create_dir_all(out_dir()).and_then(|()| write_chrome_trace(&trace_file, &events))
    {
        eprintln!("error: writing {}: {e}", trace_file.display());
    }
    let n = runs.len() as f64;
    let (mut coll, mut wait, mut bare_sum, mut hidden) = (0.0, 0.0, 0.0, Some(0.0));
    for (rank, r) in runs.iter().enumerate() {
        let o = overlap(&events, rank);
        coll += o.collective_us * 1e-6 / steps / n;
        wait += o.wait_us * 1e-6 / steps / n;
        hidden = hidden.zip(o.fraction()).map(|(h, f)| h + f / n);
        bare_sum += (r.reduce_bytes as f64 * r.reduce_rate + r.gather_bytes as f64 * r.gather_rate)
            / steps
            / n;
    }
    let bytes = runs
        .iter()
        .map(|r| (r.reduce_bytes + r.gather_bytes) as f64)
        .sum::<f64>()
        / n
        / steps;
    let mut peaks = [0u64; 3];
    for r in &runs {
        for (p, &x) in peaks.iter_mut().zip(&r.peaks) {
            *p = (*p).max(x);
        }
    }
    assert_eq!(
        runs[0].numel as u64,
        estimate_model(a, &model_cfg).numel() as u64
    );
    Row {
        setup,
        lora: a.lora.is_some(),
        label: setup.label(),
        step,
        tokens_per_s: (a.batch * RANKS * seq) as f64 / step,
        flops_per_s: flops_step / step,
        peak,
        mfu: 0.0,
        bytes_per_step: bytes,
        peaks,
        estimated: Tier::ALL.map(|t| est.tier_peak(t)),
        states: runs.iter().map(|r| r.states).max().unwrap_or(0),
        states_estimated: est.model_states(Tier::Device),
        cpu_util: cpu.as_secs_f64() / (wall.as_secs_f64() * cores as f64),
        coll,
        wait,
        bare: bare_sum,
        hidden,
        wall: t0.elapsed().as_secs_f64(),
    }
}

// ----------------------------------------------------------------------
// Report

/// The overlap target of issue 8: the share of communication hidden
/// behind compute at stages 2 and 3.
fn overlap_target(setup: Setup) -> Option<f64> {
    match setup {
        Setup::Stage2 | Setup::Stage3 => Some(0.8),
        _ => None,
    }
}

/// The step-time target as a ratio to stage 0: issue 8's; with LoRA,
/// issue 20's for stage 3 with optimizer and parameter offload (≤ 1.3×:
/// the frozen base stays resident, only the adapters move).
fn target(r: &Row) -> Option<f64> {
    match r.setup {
        Setup::Stage1 | Setup::Stage2 => Some(1.05),
        Setup::Stage3 => Some(1.15),
        Setup::Stage3OffloadAll if r.lora => Some(1.3),
        Setup::Stage3OffloadAll => Some(1.5),
        _ => None,
    }
}

fn pct(x: f64) -> String {
    format!("{:.0}%", 100.0 * x)
}

fn print_tables(rows: &[Row], base: Option<f64>) -> Vec<String> {
    let mut misses = Vec::new();
    println!(
        "\n{:<16} | {:>7} {:>6} {:>11} | {:>8} {:>8} {:>5} | {:>9} | {:>4} | {:>8} {:>8} {:>11} {:>8}",
        "setup",
        "step s",
        "×st0",
        "target",
        "tok/s",
        "GFLOP/s",
        "MFU",
        "MB/step",
        "CPU",
        "coll ms",
        "wait ms",
        "hidden",
        "bare ms"
    );
    for r in rows {
        let ratio = base.map(|b| r.step / b);
        let verdict = match (ratio, target(r)) {
            (Some(x), Some(t)) => {
                let ok = x <= t;
                if !ok {
                    misses.push(format!("{} step {x:.2}× stage 0 > {t}", r.label));
                }
                format!("≤{t:.2} {}", if ok { "ok" } else { "MISS" })
            }
            _ => String::new(),
        };
        let hidden = match (r.hidden, overlap_target(r.setup)) {
            (Some(h), Some(t)) => {
                let ok = h >= t;
                if !ok {
                    misses.push(format!(
                        "{} hides {} of its communication < {}",
                        r.label,
                        pct(h),
                        pct(t)
                    ));
                }
                format!("{} {}", pct(h), if ok { "ok" } else { "MISS" })
            }
            (Some(h), None) => pct(h),
            (None, _) => "-".into(),
        };
        println!(
            "{:<16} | {:>7.3} {:>6} {:>11} | {:>8.0} {:>8.1} {:>5} | {:>9.1} | {:>4} | {:>8.1} {:>8.1} {:>11} {:>8.1}",
            r.label,
            r.step,
            ratio.map_or("-".into(), |x| format!("{x:.2}")),
            verdict,
            r.tokens_per_s,
            r.flops_per_s / 1e9,
            pct(r.mfu),
            r.bytes_per_step / 1e6,
            pct(r.cpu_util),
            1e3 * r.coll,
            1e3 * r.wait,
            hidden,
            1e3 * r.bare,
        );
    }
    println!(
        "  step: median of the slowest rank's step; ×st0: / stage 0 of this run. MFU: achieved \
         (3 × forward FLOPs) / the best fp32 GEMM peak of all ranks measured in this run. \
         MB/step: bytes each rank sends per step (1e6 B, ring convention). CPU: process CPU time \
         / (wall × cores).\n  coll ms: time per step the rank's collectives ran on its \
         progress thread. wait ms: time per step the trainer was blocked waiting for them. \
         hidden: share of coll during which the trainer computed (forward/backward/optimizer, \
         not waiting): target ≥ 80% at stages 2 and 3. bare ms: the same bytes in bare \
         collectives on an idle machine, for scale."
    );

    println!(
        "\npeak memory per rank (MiB; largest rank; tracker measured / zero::estimate predicted)"
    );
    println!(
        "{:<16} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>10} {:>9}",
        "setup",
        "device",
        "estimate",
        "diff",
        "host",
        "estimate",
        "diff",
        "nvme",
        "estimate",
        "diff",
        "dev states",
        "estimate"
    );
    for r in rows {
        let mut line = format!("{:<16}", r.label);
        for t in 0..3 {
            let (m, e) = (r.peaks[t] as f64, r.estimated[t] as f64);
            let diff = if m > 0.0 {
                format!("{:+.1}%", 100.0 * (e / m - 1.0))
            } else if e > 0.0 {
                "inf".into()
            } else {
                "-".into()
            };
            let _ = write!(line, " | {:>9.1} {:>9.1} {:>6}", m / MIB, e / MIB, diff);
        }
        let _ = write!(
            line,
            " | {:>10.1} {:>9.1}",
            r.states as f64 / MIB,
            r.states_estimated as f64 / MIB
        );
        println!("{line}");
    }

    // Device memory order 0 > 1 > 2 > 3 > 3+opt cpu > 3+opt+param cpu.
    let chain = [
        Setup::Stage0,
        Setup::Stage1,
        Setup::Stage2,
        Setup::Stage3,
        Setup::Stage3OffloadOptimizer,
        Setup::Stage3OffloadAll,
    ];
    let find = |s: Setup| rows.iter().find(|r| r.setup == s);
    for (what, pick) in [
        ("peak, measured", (|r: &Row| r.peaks[0]) as fn(&Row) -> u64),
        ("peak, estimated", |r: &Row| r.estimated[0]),
        ("model states, measured", |r: &Row| r.states),
        ("model states, estimated", |r: &Row| r.states_estimated),
    ] {
        let present: Vec<&Row> = chain.iter().filter_map(|&s| find(s)).collect();
        let mut text = present.first().map_or(String::new(), |r| r.label.clone());
        let mut ok = true;
        for w in present.windows(2) {
            let holds = pick(w[0]) > pick(w[1]);
            ok &= holds;
            let _ = write!(text, " {} {}", if holds { ">" } else { "≯" }, w[1].label);
        }
        if !ok {
            misses.push(format!("device memory order ({what})"));
        }
        println!(
            "device memory order ({what}): {text}: {}",
            if present.len() < 2 {
                "n/a"
            } else if ok {
                "ok"
            } else {
                "MISS"
            }
        );
    }
    println!(
        "  model states: params, grads, fp32 master and moments once built (ZeRO's figure). \
         The peak adds gradient buckets (reduce_bucket_size elements of the communication dtype, \
         capped at the model, two when overlap_comm is on, as here), gathered \
         stage-3 units and activations."
    );
    misses
}

fn out_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("zero-bench")
}

fn write_files(dir: &Path, rows: &[Row], meta: serde_json::Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let base = rows
        .iter()
        .find(|r| r.setup == Setup::Stage0)
        .map(|r| r.step);
    let json_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            json!({
                "setup": r.label,
                "step_s": r.step,
                "ratio_to_stage0": base.map(|b| r.step / b),
                "target_ratio": target(r),
                "tokens_per_s": r.tokens_per_s,
                "flops_per_s": r.flops_per_s,
                "mfu": r.mfu,
                "gemm_peak_flops_before_setup": r.peak,
                "bytes_per_rank_per_step": r.bytes_per_step,
                "peak_device_bytes": r.peaks[0],
                "peak_host_bytes": r.peaks[1],
                "peak_nvme_bytes": r.peaks[2],
                "estimated_device_bytes": r.estimated[0],
                "estimated_host_bytes": r.estimated[1],
                "estimated_nvme_bytes": r.estimated[2],
                "device_model_states_bytes": r.states,
                "estimated_device_model_states_bytes": r.states_estimated,
                "cpu_utilization": r.cpu_util,
                "comm_collective_s_per_step": r.coll,
                "comm_wait_s_per_step": r.wait,
                "comm_hidden_fraction": r.hidden,
                "comm_bare_s_per_step": r.bare,
                "wall_s": r.wall,
            })
        })
        .collect();
    let doc = json!({ "meta": meta, "rows": json_rows });
    std::fs::write(
        dir.join("stages.json"),
        serde_json::to_string_pretty(&doc).map_err(std::io::Error::other)? + "\n",
    )?;
    let mut csv = String::from(
        "setup,step_s,ratio_to_stage0,tokens_per_s,flops_per_s,mfu,bytes_per_rank_per_step,\
         peak_device_bytes,peak_host_bytes,peak_nvme_bytes,estimated_device_bytes,\
         estimated_host_bytes,estimated_nvme_bytes,cpu_utilization,comm_collective_s_per_step,\
         comm_wait_s_per_step,comm_hidden_fraction,comm_bare_s_per_step\n",
    );
    for r in rows {
        let _ = writeln!(
            csv,
            "{},{:.6},{},{:.1},{:.4e},{:.4},{:.0},{},{},{},{},{},{},{:.4},{:.6},{:.6},{},{:.6}",
            r.label,
            r.step,
            base.map_or(String::new(), |b| format!("{:.4}", r.step / b)),
            r.tokens_per_s,
            r.flops_per_s,
            r.mfu,
            r.bytes_per_step,
            r.peaks[0],
            r.peaks[1],
            r.peaks[2],
            r.estimated[0],
            r.estimated[1],
            r.estimated[2],
            r.cpu_util,
            r.coll,
            r.wait,
            r.hidden.map_or(String::new(), |h| format!("{h:.4}")),
            r.bare,
        );
    }
    std::fs::write(dir.join("stages.csv"), csv)
}

/// Peak device and host memory per rank against median step time, one
/// labelled point per setup.
fn draw_chart(path: &Path, rows: &[Row], title: &str) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;

    let xmax = rows.iter().map(|r| r.step).fold(0.0, f64::max) * 1.2;
    let ymax = rows
        .iter()
        .map(|r| (r.peaks[0].max(r.peaks[1])) as f64 / MIB)
        .fold(0.0, f64::max)
        * 1.15;
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax.max(1e-3), 0f64..ymax.max(1.0))?;
    chart
        .configure_mesh()
        .x_desc("median step time (s)")
        .y_desc("peak memory per rank (MiB)")
        .draw()?;
    let font = ("sans-serif", 13);
    for (tier, name, color) in [(0usize, "device", BLUE), (1, "host", RED)] {
        // Host memory only where a setup uses it (stages 0-3 hold none).
        let pts: Vec<(f64, f64, String)> = rows
            .iter()
            .filter(|r| r.peaks[tier] > 0)
            .map(|r| (r.step, r.peaks[tier] as f64 / MIB, r.label.clone()))
            .collect();
        chart
            .draw_series(pts.iter().map(|(x, y, label)| {
                EmptyElement::at((*x, *y))
                    + Circle::new((0, 0), 5, color.filled())
                    + Text::new(label.clone(), (7, -12), font)
            }))?
            .label(format!("{name} memory per rank"))
            .legend(move |(x, y)| Circle::new((x + 10, y), 5, color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() {
    let a = parse_args();
    let train = data::addition_task(SEED).train;
    let seq = data::max_len(&train);
    let model_cfg = model_config(&a, seq);
    let psi = llama::param_count(&model_cfg);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "stages: llama_sft model `{}` (dim {}, {} layers, {} heads, {} kv heads, hidden {}, vocab \
         {}): Ψ = {psi} parameters; seq {seq}, {} samples per rank per step, {RANKS} ranks on the \
         threads backend, {cores} cores, bf16; {} warm-up + {} timed steps per setup",
        a.model,
        model_cfg.dim,
        model_cfg.n_layers,
        model_cfg.n_heads,
        model_cfg.n_kv_heads,
        model_cfg.hidden,
        model_cfg.vocab,
        a.batch,
        a.warmup,
        a.steps
    );
    println!(
        "  note: a shared 2-core machine (CI builds may run beside this): timings drift 10–25% \
         between runs; compare the ratios within one run."
    );
    let nvme = std::env::temp_dir().join(format!("zero-bench-stages-{}", std::process::id()));
    std::fs::create_dir_all(&nvme).expect("create the nvme directory");
    let t0 = Instant::now();
    let mut rows = Vec::new();
    for &setup in &a.setups {
        let r = run_setup(&a, setup, model_cfg, seq, &nvme);
        eprintln!(
            "  ran {:<16} in {:>5.1} s: step {:.3} s",
            r.label, r.wall, r.step
        );
        rows.push(r);
    }
    let _ = std::fs::remove_dir_all(&nvme);
    // The machine's peak: the best of the per-setup measurements (a
    // measurement taken while something else ran is low).
    let best_peak = rows.iter().map(|r| r.peak).fold(0.0, f64::max);
    for r in &mut rows {
        r.mfu = r.flops_per_s / best_peak;
    }
    let lowest_peak = rows.iter().map(|r| r.peak).fold(f64::INFINITY, f64::min);
    println!(
        "\nfp32 GEMM peak, all ranks at once, measured before each setup: {:.1}–{:.1} GFLOP/s; \
         MFU uses the best",
        lowest_peak / 1e9,
        best_peak / 1e9
    );
    let base = rows
        .iter()
        .find(|r| r.setup == Setup::Stage0)
        .map(|r| r.step);
    let misses = print_tables(&rows, base);

    let dir = out_dir();
    let meta = json!({
        "model": a.model,
        "dim": model_cfg.dim,
        "layers": model_cfg.n_layers,
        "heads": model_cfg.n_heads,
        "kv_heads": model_cfg.n_kv_heads,
        "hidden": model_cfg.hidden,
        "vocab": model_cfg.vocab,
        "params": psi,
        "seq": seq,
        "micro_batch": a.batch,
        "ranks": RANKS,
        "cores": cores,
        "precision": "bf16",
        "warmup_steps": a.warmup,
        "timed_steps": a.steps,
        "misses": misses,
    });
    match write_files(&dir, &rows, meta) {
        Ok(()) => println!(
            "\nwrote {} and {}",
            dir.join("stages.json").display(),
            dir.join("stages.csv").display()
        ),
        Err(e) => eprintln!("error: writing {}: {e}", dir.display()),
    }
    let svg = dir.join("stages.svg");
    let title = format!(
        "ZeRO setups: peak memory per rank vs step time (Ψ = {:.1} M, {RANKS} ranks, bf16)",
        psi as f64 / 1e6
    );
    match draw_chart(&svg, &rows, &title) {
        Ok(()) => println!("chart: {}", svg.display()),
        Err(e) => eprintln!("error: drawing {}: {e}", svg.display()),
    }
    if misses.is_empty() {
        println!("all targets met");
    } else {
        println!("targets missed: {}", misses.join("; "));
    }
    println!("total {:.0} s", t0.elapsed().as_secs_f64());
}
