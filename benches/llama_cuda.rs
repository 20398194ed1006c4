//! The Llama trained on a GPU through the engine (the device trainer,
//! `zero_llama::device::DeviceModel`, on the CUDA backend), against
//! baselines measured in the same run:
//!
//! | row | measured | baseline | target |
//! |---|---|---|---|
//! | `stage3` | one optimizer step of stage 3, bf16, 1 rank | the GPU's dense bf16 datasheet peak; a bf16 cuBLAS GEMM of 8192³ timed here | MFU ≥ 40% (datasheet) |
//! | `stage3_offload_cpu` | the same with `offload_optimizer` cpu, `pin_memory` | the `stage3` row's step | ≤ 1.5× |
//!
//! The model (defaults: a ~1B Llama, `--dim 2048 --layers 22 --heads 32
//! --kv-heads 8 --hidden 5632 --vocab 32000`) trains on random tokens,
//! `--batch` sequences of `--seq` tokens per step (every token carries
//! loss), from the engine's default initialisation; `--warmup` steps, then
//! `--steps` timed ones, each from the micro-batch's start to the step's
//! end with the device synced. FLOPs are 3 × the forward's matrix products
//! (`zero_llama::train::forward_flops`: 2 per multiply-add, attention in
//! full), the usual MFU basis. Memory: the tracker's device peak and the
//! driver's peak in use (`cuMemGetInfo`, every process's) after each step.
//!
//! `--profile` times each op of the timed steps on the device (CUDA
//! events around every op, per phase and kind: the linear, attention and
//! LM-head GEMMs with their TFLOP/s, softmax, norms, RoPE, SwiGLU,
//! embedding, cross-entropy, the gradient copies, and the compute stream's
//! time between ops: zeroing of fresh buffers, copies, casts, waits for the
//! engine's streams, idle while the host enqueues), and the host's time in
//! the engine (the tracer's spans: gathers, reductions, the optimizer, the
//! host collectives), over two more steps after the timed ones (so the
//! timings do not slow the steps the table reports), and prints the
//! breakdown per step beside the row (and in the JSON,
//! `rows.NAME.profile`). Off, the ops pay one atomic load; the host split
//! of each timed step (micro-batch, `step()`, final sync) is always
//! measured.
//!
//! `cargo bench --features cuda --bench llama_cuda [-- --steps N --batch B
//! --seq S --dim ... --only stage3,offload --profile --json PATH]`; `--cpu` runs the
//! same loop on the CPU backend with a tiny model (a smoke test of the
//! harness; no targets). Without a GPU the bench prints `skipped:` and
//! exits 0. Output: the table on stdout and
//! `target/zero-bench/llama_cuda.json` (or `--json PATH`).
//! `scripts/gpu-session.sh` runs it on a GPU machine.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use serde_json::{json, Value};
use zero::comm::{ThreadComm, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::bf16;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::Tier;
use zero::core::optim::LrSchedule;
use zero::engine::EngineComm;

/// Runs a row's engine on a backend.
type OnBackendFn =
    dyn Fn(EngineBuilder<ThreadComm>, SftModel, &Args) -> zero::Result<Measured> + Sync;
type OnBackend = Box<OnBackendFn>;
use zero::{Engine, EngineBuilder, Tracer};
use zero_llama::device::{workspace_bytes, DeviceModel, LlamaDevice, OpProfile};
use zero_llama::train::{forward_flops, gpu_bf16_peak, measure_gemm_peak, SftModel};
use zero_llama::{Config, XorShift};

/// MFU target of the stage-3 row (against the datasheet peak).
const MFU_TARGET: f64 = 0.40;
/// The offloaded step's target, as a multiple of the stage-3 step.
const OFFLOAD_TARGET: f64 = 1.5;
/// Steps profiled with `--profile`, after the timed ones.
const PROFILE_STEPS: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Row {
    Stage3,
    Offload,
}

impl Row {
    fn name(self) -> &'static str {
        match self {
            Row::Stage3 => "stage3",
            Row::Offload => "stage3_offload_cpu",
        }
    }
}

struct Args {
    model: Config,
    batch: usize,
    seq: usize,
    steps: usize,
    warmup: usize,
    rows: Vec<Row>,
    cpu: bool,
    profile: bool,
    json: PathBuf,
}

