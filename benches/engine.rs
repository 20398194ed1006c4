//! Engine step breakdown per ZeRO stage, on a model of about 50M
//! parameters in 12 units of about 4.2M (transformer-block shapes, hidden
//! size 592 by default), on the threads backend:
//!
//! - step time split into the reduce, optimizer and gather phases
//!   ([`EngineStats`] deltas per step; "other" is the rest of the step:
//!   the trainer's gradient fill and the engine's zeroing of gradient
//!   buffers, which no phase counts);
//! - bytes each rank sends per step (ring convention, as [`EngineStats`]
//!   counts them), as a multiple of data parallelism's 2Ψ·(N−1)/N elements
//!   in the communication dtype, next to the ZeRO paper's ratios
//!   (stages 1 and 2: 1.0, stage 3: 1.5);
//! - model-state bytes per rank from the memory tracker, against ZeRO's
//!   16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N.
//!
//! No model computes anything: per step the "trainer" gathers every unit in
//! order and releases it (forward), then in reverse order gathers it, fills
//! its gradient buffer with a per-unit constant, releases it and hands the
//! gradient back (backward), then calls `step`. This measures the engine.
//!
//! Each bf16 stage runs twice: as configured by default (gradients reduced
//! and accumulated in fp32), and with `communication_data_type` and
//! `grad_accum_dtype` bf16 — the paper's setting (16-bit gradients and
//! parameters), where its volume ratios and memory formulas apply as they
//! stand. Stage 3 also runs with `stage3_max_reuse_distance` 0: with the
//! default (1e9 elements, more than this model) a unit released in the
//! forward pass stays gathered for the backward pass, so nothing is
//! gathered twice.
//!
//! Baselines, measured in the same run on the same threads because this
//! machine is shared and noisy: memcpy of Ψ f32, the communicator's own
//! all-reduce / reduce-scatter / all-gather on a bare Ψ-element buffer (the
//! collectives a step issues, without the engine around them),
//! the engine's optimizer kernel alone ([`CpuAdamW`] with the engine's
//! default threads: cores ÷ ranks), and an
//! auto-vectorized f32 loop with AdamW's memory access pattern (what a SIMD
//! kernel could approach). They are measured once at the start for the
//! table, and again right after each row's steps (the "probe"), so that
//! every ratio in a row compares figures taken at the same time: the
//! machine's speed drifts by up to 2× within a run.
//!
//! `cargo bench --bench engine [-- options]`; options: `--ranks N`
//! (default 2), `--steps K` measured steps (default 3, after `--warmup W`
//! = 1), `--stages 0,1,2,3`, `--precisions bf16,fp32`, `--hidden D` (unit
//! size ≈ 12·D²), `--units U` (default 12), `--reps R` baseline
//! repetitions (default 5; at most 3 for the per-row probes).

use std::hint::black_box;
use std::time::{Duration, Instant};

use zero::comm::{even_counts, Communicator, ReduceOp, ThreadGroup};
use zero::core::config::{Precision, ResolvedConfig};
use zero::core::memory::{Category, Tier};
use zero::core::optim::{AdamWStep, CpuAdamW};
use zero::core::partition::{PartitionPlan, TensorSpec, UnitSpec};
use zero::core::{bf16, f16, DType, Element, HostBuffer};
use zero::{Engine, EngineBuilder, EngineStats, Init, UnitId};

const MB: f64 = 1e6;

struct Args {
    ranks: usize,
    steps: usize,
    warmup: usize,
    stages: Vec<u8>,
    precisions: Vec<Precision>,
    hidden: usize,
    units: usize,
    reps: usize,
}

fn list<T: std::str::FromStr>(s: Option<String>, what: &str) -> Vec<T> {
    s.unwrap_or_else(|| panic!("{what} needs a comma-separated list"))
        .split(',')
        .map(|x| {
            x.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{what}: cannot parse `{x}`"))
        })
        .collect()
}

fn parse_args() -> Args {
    let mut a = Args {
        ranks: 2,
        steps: 3,
        warmup: 1,
        stages: vec![0, 1, 2, 3],
        precisions: vec![Precision::Bf16, Precision::Fp32],
        hidden: 592,
        units: 12,
        reps: 5,
    };
    let mut it = std::env::args().skip(1);
    let num = |s: Option<String>, what: &str| -> usize {
        s.and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{what} needs a positive integer"))
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--ranks" => a.ranks = num(it.next(), "--ranks"),
            "--steps" => a.steps = num(it.next(), "--steps"),
            "--warmup" => a.warmup = num(it.next(), "--warmup"),
            "--hidden" => a.hidden = num(it.next(), "--hidden"),
            "--units" => a.units = num(it.next(), "--units"),
            "--reps" => a.reps = num(it.next(), "--reps"),
            "--stages" => a.stages = list(it.next(), "--stages"),
            "--precisions" => {
                a.precisions = list::<String>(it.next(), "--precisions")
                    .iter()
                    .map(|p| match p.as_str() {
                        "bf16" => Precision::Bf16,
                        "fp32" | "f32" => Precision::Fp32,
                        _ => panic!("--precisions: bf16 or fp32, not `{p}`"),
                    })
                    .collect()
            }
            _ => {} // cargo passes --bench; ignore what we do not know
        }
    }
    assert!(
        a.ranks >= 1 && a.steps >= 1,
        "--ranks and --steps must be >= 1"
    );
    assert!(
        a.stages.iter().all(|&s| s <= 3),
        "--stages: ZeRO stages are 0..=3"
    );
    a
}

// ----------------------------------------------------------------------
// The model

/// One transformer block of hidden size `d` (≈ 12·d² parameters).
fn block(name: String, d: usize) -> (UnitSpec, Vec<Init>) {
    let w = Init::Constant(0.02);
    let tensors = vec![
        (TensorSpec::new("ln1.weight", &[d]), Init::Ones),
        (TensorSpec::new("ln1.bias", &[d]), Init::Zeros),
        (TensorSpec::new("attn.qkv.weight", &[3 * d, d]), w.clone()),
        (TensorSpec::new("attn.qkv.bias", &[3 * d]), Init::Zeros),
        (TensorSpec::new("attn.proj.weight", &[d, d]), w.clone()),
        (TensorSpec::new("attn.proj.bias", &[d]), Init::Zeros),
        (TensorSpec::new("ln2.weight", &[d]), Init::Ones),
        (TensorSpec::new("ln2.bias", &[d]), Init::Zeros),
        (TensorSpec::new("mlp.fc1.weight", &[4 * d, d]), w.clone()),
        (TensorSpec::new("mlp.fc1.bias", &[4 * d]), Init::Zeros),
        (TensorSpec::new("mlp.fc2.weight", &[d, 4 * d]), w),
        (TensorSpec::new("mlp.fc2.bias", &[d]), Init::Zeros),
    ];
    let (specs, inits) = tensors.into_iter().unzip();
    (UnitSpec::new(name, specs), inits)
}

fn model(a: &Args) -> Vec<(UnitSpec, Vec<Init>)> {
    (0..a.units)
        .map(|u| block(format!("block{u}"), a.hidden))
        .collect()
}

// ----------------------------------------------------------------------
// Configurations

#[derive(Clone, Copy)]
struct Variant {
    stage: u8,
    precision: Precision,
    /// `communication_data_type`.
    cdt: DType,
    /// `grad_accum_dtype`.
    adt: DType,
    /// `stage3_max_reuse_distance` = 0 (stage 3 only).
    no_reuse: bool,
}

impl Variant {
    fn pdt(&self) -> DType {
        match self.precision {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }

    fn label(&self) -> String {
        format!(
            "{} p={} c={} a={}{}",
            self.stage,
            self.pdt(),
            self.cdt,
            self.adt,
            if self.no_reuse { " reuse=0" } else { "" }
        )
    }

    fn config(&self, world: usize) -> ResolvedConfig {
        let mut c = ResolvedConfig::simple(self.stage, world, 1);
        c.precision = self.precision;
        c.communication_data_type = self.cdt;
        c.grad_accum_dtype = self.adt;
        // The default (1e5) is already far below a unit (4.2M): no unit
        // is persistent. Spelled out so the benchmark says what it measures.
        c.zero.param_persistence_threshold = 100_000;
        if self.no_reuse {
            c.zero.max_reuse_distance = 0;
        }
        c
    }
}

fn variants(a: &Args) -> Vec<Variant> {
    let mut out = Vec::new();
    for &precision in &a.precisions {
        let pdt = match precision {
            Precision::Bf16 => DType::BF16,
            _ => DType::F32,
        };
        // As configured by default (fp32 reduction and accumulation), then
        // the paper's setting (all 16-bit) for bf16.
        let mut dtypes = vec![(DType::F32, DType::F32)];
        if pdt == DType::BF16 {
            dtypes.push((DType::BF16, DType::BF16));
        }
        for (cdt, adt) in dtypes {
            for &stage in &a.stages {
                let v = Variant {
                    stage,
                    precision,
                    cdt,
                    adt,
                    no_reuse: false,
                };
                out.push(v);
                if stage == 3 {
                    out.push(Variant {
                        no_reuse: true,
                        ..v
                    });
                }
            }
        }
    }
    out
}

// ----------------------------------------------------------------------
// Timing helpers

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `reps` calls of `f`, each started together on every rank after one
/// warm-up call; the median time of one call.
fn time_it<C: Communicator>(comm: &C, reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    let t: Vec<Duration> = (0..reps)
        .map(|_| {
            comm.barrier().wait().expect("barrier");
            let t0 = Instant::now();
            f();
            t0.elapsed()
        })
        .collect();
    comm.barrier().wait().expect("barrier");
    median(t)
}

// ----------------------------------------------------------------------
// Baselines

#[derive(Clone, Copy)]
enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
}