fn usage(msg: &str) -> ! {
    eprintln!(
        "llama_cuda bench: {msg}\noptions: --dim N --layers N --heads N --kv-heads N --hidden N \
         --vocab N --seq N --batch N --steps N --warmup N --only stage3,offload --profile --cpu \
         --json PATH"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let cpu = raw.iter().any(|a| a == "--cpu");
    let (dim, layers, heads, kv, hidden, vocab, seq, batch) = if cpu {
        (64, 2, 4, 2, 128, 256, 32, 2)
    } else {
        (2048, 22, 32, 8, 5632, 32000, 2048, 4)
    };
    let mut a = Args {
        model: Config {
            vocab,
            dim,
            n_layers: layers,
            n_heads: heads,
            n_kv_heads: kv,
            hidden,
            max_seq: seq,
            ..Config::tiny()
        },
        batch,
        seq,
        steps: if cpu { 2 } else { 5 },
        warmup: if cpu { 1 } else { 2 },
        rows: vec![Row::Stage3, Row::Offload],
        cpu,
        profile: false,
        json: PathBuf::from("target/zero-bench/llama_cuda.json"),
    };
    let mut it = raw.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        let mut num = |what: &str| -> usize {
            value()
                .parse()
                .ok()
                .filter(|&n: &usize| n > 0)
                .unwrap_or_else(|| usage(&format!("{what} takes a whole number >= 1")))
        };
        match flag.as_str() {
            "--dim" => a.model.dim = num("--dim"),
            "--layers" => a.model.n_layers = num("--layers"),
            "--heads" => a.model.n_heads = num("--heads"),
            "--kv-heads" => a.model.n_kv_heads = num("--kv-heads"),
            "--hidden" => a.model.hidden = num("--hidden"),
            "--vocab" => a.model.vocab = num("--vocab"),
            "--seq" => a.seq = num("--seq"),
            "--batch" => a.batch = num("--batch"),
            "--steps" => a.steps = num("--steps"),
            "--warmup" => a.warmup = num("--warmup"),
            "--only" => {
                a.rows = value()
                    .split(',')
                    .map(|s| match s {
                        "stage3" => Row::Stage3,
                        "offload" => Row::Offload,
                        _ => usage(&format!("--only: unknown row `{s}`")),
                    })
                    .collect()
            }
            "--json" => a.json = PathBuf::from(value()),
            "--profile" => a.profile = true,
            "--cpu" | "--bench" => {}
            _ => usage(&format!("unknown option {flag}")),
        }
    }
    a.model.max_seq = a.seq;
    if !a.model.n_heads.is_multiple_of(a.model.n_kv_heads)
        || !a.model.dim.is_multiple_of(a.model.n_heads)
    {
        usage("--heads must divide --dim and --kv-heads must divide --heads");
    }
    a
}

/// The engine config of a row: stage 3, bf16, one rank, one micro-batch
/// of `batch` sequences per step.
fn engine_config(row: Row, batch: usize) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(3, 1, batch);
    c.precision = Precision::Bf16;
    c.scheduler = LrSchedule::Constant { lr: 1e-4 };
    c.gradient_clipping = 1.0;
    if row == Row::Offload {
        c.zero.offload_optimizer.device = OffloadDevice::Cpu;
        c.zero.offload_optimizer.pin_memory = true;
    }
    c
}

/// What one row measured.
struct Measured {
    step_s: Vec<f64>,
    device_peak: u64,
    driver_peak: Option<u64>,
    loss_first: f32,
    loss_last: f32,
    /// The device memory the buffers' pool held from the driver after
    /// `build` (the engine's plan reserved), after the first step and
    /// after the last (`None` on the CPU).
    pool: Option<[u64; 3]>,
    /// Host seconds of each timed step in `train_micro_batch` (which ends
    /// with the compute stream synced, to read the loss), in `step()` and
    /// in the final `sync_all`.
    split: [Vec<f64>; 3],
    /// With `--profile`: the timed steps' profile.
    profile: Option<Profile>,
    /// The trainer's own buffers: the peak measured in the last step and
    /// the planned peak (`workspace_bytes`, reserved with the plan).
    workspace: [u64; 2],
}