/// One collective on a Ψ-element buffer of `T`, in place: the median time.
fn time_coll<T: Element, C: Communicator>(comm: &C, psi: usize, reps: usize, op: Coll) -> Duration {
    let counts = even_counts(psi, comm.world_size());
    let mut buf = Some(comm.alloc::<T>(psi).expect("alloc"));
    time_it(comm, reps, || {
        let b = buf.take().expect("buffer");
        let w = match op {
            Coll::AllReduce => comm.all_reduce(b, ReduceOp::Sum),
            Coll::ReduceScatter => comm.reduce_scatter_in_place(b, &counts, ReduceOp::Sum),
            Coll::AllGather => comm.all_gather_in_place(b, &counts),
        };
        buf = Some(w.wait().expect("collective"));
    })
}

fn time_coll_dt<C: Communicator>(
    comm: &C,
    dt: DType,
    psi: usize,
    reps: usize,
    op: Coll,
) -> Duration {
    match dt {
        DType::F32 => time_coll::<f32, C>(comm, psi, reps, op),
        DType::BF16 => time_coll::<bf16, C>(comm, psi, reps, op),
        DType::F16 => time_coll::<f16, C>(comm, psi, reps, op),
    }
}

/// AdamW's memory traffic (read p, g, m, v; write p, m, v) in a loop the
/// compiler vectorizes: what a SIMD optimizer could approach.
fn adamw_pattern(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let (b1, b2, lr, eps, wd) = (0.9f32, 0.999f32, 1e-3f32, 1e-8f32, 0.01f32);
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let m1 = b1 * *m + (1.0 - b1) * g;
        let v1 = b2 * *v + (1.0 - b2) * g * g;
        *p -= lr * (m1 / (v1.sqrt() + eps) + wd * *p);
        *m = m1;
        *v = v1;
    }
}

/// Seconds per element of [`CpuAdamW::step`] with `G` gradients and a `P`
/// copy (the engine's kernel and threads, on values like the benchmark's) and of [`adamw_pattern`], over
/// `n` elements on every rank at once.
fn time_kernels<G: Element, P: Element, C: Communicator>(
    comm: &C,
    n: usize,
    reps: usize,
) -> (f64, f64) {
    let mut master = HostBuffer::<f32>::from_fn(n, |_| 0.02).expect("alloc");
    let g =
        HostBuffer::<G>::from_fn(n, |i| G::from_f32(1e-3 * (1 + i % 12) as f32)).expect("alloc");
    let mut m = HostBuffer::<f32>::zeros(n).expect("alloc");
    let mut v = HostBuffer::<f32>::zeros(n).expect("alloc");
    let mut low = HostBuffer::<P>::zeros(n).expect("alloc");
    let k = AdamWStep::new(&ResolvedConfig::simple(0, 1, 1).optimizer, 1e-3, 1, 0.01);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let adam = CpuAdamW::new().with_threads((cores / comm.ranks_on_host()).max(1));
    let reference = time_it(comm, reps, || {
        adam.step(&k, &mut master, &g, &mut m, &mut v, Some(&mut low[..]))
            .expect("adamw");
        black_box(&mut low);
    });
    let g32 = HostBuffer::<f32>::from_fn(n, |i| g[i].to_f32()).expect("alloc");
    let vectorized = time_it(comm, reps, || {
        adamw_pattern(&mut master, &g32, &mut m, &mut v);
        black_box(&mut master);
    });
    let per = |t: Duration| t.as_secs_f64() / n as f64;
    (per(reference), per(vectorized))
}

/// Measured once at the start, on Ψ elements (Ψ/N for the kernels);
/// rank 0's view.
#[derive(Debug, Clone, Copy, Default)]
struct Baselines {
    memcpy_f32: Duration,
    /// Indexed by [`di`]: f32, bf16.
    all_reduce: [Duration; 2],
    reduce_scatter: [Duration; 2],
    all_gather: [Duration; 2],
    /// Seconds per element: the engine's `CpuAdamW` (f32 grads, bf16 copy),
    /// and the vectorized AdamW-pattern loop.
    adamw_ref: f64,
    adamw_vec: f64,
}

/// Index of a dtype in the baseline arrays: f32, bf16.
fn di(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        _ => 1,
    }
}

fn baselines(a: &Args, psi: usize) -> Baselines {
    ThreadGroup::run(a.ranks, |comm| {
        let mut b = Baselines::default();
        {
            let src = HostBuffer::<f32>::from_fn(psi, |i| i as f32).expect("alloc");
            let mut dst = HostBuffer::<f32>::zeros(psi).expect("alloc");
            b.memcpy_f32 = time_it(&comm, a.reps, || {
                dst.copy_from_slice(&src);
                black_box(&mut dst);
            });
        }
        for dt in [DType::F32, DType::BF16] {
            let t = |op| time_coll_dt(&comm, dt, psi, a.reps, op);
            b.all_reduce[di(dt)] = t(Coll::AllReduce);
            b.reduce_scatter[di(dt)] = t(Coll::ReduceScatter);
            b.all_gather[di(dt)] = t(Coll::AllGather);
        }
        // The scalar kernel takes about a second here: fewer repetitions.
        (b.adamw_ref, b.adamw_vec) =
            time_kernels::<f32, bf16, _>(&comm, psi / a.ranks, a.reps.min(2));
        b
    })
    .expect("thread group")
    .swap_remove(0)
}

/// Re-measured right after each variant's steps, on the same threads, so
/// that each row is read against a baseline taken at the same time (the
/// machine's speed drifts within a run).
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// All-reduce of Ψ f32: data parallelism's gradient reduction alone.
    ar32: Duration,
    /// The reduction this variant issues, on Ψ in its communication dtype:
    /// all-reduce (stage 0) or reduce-scatter.
    reduce: Duration,
    /// All-gather of Ψ in the parameter dtype (stages 1–3).
    gather: Duration,
    /// Seconds per element of the engine's kernel (this variant's dtypes)
    /// and of the vectorized AdamW-pattern loop.
    adamw_ref: f64,
    adamw_vec: f64,
}

/// Elements of the per-variant kernel probe: enough to stream from memory.
const PROBE_ELEMS: usize = 1 << 22;

fn probe<T: Element, C: Communicator>(comm: &C, a: &Args, v: &Variant, psi: usize) -> Probe {
    // Fewer repetitions than the table's baselines: one probe per row.
    let reps = a.reps.min(3);
    let ar32 = time_coll::<f32, C>(comm, psi, reps, Coll::AllReduce);
    let reduce = match (v.stage, v.cdt) {
        (0, DType::F32) => ar32,
        (0, c) => time_coll_dt(comm, c, psi, reps, Coll::AllReduce),
        (_, c) => time_coll_dt(comm, c, psi, reps, Coll::ReduceScatter),
    };
    let gather = if v.stage == 0 {
        Duration::ZERO
    } else {
        time_coll::<T, C>(comm, psi, reps, Coll::AllGather)
    };
    // The engine's kernel reads the gradient in the accumulation dtype
    // (the parameter dtype when they alias, and then they are equal).
    let n = PROBE_ELEMS.min(psi / comm.world_size());
    let (adamw_ref, adamw_vec) = match v.adt {
        DType::F32 => time_kernels::<f32, T, C>(comm, n, reps),
        DType::BF16 => time_kernels::<bf16, T, C>(comm, n, reps),
        DType::F16 => time_kernels::<f16, T, C>(comm, n, reps),
    };
    Probe {
        ar32,
        reduce,
        gather,
        adamw_ref,
        adamw_vec,
    }
}

// ----------------------------------------------------------------------
// Driving the engine