/// What `--profile` measured over the timed steps (sums).
#[derive(Default)]
struct Profile {
    /// The ops' device times per phase and kind (`None` without timers).
    ops: Option<OpProfile>,
    /// Host seconds and count per tracer span name (`"gather"`,
    /// `"reduce"`, `"optimizer"`, `"forward"`, ...).
    host: BTreeMap<String, (f64, usize)>,
    /// The profiled steps' times (after the timed ones).
    step_s: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Trains `warmup + steps` steps on random tokens on engine builder `b`.
fn measure<C: EngineComm<B>, B: LlamaDevice>(
    b: EngineBuilder<C, B>,
    model: SftModel,
    a: &Args,
) -> zero::Result<Measured> {
    let tracer = if a.profile {
        Tracer::new()
    } else {
        Tracer::disabled()
    };
    let mut e = b.tracer(tracer.clone()).build()?;
    let built = e.device_backend().device_pool()?;
    let dm = DeviceModel::new(model, e.device_backend(), 1)?;
    let mut rng = XorShift::new(7);
    let rows = a.batch * a.seq;
    let mut m = Measured {
        step_s: Vec::new(),
        device_peak: 0,
        driver_peak: None,
        loss_first: f32::NAN,
        loss_last: f32::NAN,
        pool: None,
        split: Default::default(),
        profile: a.profile.then(Profile::default),
        workspace: [
            0,
            workspace_bytes(&a.model, None, a.batch, a.seq, false, 2).buffers,
        ],
    };
    let mut first_step = None;
    // The profiled steps come after the timed ones, so that the timings
    // around every op do not slow the steps the table reports.
    let timed = a.warmup..a.warmup + a.steps;
    let profiled = if a.profile { PROFILE_STEPS } else { 0 };
    for k in 0..timed.end + profiled {
        let tokens: Vec<u32> = (0..rows).map(|_| rng.below(a.model.vocab) as u32).collect();
        let targets: Vec<i32> = (0..rows)
            .map(|r| {
                if (r + 1) % a.seq == 0 {
                    rng.below(a.model.vocab) as i32
                } else {
                    tokens[r + 1] as i32
                }
            })
            .collect();
        if k == timed.end && a.profile {
            dm.set_profiling(e.device_backend(), true);
            tracer.clear();
        }
        let t = Instant::now();
        let st =
            dm.train_micro_batch::<bf16, C>(&mut e, &tokens, &targets, a.batch, a.seq, &tracer)?;
        let t1 = Instant::now();
        e.step()?;
        let t2 = Instant::now();
        e.device_backend().sync_all()?;
        let t3 = Instant::now();
        let dt = (t3 - t).as_secs_f64();
        if timed.contains(&k) {
            m.step_s.push(dt);
            for (v, d) in m.split.iter_mut().zip([t1 - t, t2 - t1, t3 - t2]) {
                v.push(d.as_secs_f64());
            }
        }
        if let Some(p) = m.profile.as_mut().filter(|_| k >= timed.end) {
            p.step_s.push(dt);
            if let Some(ops) = dm.take_profile(e.device_backend())? {
                p.ops.get_or_insert_with(OpProfile::default).merge(&ops);
            }
        }
        if k == 0 {
            m.loss_first = st.loss;
            first_step = e.device_backend().device_pool()?;
        }
        m.loss_last = st.loss;
        if let Some(u) = e.device_backend().device_used()? {
            m.driver_peak = Some(m.driver_peak.unwrap_or(0).max(u));
        }
    }
    if let Some(p) = m.profile.as_mut() {
        dm.set_profiling(e.device_backend(), false);
        for ev in tracer.events() {
            let h = p.host.entry(ev.name.to_string()).or_insert((0.0, 0));
            h.0 += ev.dur_us / 1e6;
            h.1 += 1;
        }
    }
    m.workspace[0] = dm.workspace_peak();
    m.device_peak = e.tracker().tier_peak(Tier::Device);
    if let (Some(b), Some(f), Some(l)) = (built, first_step, e.device_backend().device_pool()?) {
        m.pool = Some([b, f, l]);
    }
    Ok(m)
}

/// One row on the backend `on` makes of the registered builder.
fn run_row(a: &Args, row: Row, on: &OnBackendFn) -> Result<Measured, String> {
    let out = ThreadGroup::run(1, |comm: ThreadComm| {
        let mut b = Engine::builder(engine_config(row, a.batch), comm).seed(1);
        let model = SftModel::register(&mut b, a.model, None, 1, false)?;
        // The trainer's activations and workspaces (bf16) reserved with
        // the engine's plan: the pool should not grow after the build.
        let ws = workspace_bytes(&a.model, None, a.batch, a.seq, false, 2);
        on(b.device_workspace(ws.total()), model, a)
    })
    .map_err(|e| e.to_string())?;
    out.into_iter()
        .next()
        .ok_or("no rank ran")?
        .map_err(|e| e.to_string())
}

fn on_cpu(b: EngineBuilder<ThreadComm>, model: SftModel, a: &Args) -> zero::Result<Measured> {
    measure(b.backend(CpuBackend::new(CpuMode::Inline)?), model, a)
}

/// The GPU: the backend on GPU 0, its name, the datasheet bf16 peak and a
/// measured bf16 GEMM rate (FLOP/s).
struct Gpu {
    backend: zero::core::backend::CudaBackend,
    name: String,
    datasheet: Option<f64>,
    gemm: f64,
}

fn open_gpu() -> Result<Gpu, String> {
    use zero::core::backend::CudaBackend;
    let backend = CudaBackend::new(0).map_err(|e| e.to_string())?;
    let name = cudarc::driver::CudaContext::new(0)
        .and_then(|c| c.name())
        .map_err(|e| e.to_string())?;
    let datasheet = gpu_bf16_peak(&name);
    let gemm = gemm_rate(&backend).map_err(|e| format!("the bf16 GEMM baseline: {e}"))?;
    Ok(Gpu {
        backend,
        name,
        datasheet,
        gemm,
    })
}

/// A bf16 cuBLAS GEMM of 8192³ (fp32 accumulation), the median of 10
/// after 3 warm-ups, in FLOP/s.
fn gemm_rate(gpu: &zero::core::backend::CudaBackend) -> Result<f64, String> {
    use cudarc::cublas::sys::{
        cublasComputeType_t::CUBLAS_COMPUTE_32F, cublasGemmAlgo_t, cublasOperation_t::CUBLAS_OP_N,
        cudaDataType::CUDA_R_16BF,
    };
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use zero::core::backend::Stream;
    use zero::core::cuda::cublas::BlasHandle;
    let n = 8192usize;
    let stream = gpu.cuda_stream(Stream::Compute).clone();
    let blas = BlasHandle::new(&stream).map_err(|e| e.to_string())?;
    let a = stream
        .alloc_zeros::<half::bf16>(n * n)
        .map_err(|e| e.to_string())?;
    let b = stream
        .alloc_zeros::<half::bf16>(n * n)
        .map_err(|e| e.to_string())?;
    let mut c = stream
        .alloc_zeros::<half::bf16>(n * n)
        .map_err(|e| e.to_string())?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let d = n as i32;
    let mut times = Vec::new();
    for rep in 0..13 {
        stream.synchronize().map_err(|e| e.to_string())?;
        let t = Instant::now();
        let (pa, _ga) = a.device_ptr(&stream);
        let (pb, _gb) = b.device_ptr(&stream);
        let (pc, _gc) = c.device_ptr_mut(&stream);
        // SAFETY: three n×n bf16 device buffers of n² elements, the shapes
        // and leading dimensions given; alpha and beta are host f32 (the
        // default pointer mode with fp32 compute), read during the call;
        // the buffers live until after the synchronize below.
        unsafe {
            blas.gemm_ex(
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                d,
                d,
                d,
                (&alpha as *const f32).cast(),
                pa as *const _,
                CUDA_R_16BF,
                d,
                pb as *const _,
                CUDA_R_16BF,
                d,
                (&beta as *const f32).cast(),
                pc as *mut _,
                CUDA_R_16BF,
                d,
                CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| format!("cublasGemmEx: {e:?}"))?;
        stream.synchronize().map_err(|e| e.to_string())?;
        if rep >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * (n as f64).powi(3) / median(&times))
}

fn main() {
    let a = parse_args();
    let c = &a.model;
    let params = zero_llama::tensors(c)
        .iter()
        .map(|t| t.numel())
        .sum::<usize>();
    let flops = 3.0 * forward_flops(c, a.batch, a.seq, a.batch * a.seq);
    println!(
        "llama_cuda bench: {:.3}B parameters (dim {}, {} layers, {} heads, {} kv heads, hidden {}, \
         vocab {}), {} x {} tokens per step, {:.1} TFLOP per step",
        params as f64 / 1e9,
        c.dim,
        c.n_layers,
        c.n_heads,
        c.n_kv_heads,
        c.hidden,
        c.vocab,
        a.batch,
        a.seq,
        flops / 1e12
    );
    let mut doc = json!({
        "model": { "parameters": params, "dim": c.dim, "layers": c.n_layers, "heads": c.n_heads,
                   "kv_heads": c.n_kv_heads, "hidden": c.hidden, "vocab": c.vocab },
        "batch": a.batch, "seq": a.seq, "steps": a.steps, "warmup": a.warmup,
        "flop_per_step": flops, "rows": {}, "skipped": Value::Null,
    });
    let (peak, gemm, name, on): (Option<f64>, f64, String, OnBackend) = if a.cpu {
        let g = measure_gemm_peak(1);
        (None, g, "cpu (CpuBackend, inline)".into(), Box::new(on_cpu))
    } else {
        match open_gpu() {
            Ok(g) => {
                let gpu = g.backend.clone();
                let run = move |b: EngineBuilder<ThreadComm>, m: SftModel, a: &Args| {
                    use std::sync::Arc;
                    use zero::comm::{HostStaged, Paired};
                    let b = b
                        .map_comm(|c| {
                            let c = Arc::new(c);
                            Paired::new(c.clone(), HostStaged::new(c))
                        })
                        .backend(gpu.clone());
                    measure(b, m, a)
                };
                (g.datasheet, g.gemm, g.name, Box::new(run))
            }
            Err(why) => {
                println!("skipped: no usable GPU: {why}");
                doc["skipped"] = json!(why);
                write_json(&a.json, &doc);
                return;
            }
        }
    };
    println!(
        "device: {name}; {} measured {:.1} TFLOP/s{}",
        if a.cpu {
            "fp32 GEMM (measure_gemm_peak)"
        } else {
            "bf16 GEMM 8192^3"
        },
        gemm / 1e12,
        peak.map_or(String::new(), |p| format!(
            ", datasheet {:.1} TFLOP/s",
            p / 1e12
        ))
    );
    doc["device"] = json!(name);
    doc["gemm_flops"] = json!(gemm);
    doc["datasheet_flops"] = json!(peak);
    println!(
        "| row | step (median) | tokens/s | TFLOP/s | MFU (datasheet) | MFU (measured GEMM) | device peak (tracker) | in use (driver) | loss first → last |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut base: Option<f64> = None;
    for &row in &a.rows {
        match run_row(&a, row, on.as_ref()) {
            Ok(m) => {
                let step = median(&m.step_s);
                let rate = flops / step;
                let mfu = peak.map(|p| rate / p);
                let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
                println!(
                    "| {} | {:.3} s | {:.0} | {:.1} | {} | {:.1}% | {} | {} | {:.3} → {:.3} |",
                    row.name(),
                    step,
                    (a.batch * a.seq) as f64 / step,
                    rate / 1e12,
                    mfu.map_or("-".into(), |f| format!("{:.1}%", 100.0 * f)),
                    100.0 * rate / gemm,
                    gib(m.device_peak),
                    m.driver_peak.map_or("-".into(), gib),
                    m.loss_first,
                    m.loss_last
                );
                doc["rows"][row.name()] = json!({
                    "step_s": m.step_s, "step_median_s": step, "flops_per_s": rate, "mfu_datasheet": mfu,
                    "mfu_gemm": rate / gemm, "device_peak_bytes": m.device_peak,
                    "driver_peak_bytes": m.driver_peak, "loss_first": m.loss_first, "loss_last": m.loss_last,
                    "pool_bytes_built_first_last": m.pool,
                });
                if let Some([b, f, l]) = m.pool {
                    println!(
                        "{}: the buffers' pool held {} after build (the engine's plan reserved), {} \
                         after the first step (activations), {} after the last: the later steps \
                         asked the driver for {} (target 0)",
                        row.name(),
                        gib(b),
                        gib(f),
                        gib(l),
                        gib(l.saturating_sub(f))
                    );
                }
                let steps = m.step_s.len().max(1) as f64;
                let mean = |v: &[f64]| v.iter().sum::<f64>() / steps;
                let [micro, opt, sync] = &m.split;
                println!(
                    "{}: per step (mean) {:.1} ms in train_micro_batch (host, to the loss read), \
                     {:.1} ms in step(), {:.1} ms in the final sync",
                    row.name(),
                    1e3 * mean(micro),
                    1e3 * mean(opt),
                    1e3 * mean(sync)
                );
                let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
                println!(
                    "{}: the trainer's own buffers peaked at {} (planned {}, reserved with the \
                     engine's plan)",
                    row.name(),
                    mib(m.workspace[0]),
                    mib(m.workspace[1])
                );
                doc["rows"][row.name()]["workspace_bytes_measured_planned"] = json!(m.workspace);
                doc["rows"][row.name()]["split_s"] = json!({
                    "train_micro_batch": m.split[0], "step": m.split[1], "sync": m.split[2],
                });
                if let Some(p) = &m.profile {
                    doc["rows"][row.name()]["profile"] = print_profile(row.name(), p);
                }
                match row {
                    Row::Stage3 => {
                        base = Some(step);
                        if let (Some(f), false) = (mfu, a.cpu) {
                            println!(
                                "stage3 MFU {:.1}% vs target {:.0}%: {}",
                                100.0 * f,
                                100.0 * MFU_TARGET,
                                if f >= MFU_TARGET { "met" } else { "NOT met" }
                            );
                        }
                    }
                    Row::Offload => {
                        if let Some(b) = base {
                            let r = step / b;
                            doc["rows"][row.name()]["vs_stage3"] = json!(r);
                            let verdict = match (a.cpu, r <= OFFLOAD_TARGET) {
                                (true, _) => "no target on the CPU",
                                (false, true) => "met",
                                (false, false) => "NOT met",
                            };
                            println!(
                                "offload cpu step / stage3 step = {r:.2}x vs target <= {OFFLOAD_TARGET}x: {verdict}"
                            );
                        }
                    }
                }
            }
            Err(e) => {
                println!("| {} | FAILED: {e} |", row.name());
                doc["rows"][row.name()] = json!({ "failed": e });
            }
        }
    }
    write_json(&a.json, &doc);
}

/// Prints `p` (sums over its steps) per step, and returns it as JSON.
fn print_profile(row: &str, p: &Profile) -> Value {
    let steps = p.step_s.len().max(1) as f64;
    let step_s = p.step_s.iter().sum::<f64>() / steps;
    let ms = |s: f64| 1e3 * s / steps;
    let mut ops_json = Vec::new();
    match &p.ops {
        Some(ops) => {
            println!(
                "{row} profile, device time per step (mean of {steps} steps; the compute \
                 stream's clock around each op: CUDA events, or the host's on the CPU backend): \
                 ops {:.1} ms + between ops {:.1} ms = {:.1} ms from the first op to the last, \
                 of a {:.1} ms (profiled) step",
                ms(ops.op_seconds()),
                ms(ops.span_s - ops.op_seconds()),
                ms(ops.span_s),
                1e3 * step_s
            );
            println!("| phase | op | ms/step | calls/step | TFLOP/s | % of step |");
            println!("|---|---|---|---|---|---|");
            for r in &ops.rows {
                let kind = r
                    .kind
                    .map_or("(between ops: zeroing, copies, casts, waits, idle)", |k| {
                        k.name()
                    });
                let rate = if r.flops > 0.0 && r.seconds > 0.0 {
                    format!("{:.1}", r.flops / r.seconds / 1e12)
                } else {
                    "-".into()
                };
                println!(
                    "| {} | {kind} | {:.2} | {:.0} | {rate} | {:.1}% |",
                    r.phase.name(),
                    ms(r.seconds),
                    r.count as f64 / steps,
                    100.0 * r.seconds / steps / step_s
                );
                ops_json.push(json!({
                    "phase": r.phase.name(), "op": kind, "seconds_per_step": r.seconds / steps,
                    "calls_per_step": r.count as f64 / steps, "flops_per_step": r.flops / steps,
                }));
            }
        }
        None => println!("{row} profile: this backend has no op timers"),
    }
    let host: Vec<String> = p
        .host
        .iter()
        .map(|(name, (s, n))| format!("{name} {:.1} ms ({:.0}x)", ms(*s), *n as f64 / steps))
        .collect();
    println!(
        "{row} host time per step in the tracer's spans (nested spans overlap): {}",
        host.join(", ")
    );
    let host_json: BTreeMap<&str, Value> = p
        .host
        .iter()
        .map(|(name, (s, n))| {
            (
                name.as_str(),
                json!({ "seconds_per_step": s / steps, "count_per_step": *n as f64 / steps }),
            )
        })
        .collect();
    json!({
        "ops": ops_json,
        "span_s_per_step": p.ops.as_ref().map(|o| o.span_s / steps),
        "op_s_per_step": p.ops.as_ref().map(|o| o.op_seconds() / steps),
        "host": host_json,
        "step_s": p.step_s,
    })
}

fn write_json(path: &PathBuf, doc: &Value) {
    if let Some(d) = path.parent() {
        let _ = std::fs::create_dir_all(d);
    }
    match std::fs::write(path, serde_json::to_string_pretty(doc).unwrap_or_default()) {
        Ok(()) => println!("wrote {}", path.display()),
        Err(e) => eprintln!("llama_cuda bench: {}: {e}", path.display()),
    }
}