/// What one rank measured for one variant.
struct RankRun {
    /// Per measured step: wall time of the whole step on this rank.
    step: Vec<Duration>,
    /// Per measured step: the engine's counters for that step alone.
    stats: Vec<EngineStats>,
    /// Model-state bytes right after `build`.
    states_built: u64,
    /// Peak model-state bytes during the steps, and what is left after.
    states_peak: u64,
    states_after: u64,
    /// Peak bytes of gradient buckets (and other comm buffers), and of
    /// gathered stage-3 units, during the steps.
    comm_peak: u64,
    gathered_peak: u64,
    /// Ψ: real and padded elements.
    numel: usize,
    padded: usize,
    probe: Probe,
}

fn register<C: Communicator>(b: &mut EngineBuilder<C>, a: &Args) -> Vec<UnitId> {
    model(a)
        .into_iter()
        .map(|(spec, init)| b.register(spec, init).expect("register"))
        .collect()
}

/// One training step of the no-compute trainer.
fn train_step<T: Element, C: Communicator>(
    e: &mut Engine<C>,
    units: &[UnitId],
    numels: &[usize],
) -> zero::Result<()> {
    for &u in units {
        let p = e.gather(u)?;
        black_box(p.params::<T>()?.first());
    }
    for (k, &u) in units.iter().enumerate().rev() {
        let p = e.gather(u)?;
        black_box(p.params::<T>()?.first());
        let mut g = e.grad_buffer::<T>(u)?;
        g[..numels[k]].fill(T::from_f32(1e-3 * (k + 1) as f32));
        drop(p);
        e.grad_ready(u, g)?;
    }
    e.step()?;
    Ok(())
}

fn drive<T: Element, C: Communicator>(comm: C, a: &Args, v: &Variant) -> RankRun {
    let cfg = v.config(comm.world_size());
    let mut b = Engine::builder(cfg, comm);
    let units = register(&mut b, a);
    let mut e = b.build().expect("build");
    let states_built = e.tracker().model_states(Tier::Device);
    e.tracker().reset_peaks();
    let numels: Vec<usize> = units
        .iter()
        .map(|&u| e.layout(u).expect("layout").numel)
        .collect();
    let mut step = Vec::new();
    let mut stats = Vec::new();
    for s in 0..a.warmup + a.steps {
        e.comm().barrier().wait().expect("barrier");
        e.reset_stats();
        let t0 = Instant::now();
        train_step::<T, C>(&mut e, &units, &numels).expect("train step");
        let dt = t0.elapsed();
        if s >= a.warmup {
            step.push(dt);
            stats.push(e.stats().clone());
        }
    }
    e.comm().barrier().wait().expect("barrier");
    let t = e.tracker();
    let states_peak = t.model_states_peak(Tier::Device);
    let states_after = t.model_states(Tier::Device);
    let comm_peak = t.peak(Tier::Device, Category::CommBuffers);
    let gathered_peak = t.peak(Tier::Device, Category::GatheredParams);
    let padded = e.plan().padded_numel();
    RankRun {
        step,
        stats,
        states_built,
        states_peak,
        states_after,
        comm_peak,
        gathered_peak,
        numel: e.plan().numel(),
        padded,
        probe: probe::<T, C>(e.comm(), a, v, padded),
    }
}

/// One variant's row: medians over the measured steps.
struct Row {
    v: Variant,
    /// Slowest rank per step, then the median over steps.
    step: Duration,
    reduce: Duration,
    optimizer: Duration,
    gather: Duration,
    reduce_bytes: u64,
    gather_bytes: u64,
    states_built: u64,
    states_peak: u64,
    states_after: u64,
    comm_peak: u64,
    gathered_peak: u64,
    prefetches: u64,
    prefetch_hits: u64,
    peak_live: usize,
    numel: usize,
    padded: usize,
    probe: Probe,
    wall: Duration,
}

fn run_variant(a: &Args, v: &Variant) -> Row {
    let t0 = Instant::now();
    let runs = ThreadGroup::run(a.ranks, |comm| match v.precision {
        Precision::Bf16 => drive::<bf16, _>(comm, a, v),
        Precision::Fp32 => drive::<f32, _>(comm, a, v),
        Precision::Fp16 => unreachable!("not benchmarked"),
    })
    .expect("thread group");
    let r0 = &runs[0];
    for r in &runs[1..] {
        for (x, y) in r0.stats.iter().zip(&r.stats) {
            assert_eq!(
                (x.reduce_bytes, x.gather_bytes),
                (y.reduce_bytes, y.gather_bytes),
                "ranks sent different volumes"
            );
        }
    }
    let step = median(
        (0..a.steps)
            .map(|s| runs.iter().map(|r| r.step[s]).max().expect("ranks"))
            .collect(),
    );
    let phase = |f: fn(&EngineStats) -> Duration| median(r0.stats.iter().map(f).collect());
    let last = r0.stats.last().expect("a measured step");
    Row {
        v: *v,
        step,
        reduce: phase(|s| s.reduce_time),
        optimizer: phase(|s| s.optimizer_time),
        gather: phase(|s| s.gather_time),
        reduce_bytes: last.reduce_bytes,
        gather_bytes: last.gather_bytes,
        states_built: r0.states_built,
        states_peak: r0.states_peak,
        states_after: r0.states_after,
        comm_peak: r0.comm_peak,
        gathered_peak: r0.gathered_peak,
        prefetches: last.prefetches,
        prefetch_hits: last.prefetch_hits,
        peak_live: last.peak_live_elems,
        numel: r0.numel,
        padded: r0.padded,
        probe: r0.probe,
        wall: t0.elapsed(),
    }
}

// ----------------------------------------------------------------------
// Expectations

/// Model-state bytes per rank the engine's memory plan implies (see the
/// table in `src/engine/mod.rs`); with P = A = bf16 these are ZeRO's
/// 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N.
fn expected_states(v: &Variant, psi: u64, n: u64) -> u64 {
    let (p, ac) = (v.pdt().size_in_bytes() as u64, v.adt.size_in_bytes() as u64);
    let alias = v.stage <= 1 && v.adt == v.pdt();
    let params = if v.stage == 3 { p * psi / n } else { p * psi };
    let grads = match v.stage {
        0 => p * psi + if alias { 0 } else { ac * psi },
        1 => p * psi + if alias { 0 } else { ac * psi / n },
        _ => ac * psi / n,
    };
    let opt = if v.stage == 0 { 12 * psi } else { 12 * psi / n };
    params + grads + opt
}

/// All-gathers of the parameters per step, in multiples of Ψ: one after
/// the step (stages 1–2). Stage 3 gathers each unit in the forward pass
/// and again in the backward pass unless `stage3_max_reuse_distance` lets
/// it keep the unit: unit u of U equal units is used again 2·(U−1−u) units
/// later. With the default (1e9 elements, more than this model) every unit
/// stays and stage 3 gathers once; with 0 only the last unit stays.
fn expected_gathers(v: &Variant, units: usize, unit: usize) -> f64 {
    match v.stage {
        0 => 0.0,
        1 | 2 => 1.0,
        _ => {
            let d = v.config(1).zero.max_reuse_distance;
            let again = (0..units)
                .filter(|&u| 2 * (units - 1 - u) * unit > d)
                .count();
            1.0 + again as f64 / units as f64
        }
    }
}

/// The volume ratio to data parallelism (in the same communication dtype):
/// a reduce-scatter in c plus `gathers` all-gathers in p, over an
/// all-reduce in c; the paper's ratio when c = p and stage 3 gathers twice.
fn expected_ratio(v: &Variant, gathers: f64) -> f64 {
    let (c, p) = (v.cdt.size_in_bytes() as f64, v.pdt().size_in_bytes() as f64);
    if v.stage == 0 {
        1.0
    } else {
        (c + gathers * p) / (2.0 * c)
    }
}

fn paper_ratio(stage: u8) -> f64 {
    if stage == 3 {
        1.5
    } else {
        1.0
    }
}

// ----------------------------------------------------------------------
// Report

fn print_baselines(b: &Baselines, psi: usize, n: usize) {
    let ring = (n - 1) as f64 / n as f64;
    let gbps = |bytes: f64, t: Duration| bytes / t.as_secs_f64() / 1e9;
    println!("\nbaselines on Ψ = {psi} elements, every rank at once (median of repetitions):");
    println!(
        "  {:<46} {:>8.1} ms  {:>6.2} GB/s per rank",
        "memcpy of Ψ f32",
        ms(b.memcpy_f32),
        gbps(4.0 * psi as f64, b.memcpy_f32)
    );
    for dt in [DType::F32, DType::BF16] {
        let bytes = (psi * dt.size_in_bytes()) as f64;
        for (op, t, f) in [
            ("all_reduce", b.all_reduce[di(dt)], 2.0 * ring),
            ("reduce_scatter_in_place", b.reduce_scatter[di(dt)], ring),
            ("all_gather_in_place", b.all_gather[di(dt)], ring),
        ] {
            println!(
                "  {:<46} {:>8.1} ms  {:>6.2} GB/s busbw",
                format!("{op} of Ψ {dt}"),
                ms(t),
                gbps(bytes, t) * f
            );
        }
    }
    let elems = (psi / n) as f64;
    for (what, per) in [
        ("AdamW-pattern f32 loop over Ψ/N (vectorized)", b.adamw_vec),
        (
            "engine's CpuAdamW over Ψ/N (f32 grad, bf16 out)",
            b.adamw_ref,
        ),
    ] {
        println!(
            "  {:<46} {:>8.1} ms  {:>6.3} G elem/s per rank",
            what,
            per * elems * 1e3,
            1e-9 / per
        );
    }
}

const LABEL: &str = "stage, dtypes (param/comm/accum)";

fn print_times(rows: &[Row], n: usize) {
    println!(
        "\nstep time (ms; slowest rank per step, median of steps) and its phases (rank 0, median); \
         probe = baselines re-measured right after the row's steps"
    );
    println!(
        "{LABEL:<32} | {:>7} {:>6} | {:>7} {:>7} {:>7} {:>6} | {:>7} {:>5} {:>5} | {:>10} {:>9}",
        "step",
        "×AR32",
        "reduce",
        "optim",
        "gather",
        "other",
        "Gelem/s",
        "×ref",
        "×vec",
        "probe AR32",
        "ref G/s"
    );
    for r in rows {
        let other = r.step.saturating_sub(r.reduce + r.optimizer + r.gather);
        let opt_elems = if r.v.stage == 0 { r.numel } else { r.numel / n } as f64;
        let opt = r.optimizer.as_secs_f64();
        println!(
            "{:<32} | {:>7.1} {:>6.1} | {:>7.1} {:>7.1} {:>7.1} {:>6.1} | {:>7.3} {:>5.2} {:>5.1} | {:>7.1} ms {:>9.3}",
            r.v.label(),
            ms(r.step),
            r.step.as_secs_f64() / r.probe.ar32.as_secs_f64(),
            ms(r.reduce),
            ms(r.optimizer),
            ms(r.gather),
            ms(other),
            opt_elems / opt / 1e9,
            opt / (opt_elems * r.probe.adamw_ref),
            opt / (opt_elems * r.probe.adamw_vec),
            ms(r.probe.ar32),
            1e-9 / r.probe.adamw_ref,
        );
    }
    println!(
        "  ×AR32: step / all_reduce of Ψ f32 (data parallelism's gradient reduction alone). other: \
         step − phases (the trainer's fill and the engine's zeroing of gradient buffers).\n  \
         Gelem/s: elements this rank updates / optimizer phase. ×ref, ×vec: optimizer phase / \
         the time the engine's CpuAdamW alone (this row's dtypes) or the vectorized AdamW-pattern loop takes \
         for as many elements."
    );
}

fn print_volumes(rows: &[Row], n: usize, units: usize) {
    let ring = (n - 1) as f64 / n as f64;
    println!("\nbytes sent per rank per step (MB = 1e6 B, ring convention) vs data parallelism");
    println!(
        "{LABEL:<32} | {:>7} {:>7} {:>7} | {:>6} {:>6} {:>5} {:>5} | {:>10}",
        "reduce", "gather", "total", "×DP", "expect", "k", "paper", "comm/floor"
    );
    for r in rows {
        let psi = r.padded as f64;
        let dp = 2.0 * psi * ring * r.v.cdt.size_in_bytes() as f64;
        let total = (r.reduce_bytes + r.gather_bytes) as f64;
        // The raw collectives that move the same data: the reduction of Ψ
        // in c, plus as many all-gathers of Ψ in p as the bytes amount to.
        let ag_bytes = psi * ring * r.v.pdt().size_in_bytes() as f64;
        let floor = r.probe.reduce.as_secs_f64()
            + r.gather_bytes as f64 / ag_bytes * r.probe.gather.as_secs_f64();
        let k = expected_gathers(&r.v, units, r.padded / units);
        let expect = expected_ratio(&r.v, k);
        let ratio = total / dp;
        println!(
            "{:<32} | {:>7.1} {:>7.1} {:>7.1} | {:>6.3} {:>6.3} {:>5.3} {:>5.2} | {:>9.2}x{}",
            r.v.label(),
            r.reduce_bytes as f64 / MB,
            r.gather_bytes as f64 / MB,
            total / MB,
            ratio,
            expect,
            k,
            paper_ratio(r.v.stage),
            (r.reduce + r.gather).as_secs_f64() / floor,
            if (ratio - expect).abs() > 0.01 {
                "  <- not the expected volume"
            } else {
                ""
            }
        );
    }
    println!(
        "  ×DP: total / (2Ψ·(N−1)/N elements of the comm dtype c). expect: (c + k·p)/(2c), with k \
         all-gathers of Ψ parameters: 1 for stages 1–2; for stage 3, 1 + the share of units \
         that stage3_max_reuse_distance does not keep from forward to backward (paper: k = 2, \
         c = p, so 1.5).\n  comm/floor: (reduce + gather phases) / (the same collectives on a \
         bare Ψ-element buffer, re-measured after the row's steps)."
    );
}

fn print_memory(rows: &[Row], n: usize) {
    println!(
        "\nbytes per rank (MB) from the tracker: model states (params, grads, fp32 master, m, v) \
         after build, the plan's figure, their peak during the steps and what is left after; \
         peaks of gradient buckets and of gathered stage-3 units"
    );
    println!(
        "{LABEL:<32} | {:>7} {:>8} {:>4} {:>7} {:>7} | {:>7} {:>8} | formula",
        "built", "expected", "", "peak", "after", "buckets", "gathered"
    );
    for r in rows {
        let psi = r.padded as u64;
        let want = expected_states(&r.v, psi, n as u64);
        let zero = r.v.adt == DType::BF16 && r.v.pdt() == DType::BF16;
        let formula = match (zero, r.v.stage) {
            (true, 0) => "ZeRO 16Ψ",
            (true, 1) => "ZeRO 4Ψ+12Ψ/N",
            (true, 2) => "ZeRO 2Ψ+14Ψ/N",
            (true, _) => "ZeRO 16Ψ/N",
            (false, _) => "the engine's plan for these dtypes",
        };
        let extra = r.states_peak.saturating_sub(r.states_built);
        println!(
            "{:<32} | {:>7.1} {:>8.1} {:>4} {:>7.1} {:>7.1} | {:>7.1} {:>8.1} | {formula}{}",
            r.v.label(),
            r.states_built as f64 / MB,
            want as f64 / MB,
            if r.states_built == want { "ok" } else { "DIFF" },
            r.states_peak as f64 / MB,
            r.states_after as f64 / MB,
            r.comm_peak as f64 / MB,
            r.gathered_peak as f64 / MB,
            if extra > 0 {
                format!(
                    "; peak +{:.2}Ψ B (pooled gradient buffers)",
                    extra as f64 / psi as f64
                )
            } else {
                String::new()
            }
        );
    }
}

fn print_stage3(rows: &[Row], n: usize) {
    let s3: Vec<&Row> = rows.iter().filter(|r| r.v.stage == 3).collect();
    if s3.is_empty() {
        return;
    }
    println!("\nstage 3, per measured step (rank 0)");
    for r in s3 {
        let unit = r.padded as f64 * ((n - 1) as f64 / n as f64) * r.v.pdt().size_in_bytes() as f64;
        println!(
            "{:<32} | prefetches {:>3}, prefetch hits {:>3}, peak live {:.2}Ψ, gathered {:.3}Ψ",
            r.v.label(),
            r.prefetches,
            r.prefetch_hits,
            r.peak_live as f64 / r.padded as f64,
            r.gather_bytes as f64 / unit,
        );
    }
}

fn main() {
    let a = parse_args();
    let n = a.ranks;
    let specs: Vec<UnitSpec> = model(&a).into_iter().map(|(s, _)| s).collect();
    let plan = PartitionPlan::new(&specs, n).expect("partition plan");
    let psi = plan.padded_numel();
    println!(
        "engine: {} units × {} params (hidden {}) = Ψ {} ({} padded); {n} ranks on the threads \
         backend; {} warm-up + {} measured step(s); SIMD CpuAdamW optimizer",
        a.units,
        specs[0].numel(),
        a.hidden,
        plan.numel(),
        psi,
        a.warmup,
        a.steps
    );
    let t0 = Instant::now();
    let b = baselines(&a, psi);
    print_baselines(&b, psi, n);
    let mut rows = Vec::new();
    for v in variants(&a) {
        let r = run_variant(&a, &v);
        eprintln!("  ran {:<32} in {:.1} s", v.label(), r.wall.as_secs_f64());
        rows.push(r);
    }
    print_times(&rows, n);
    print_volumes(&rows, n, a.units);
    print_memory(&rows, n);
    print_stage3(&rows, n);
    println!("\ntotal {:.0} s", t0.elapsed().as_secs_f64());
}
