//! ZeRO-Infinity on one machine (issue 21): a Llama whose model states may
//! be several times the host RAM trains from swap files, stage 3 with
//! `offload_optimizer` and `offload_param` both on nvme.
//!
//! The model is `examples/llama`'s (`SftModel`, as `benches/stages.rs`
//! and `llama_sft` use it) on its addition task (short sequences), on
//! `--ranks N` ranks of the threads backend (default 1), bf16, for
//! `--steps K` optimizer steps (default 10), every swap file under
//! `--dir` (`nvme_path` of both offloads; default a fresh directory under
//! the temp dir). The size: `--params P` (e.g. `50e6`, `4e9`) picks a
//! Llama shape of about P parameters (width from P as Llama's shapes
//! grow, head dim 64 below width 2048 and 128 from there, a quarter as
//! many kv heads, Llama's intermediate width, as many layers as make up
//! P); `--dim --layers --heads --kv-heads --hidden --vocab` set or
//! override each dimension (vocab at least the task's 261).
//!
//! Reported:
//!
//! - parameters, model-state bytes (16 per parameter) against the host
//!   RAM (`MemTotal`), and the bytes of the swap files;
//! - per step: the loss (mean over ranks; it must fall: the run fails
//!   when the last step's loss is not below the first's), the step time
//!   and its split on rank 0 from the engine's trace: **swap read** and
//!   **swap write** (time the rank waited for swap-file reads and
//!   writes: `swap read` / `swap write` spans), **comm** (other waits:
//!   `gather` and `reduce` spans outside the swap waits) and
//!   **compute** (the rest: forward, backward, AdamW, copies), and the
//!   bytes the process read from and wrote to the disk
//!   (`/proc/self/io`: every rank's swap traffic); and per swap file
//!   (optimizer, parameter, gradient) rank 0's bytes and waits of the
//!   median step (`EngineStats::{optimizer,param,grad}_swap`);
//! - tokens/s (padded tokens of every rank, median step);
//! - I/O against the disk: a raw `O_DIRECT` baseline of the same
//!   directory measured in the same run, after training (1, 2 and 4
//!   threads × 1, 4 and 16 MiB requests to and from a scratch buffer per
//!   thread, over a file of `--raw-bytes`, default the bytes read per
//!   step clamped to 256 MiB–2 GiB; the best pass of each direction is
//!   the disk's speed, as `fio` would find it). From it, `disk s`: the
//!   time the disk needs for the step's bytes at raw speed, its share of
//!   the step (1: the step runs at disk speed; issue 21's target for the
//!   swap path is ≥ 80% of raw), and the share of that disk time hidden
//!   behind compute (1 − swap waits ÷ disk time);
//! - peak RSS (`VmHWM`) over the run minus the resident set before the
//!   engine was built, against the plan: `zero::estimate` for this model,
//!   config and sequence length (device + host tiers of every rank: the
//!   CPU backend's device memory is host memory) and the memory
//!   tracker's measured peaks. Issue 21's target: within 10%.
//!
//! The config sets `zero_optimization.offload_optimizer.swap_gradients:
//! true` (the accumulated gradient shard goes to its own swap file unit
//! by unit as buckets are reduced, and the step streams unit by unit: host
//! memory does not grow with the model); `--no-swap-gradients` leaves it
//! out, for comparison (the fp32 gradient shard, 4 bytes per parameter,
//! then stays in host memory). Too little free space under `--dir` is the engine's error
//! (naming the path and both figures), before anything is written.
//!
//! Output: the tables on stdout and `target/zero-bench/infinity.json`;
//! `--trace FILE` writes the run's Chrome trace.
//!
//! Not for CI: at the target size (`--params 4e9`, 59 GiB of states on a
//! 24 GiB machine, 66.5 GiB of swap files) each step moves ~140 GiB
//! through the disk. Try it small first, and `--plan` a size:
//!
//! ```sh
//! cargo bench --bench infinity -- --params 50e6 --steps 5 --dir /mnt/nvme/zero
//! cargo bench --bench infinity -- --params 4e9 --dir /mnt/nvme/zero
//! ```
//!
//! Other options: `--batch B` (samples per rank per step, default 4),
//! `--lr X` (peak learning rate, default 1e-3, cosine after one warm-up
//! step), `--tile E` (`sub_group_size`, default the largest unit capped
//! at 16M elements), `--buffers N` (`offload_optimizer.buffer_count`,
//! default 4), `--io-threads T` (`aio.intra_op_parallelism`, default 1),
//! `--max-in-cpu E` (`offload_param.max_in_cpu`, default 0: every
//! parameter shard read from its file), `--checkpointing` (activation
//! checkpointing), `--raw-bytes N`, `--plan` (print the model, the
//! memory plan and the swap files' bytes against the free space, and
//! stop: what a size would need, without running it),
//! `--grad-accum-dtype fp32|bf16|fp16` (`data_types.grad_accum_dtype`:
//! the gradient swap file holds 4 bytes per parameter in fp32, the
//! default, 2 in bf16).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use zero::comm::{Communicator, ReduceOp, ThreadComm, ThreadGroup};
use zero::core::config::{AutoValues, DeepSpeedConfig, ResolvedConfig};
use zero::core::memory::Tier;
use zero::core::{bf16, HostBuffer};
use zero::engine::SwapTraffic;
use zero::estimate::{estimate, format_bytes, LlamaDims, Model, Workload};
use zero::trace::{write_chrome_trace, Event};
use zero::{Engine, EngineStats, Tracer};
use zero_llama as llama;

// (The offload bench uses the rest of it.)
#[allow(dead_code)]
#[path = "common/raw_io.rs"]
mod raw_io;
use raw_io::RawFile;

use llama::data;
use llama::train::SftModel;
use llama::Config;

const SEED: u64 = 42;
const MIB: u64 = 1 << 20;
/// The span this bench records around each step (`train_micro_batch` +
/// `step`) on every rank.
const STEP_SPAN: &str = "infinity step";

/// Prints the message and exits with status 1 (a bench has no caller to
/// return an error to).
fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1)
}

#[derive(Clone)]
struct Args {
    params: Option<f64>,
    dim: Option<usize>,
    layers: Option<usize>,
    heads: Option<usize>,
    kv_heads: Option<usize>,
    hidden: Option<usize>,
    vocab: Option<usize>,
    dir: Option<PathBuf>,
    steps: usize,
    ranks: usize,
    batch: usize,
    lr: f64,
    tile: Option<usize>,
    buffers: usize,
    io_threads: usize,
    max_in_cpu: usize,
    swap_gradients: bool,
    checkpointing: bool,
    raw_bytes: Option<u64>,
    trace: Option<PathBuf>,
    /// `--plan`: print the model, the plan and the disk need, and stop.
    plan_only: bool,
    /// `--grad-accum-dtype`: `data_types.grad_accum_dtype` (default the
    /// engine's, fp32).
    grad_accum: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        params: None,
        dim: None,
        layers: None,
        heads: None,
        kv_heads: None,
        hidden: None,
        vocab: None,
        dir: None,
        steps: 10,
        ranks: 1,
        batch: 4,
        lr: 1e-3,
        tile: None,
        buffers: 4,
        io_threads: 1,
        max_in_cpu: 0,
        swap_gradients: true,
        checkpointing: false,
        raw_bytes: None,
        trace: None,
        plan_only: false,
        grad_accum: None,
    };
    let mut it = std::env::args().skip(1);
    // Integers may be written as floats (`4e9`, `16e6`), as in DeepSpeed's
    // configs.
    fn number(flag: &str, s: Option<String>) -> f64 {
        let s = s.unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        s.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .unwrap_or_else(|| fail(&format!("{flag}: expected a positive number, got `{s}`")))
    }
    fn count(flag: &str, s: Option<String>) -> usize {
        let v = number(flag, s);
        if v.fract() != 0.0 || v > 1e15 {
            fail(&format!("{flag}: expected a positive integer, got {v}"));
        }
        v as usize
    }
    while let Some(x) = it.next() {
        match x.as_str() {
            "--params" => a.params = Some(number("--params", it.next())),
            "--dim" => a.dim = Some(count("--dim", it.next())),
            "--layers" => a.layers = Some(count("--layers", it.next())),
            "--heads" => a.heads = Some(count("--heads", it.next())),
            "--kv-heads" => a.kv_heads = Some(count("--kv-heads", it.next())),
            "--hidden" => a.hidden = Some(count("--hidden", it.next())),
            "--vocab" => a.vocab = Some(count("--vocab", it.next())),
            "--dir" => {
                a.dir = Some(PathBuf::from(
                    it.next().unwrap_or_else(|| fail("--dir needs a path")),
                ))
            }
            "--steps" => a.steps = count("--steps", it.next()),
            "--ranks" => a.ranks = count("--ranks", it.next()),
            "--batch" => a.batch = count("--batch", it.next()),
            "--lr" => a.lr = number("--lr", it.next()),
            "--tile" => a.tile = Some(count("--tile", it.next())),
            "--buffers" => a.buffers = count("--buffers", it.next()),
            "--io-threads" => a.io_threads = count("--io-threads", it.next()),
            "--max-in-cpu" => {
                let s = it
                    .next()
                    .unwrap_or_else(|| fail("--max-in-cpu needs a value"));
                a.max_in_cpu = if s == "0" {
                    0
                } else {
                    count("--max-in-cpu", Some(s))
                };
            }
            "--no-swap-gradients" => a.swap_gradients = false,
            "--checkpointing" => a.checkpointing = true,
            "--plan" => a.plan_only = true,
            "--grad-accum-dtype" => {
                a.grad_accum = Some(
                    it.next()
                        .unwrap_or_else(|| fail("--grad-accum-dtype needs fp32, bf16 or fp16")),
                )
            }
            "--raw-bytes" => a.raw_bytes = Some(count("--raw-bytes", it.next()) as u64),
            "--trace" => {
                a.trace = Some(PathBuf::from(
                    it.next().unwrap_or_else(|| fail("--trace needs a path")),
                ))
            }
            "--bench" => {} // cargo passes it
            other => fail(&format!(
                "unknown option `{other}` (see the doc comment of benches/infinity.rs)"
            )),
        }
    }
    if a.steps < 2 {
        fail("--steps: at least 2 (the loss must fall)");
    }
    a
}

// ----------------------------------------------------------------------
// The model

/// A Llama shape of about `params` parameters with vocabulary `vocab`:
/// Llama's width grows as the cube root of the size (7B: width 4096, 32
/// layers, i.e. layers ≈ width / 128 and Ψ ≈ 12 · layers · width²);
/// the width is rounded to a multiple of 64 (256 from 2048 on), the
/// layers fill `params`.
fn shape_for(params: f64, vocab: usize) -> (usize, usize, usize, usize) {
    let width = (params * 128.0 / 12.0).cbrt();
    // Heads of 128 from width 2048 on (the width a multiple of 256), of
    // 64 below (a multiple of 64).
    let (head_dim, step) = if width >= 2048.0 {
        (128, 256)
    } else {
        (64, 64)
    };
    let dim = ((width / step as f64).round() as usize).max(4) * step;
    let heads = dim / head_dim;
    let kv_heads = if heads.is_multiple_of(4) {
        heads / 4
    } else {
        heads
    };
    let d = LlamaDims {
        vocab,
        hidden: dim,
        intermediate: LlamaDims::default_intermediate(dim),
        layers: 1,
        heads,
        kv_heads,
    };
    let rest = params - (2 * vocab * dim + dim) as f64;
    let layers = ((rest / d.block_numel() as f64).round() as usize).max(1);
    (dim, layers, heads, kv_heads)
}

/// The model of the flags, with room for `seq` tokens.
fn model_config(a: &Args, seq: usize) -> Config {
    let vocab = a.vocab.unwrap_or(data::VOCAB);
    if vocab < data::VOCAB {
        fail(&format!(
            "--vocab {vocab}: the addition task's tokens need at least {}",
            data::VOCAB
        ));
    }
    let (dim, layers, heads, kv_heads) = match a.params {
        Some(p) => shape_for(p, vocab),
        None => {
            let s = Config::small();
            (s.dim, s.n_layers, s.n_heads, s.n_kv_heads)
        }
    };
    let dim = a.dim.unwrap_or(dim);
    let c = Config {
        vocab,
        dim,
        n_layers: a.layers.unwrap_or(layers),
        n_heads: a.heads.unwrap_or(heads),
        n_kv_heads: a.kv_heads.unwrap_or(kv_heads),
        hidden: a
            .hidden
            .unwrap_or_else(|| LlamaDims::default_intermediate(dim)),
        max_seq: seq,
        ..Config::small()
    };
    if let Err(e) = c.llama_dims().validate() {
        fail(&format!("the model's dimensions: {e}"));
    }
    c
}

// ----------------------------------------------------------------------
// The engine config

/// The DeepSpeed config of the run: stage 3, bf16, both offloads on nvme
/// under `dir`, buckets and prefetch of about one block (`unit`
/// elements: the largest unit), `sub_group_size` `tile`.
fn ds_config(a: &Args, dir: &Path, unit: usize, tile: usize) -> serde_json::Value {
    let mut offload_optimizer = json!({
        "device": "nvme",
        "nvme_path": dir,
        "buffer_count": a.buffers,
        "pipeline_read": true,
        "pipeline_write": true,
    });
    if a.swap_gradients {
        offload_optimizer["swap_gradients"] = json!(true);
    }
    let mut doc = json!({
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": { "enabled": true },
        "optimizer": {
            "type": "AdamW",
            "params": { "lr": a.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0 }
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": a.steps,
                "warmup_num_steps": 1,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": 0.1,
                "warmup_type": "linear"
            }
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": true,
            "reduce_bucket_size": unit,
            "allgather_bucket_size": unit,
            "stage3_prefetch_bucket_size": unit,
            "stage3_max_live_parameters": 3 * unit,
            "stage3_max_reuse_distance": unit,
            "sub_group_size": tile,
            "offload_optimizer": offload_optimizer,
            "offload_param": {
                "device": "nvme",
                "nvme_path": dir,
                "buffer_count": 4,
                "buffer_size": unit,
                "max_in_cpu": a.max_in_cpu,
            }
        },
        "aio": { "intra_op_parallelism": a.io_threads }
    });
    if let Some(d) = &a.grad_accum {
        doc["data_types"] = json!({ "grad_accum_dtype": d });
    }
    doc
}

/// Parses and resolves `doc`; a warning about `swap_gradients` (a build
/// that does not know the key would ignore it) is an error.
fn resolve(doc: &serde_json::Value, ranks: usize) -> ResolvedConfig {
    let (ds, warnings) = DeepSpeedConfig::from_json_str(&doc.to_string())
        .unwrap_or_else(|e| fail(&format!("the bench's config: {e}")));
    for w in &warnings {
        if w.contains("swap_gradients") {
            fail(&format!(
                "this build does not know zero_optimization.offload_optimizer.swap_gradients \
                 ({w}); run with --no-swap-gradients"
            ));
        }
        eprintln!("config warning: {w}");
    }
    ds.resolve(&AutoValues {
        world_size: ranks,
        ..AutoValues::default()
    })
    .unwrap_or_else(|e| fail(&format!("the bench's config: {e}")))
}

// ----------------------------------------------------------------------
// Process figures

/// A field of `/proc/self/status` in bytes (`VmHWM`, `VmRSS`: kB there).
fn proc_status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_else(|e| fail(&format!("/proc/self/status: {e}")));
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| fail(&format!("no {field} in /proc/self/status")))
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
fn mem_total() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_else(|e| fail(&format!("/proc/meminfo: {e}")));
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| fail("no MemTotal in /proc/meminfo"))
}

/// Bytes this process has read from and written to storage
/// (`read_bytes`, `write_bytes` of `/proc/self/io`; `O_DIRECT` included).
fn disk_io() -> (u64, u64) {
    let io = std::fs::read_to_string("/proc/self/io")
        .unwrap_or_else(|e| fail(&format!("/proc/self/io: {e}")));
    let field = |name: &str| {
        io.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| fail(&format!("no {name} in /proc/self/io")))
    };
    (field("read_bytes"), field("write_bytes"))
}

// ----------------------------------------------------------------------
// Training

/// One step as rank 0 saw it.
struct StepRow {
    /// Mean over ranks.
    loss: f32,
    secs: f64,
    /// Bytes the process read and wrote during the step (every rank).
    read: u64,
    written: u64,
    /// Rank 0's traffic of each swap file during the step: optimizer,
    /// parameter, gradient.
    swaps: [SwapTraffic; 3],
}

/// What the run gave back.
struct RunResult {
    steps: Vec<StepRow>,
    /// Peak bytes per tier ([`Tier::ALL`] order): of the largest rank
    /// once the ranks are joined.
    peaks: [u64; 3],
    /// The swap files' bytes (nvme tier once built): of all ranks once
    /// the ranks are joined.
    nvme_bytes: u64,
    param_swap_reads: u64,
    param_reads_ahead: u64,
}

/// The optimizer, parameter and gradient swap files' counters.
fn swap_traffic(s: &EngineStats) -> [SwapTraffic; 3] {
    [s.optimizer_swap, s.param_swap, s.grad_swap]
}

fn mean_over_ranks(comm: &ThreadComm, v: f32) -> zero::Result<f32> {
    let sum = comm
        .all_reduce(HostBuffer::from_slice(&[v])?, ReduceOp::Sum)
        .wait()?
        .to_vec();
    Ok(sum[0] / comm.world_size() as f32)
}

fn run_rank(
    comm: ThreadComm,
    a: &Args,
    cfg: &ResolvedConfig,
    model_cfg: Config,
    seq: usize,
    tracer: &Tracer,
) -> zero::Result<RunResult> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / world).max(1);
    let micro = cfg.micro_batch_size;
    let train = data::addition_task(SEED).train;
    let order = data::epoch_order(train.len(), 0, SEED);
    let mut b = Engine::builder(cfg.clone(), comm)
        .seed(SEED)
        .tracer(tracer.clone());
    let model = SftModel::register(&mut b, model_cfg, None, threads, a.checkpointing)?;
    let t = Instant::now();
    let mut e = b.build()?;
    if rank == 0 {
        eprintln!(
            "built the engine in {:.1} s (initial state written to the swap files)",
            t.elapsed().as_secs_f64()
        );
    }
    let nvme = e.tracker().tier_peak(Tier::Nvme);
    let mut rows = Vec::with_capacity(a.steps);
    for s in 0..a.steps {
        let first = (s * world + rank) * micro;
        let samples: Vec<&data::Sample> = (first..first + micro)
            .map(|i| &train[order[i % order.len()]])
            .collect();
        let (tokens, targets) =
            data::make_batch(&samples, seq).map_err(|what| zero::Error::Usage { rank, what })?;
        e.comm().barrier().wait()?;
        let swaps0 = swap_traffic(e.stats());
        let io0 = disk_io();
        let t = Instant::now();
        let span = tracer.span(rank, STEP_SPAN, "bench");
        let st =
            model.train_micro_batch::<bf16, _>(&mut e, &tokens, &targets, micro, seq, tracer)?;
        e.step()?;
        drop(span);
        let secs = t.elapsed().as_secs_f64();
        e.comm().barrier().wait()?;
        let io1 = disk_io();
        let swaps1 = swap_traffic(e.stats());
        let loss = mean_over_ranks(e.comm(), st.loss)?;
        if rank == 0 {
            eprintln!(
                "step {:>3}: loss {loss:.4}, {secs:.2} s, read {}, written {}",
                s + 1,
                format_bytes(io1.0 - io0.0),
                format_bytes(io1.1 - io0.1)
            );
        }
        rows.push(StepRow {
            loss,
            secs,
            read: io1.0 - io0.0,
            written: io1.1 - io0.1,
            swaps: [0, 1, 2].map(|i| swaps1[i] - swaps0[i]),
        });
    }
    let tr = e.tracker();
    let peaks = Tier::ALL.map(|t| tr.tier_peak(t));
    let stats = e.stats().clone();
    Ok(RunResult {
        steps: rows,
        peaks,
        nvme_bytes: nvme,
        param_swap_reads: stats.param_swap_reads,
        param_reads_ahead: stats.param_reads_ahead,
    })
}

fn run(
    a: &Args,
    cfg: &ResolvedConfig,
    model_cfg: Config,
    seq: usize,
    tracer: &Tracer,
) -> RunResult {
    let mut outs = ThreadGroup::run(a.ranks, |comm| {
        run_rank(comm, a, cfg, model_cfg, seq, tracer)
    })
    .unwrap_or_else(|e| fail(&format!("the thread group: {e}")))
    .into_iter()
    .enumerate()
    .map(|(r, x)| x.unwrap_or_else(|e| fail(&format!("rank {r}: {e}"))))
    .collect::<Vec<_>>();
    // Rank 0's steps and counters, the largest rank's peaks, every
    // rank's swap files.
    let mut peaks = [0u64; 3];
    for o in &outs {
        for (p, &x) in peaks.iter_mut().zip(&o.peaks) {
            *p = (*p).max(x);
        }
    }
    let nvme_bytes = outs.iter().map(|o| o.nvme_bytes).sum();
    RunResult {
        peaks,
        nvme_bytes,
        ..outs.swap_remove(0)
    }
}

// ----------------------------------------------------------------------
// The step's time split, from the trace

/// The length of the union of `iv` (start, end) intervals.
fn union_len(mut iv: Vec<(f64, f64)>) -> f64 {
    iv.sort_by(|x, y| x.0.total_cmp(&y.0));
    let (mut total, mut cur): (f64, Option<(f64, f64)>) = (0.0, None);
    for (s, e) in iv {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

/// Rank 0's step `k` split into (compute, swap read wait, swap write
/// wait, other waits), seconds.
#[derive(Clone, Copy, Default)]
struct Split {
    compute: f64,
    read: f64,
    write: f64,
    /// Waiting for reads or writes (their union).
    swap: f64,
    comm: f64,
}

fn splits(events: &[Event]) -> Vec<Split> {
    let mine: Vec<&Event> = events.iter().filter(|e| e.rank == 0).collect();
    let mut windows: Vec<(f64, f64)> = mine
        .iter()
        .filter(|e| e.name == STEP_SPAN)
        .map(|e| (e.ts_us, e.ts_us + e.dur_us))
        .collect();
    windows.sort_by(|x, y| x.0.total_cmp(&y.0));
    windows
        .into_iter()
        .map(|(a, b)| {
            let clip = |names: &[&str]| -> Vec<(f64, f64)> {
                mine.iter()
                    .filter(|e| names.contains(&e.name.as_ref()))
                    .map(|e| (e.ts_us.max(a), (e.ts_us + e.dur_us).min(b)))
                    .filter(|(s, e)| e > s)
                    .collect()
            };
            let read = clip(&["swap read"]);
            let write = clip(&["swap write"]);
            let swap = [read.clone(), write.clone()].concat();
            let waits = [swap.clone(), clip(&["gather", "reduce"])].concat();
            let (swap, waits) = (union_len(swap), union_len(waits));
            Split {
                compute: ((b - a) - waits) * 1e-6,
                read: union_len(read) * 1e-6,
                write: union_len(write) * 1e-6,
                swap: swap * 1e-6,
                comm: (waits - swap) * 1e-6,
            }
        })
        .collect()
}

// ----------------------------------------------------------------------
// The raw baseline

/// The best raw `O_DIRECT` write and read of a file of `bytes` under
/// `dir`, in bytes per second (the shared grid of `common/raw_io.rs`:
/// 1, 2 and 4 threads × 1, 4 and 16 MiB requests, each thread with its
/// own scratch buffer, after one untimed write of the whole file, as the
/// swap files are written before they are read). Also every pass, for the
/// report.
fn raw_baseline(dir: &Path, bytes: u64) -> ((f64, f64), Vec<String>) {
    let raw = RawFile::create(dir, bytes as usize, MIB as usize, false);
    let grid = raw.grid();
    let times = raw.grid_times(1);
    let speed = |d: Duration| bytes as f64 / d.as_secs_f64();
    let (mut best_w, mut best_r, mut lines) = (0f64, 0f64, Vec::new());
    for (p, t) in grid.iter().zip(&times) {
        let (w, r) = (speed(t[0].0), speed(t[0].1));
        lines.push(format!(
            "  {} thread(s) × {:>2} MiB: write {:.2} GB/s, read {:.2} GB/s",
            p.jobs,
            p.block as u64 / MIB,
            w / 1e9,
            r / 1e9
        ));
        best_w = best_w.max(w);
        best_r = best_r.max(r);
    }
    ((best_w, best_r), lines)
}

// ----------------------------------------------------------------------
// Report

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gib(b: u64) -> String {
    format_bytes(b)
}

fn out_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("zero-bench")
}

fn main() {
    let a = parse_args();
    let train = data::addition_task(SEED).train;
    let seq = data::max_len(&train);
    let model_cfg = model_config(&a, seq);
    let d = model_cfg.llama_dims();
    let model = Model::llama(d).unwrap_or_else(|e| fail(&format!("the model: {e}")));
    let psi = model.numel();
    let unit = model.units().iter().map(|u| u.numel()).max().unwrap_or(1);
    let tile = a.tile.unwrap_or(unit.min(16 << 20));
    let (dir, made) = match &a.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("zero-infinity-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| fail(&format!("--dir {}: {e}", dir.display())));
    let doc = ds_config(&a, &dir, unit, tile);
    let cfg = resolve(&doc, a.ranks);
    let ram = mem_total();
    let states = 16 * psi as u64;
    let work = Workload {
        seq_len: seq,
        activation_checkpointing: a.checkpointing,
    };
    let est = estimate(&model, &cfg, &work).unwrap_or_else(|e| fail(&format!("estimate: {e}")));
    let ranks = a.ranks as u64;
    let planned = ranks * (est.tier_peak(Tier::Device) + est.tier_peak(Tier::Host));
    println!(
        "infinity: Llama dim {}, {} layers, {} heads, {} kv heads, hidden {}, vocab {}: Ψ = {psi} \
         parameters ({:.3e}); largest unit {unit} elements; seq {seq}, {} samples per rank, {} \
         rank(s) on the threads backend, bf16, stage 3, offload_optimizer + offload_param nvme \
         under {}; sub_group_size {tile}, {} optimizer buffers, {} I/O thread(s), max_in_cpu {}, \
         swap_gradients {}",
        model_cfg.dim,
        model_cfg.n_layers,
        model_cfg.n_heads,
        model_cfg.n_kv_heads,
        model_cfg.hidden,
        model_cfg.vocab,
        psi as f64,
        a.batch,
        a.ranks,
        dir.display(),
        a.buffers,
        a.io_threads,
        a.max_in_cpu,
        a.swap_gradients
    );
    println!(
        "model states (16 B/param): {} = {:.2}× host RAM ({}); planned per rank: device {}, \
         host {}, nvme {} (zero::estimate); all ranks, device + host: {}",
        gib(states),
        states as f64 / ram as f64,
        gib(ram),
        gib(est.tier_peak(Tier::Device)),
        gib(est.tier_peak(Tier::Host)),
        gib(est.tier_peak(Tier::Nvme)),
        gib(planned)
    );

    let free = zero::offload::free_space(&dir)
        .unwrap_or_else(|e| fail(&format!("--dir: {e}")))
        .available;
    let nvme_need = ranks * est.tier_peak(Tier::Nvme);
    println!(
        "swap files planned: {} under {}, {} free there{}",
        gib(nvme_need),
        dir.display(),
        gib(free),
        if nvme_need > free {
            " (too little: the engine's build will refuse)"
        } else {
            ""
        }
    );
    if a.plan_only {
        if made {
            let _ = std::fs::remove_dir_all(&dir);
        }
        return;
    }

    let tracer = Tracer::new();
    let rss0 = proc_status_bytes("VmRSS");
    let t0 = Instant::now();
    let r = run(&a, &cfg, model_cfg, seq, &tracer);
    let wall = t0.elapsed();
    let hwm = proc_status_bytes("VmHWM");
    let grown = hwm.saturating_sub(rss0);
    let events = tracer.events();
    if let Some(p) = &a.trace {
        write_chrome_trace(p, &events)
            .unwrap_or_else(|e| fail(&format!("--trace {}: {e}", p.display())));
    }
    if made {
        let _ = std::fs::remove_dir_all(&dir);
    }

    // The raw baseline, after training: the swap files are gone, and its
    // buffers do not count in the peak above.
    let reads: Vec<f64> = r.steps.iter().map(|s| s.read as f64).collect();
    let raw_bytes = a
        .raw_bytes
        .unwrap_or((median(reads) as u64).clamp(256 * MIB, 2048 * MIB));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| fail(&format!("--dir {}: {e}", dir.display())));
    eprintln!("raw O_DIRECT baseline over {} ...", gib(raw_bytes));
    let ((raw_w, raw_r), passes) = raw_baseline(&dir, raw_bytes);
    if made {
        let _ = std::fs::remove_dir_all(&dir);
    }

    let split = splits(&events);
    println!(
        "\nper step (rank 0): compute, swap rd / swap wr (waits for swap reads / writes), comm \
         (other waits) in s; read / written: the process's disk bytes; disk s: those bytes at \
         the best raw speed; disk/st: disk s / step s; hidden: 1 − swap waits / disk s"
    );
    println!(
        "{:>4} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8} {:>7} {:>7}",
        "step",
        "loss",
        "step s",
        "compute",
        "swap rd",
        "swap wr",
        "comm",
        "read",
        "written",
        "disk s",
        "disk/st",
        "hidden"
    );
    let mut rows_json = Vec::new();
    let mut disk_share = Vec::new();
    let mut hidden_all = Vec::new();
    for (k, s) in r.steps.iter().enumerate() {
        let sp = split.get(k).copied().unwrap_or_default();
        let disk = s.read as f64 / raw_r + s.written as f64 / raw_w;
        let hidden = if disk > 0.0 {
            (1.0 - sp.swap / disk).clamp(0.0, 1.0)
        } else {
            0.0
        };
        if k > 0 {
            disk_share.push(disk / s.secs);
            hidden_all.push(hidden);
        }
        println!(
            "{:>4} {:>9.4} {:>8.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10} {:>10} {:>8.2} {:>6.0}% {:>6.0}%",
            k + 1,
            s.loss,
            s.secs,
            sp.compute,
            sp.read,
            sp.write,
            sp.comm,
            gib(s.read),
            gib(s.written),
            disk,
            100.0 * disk / s.secs,
            100.0 * hidden
        );
        let files: Vec<serde_json::Value> = ["optimizer", "parameter", "gradient"]
            .iter()
            .zip(&s.swaps)
            .map(|(n, t)| {
                json!({
                    "file": n, "read_bytes": t.read_bytes, "write_bytes": t.write_bytes,
                    "read_wait_s": t.read_wait.as_secs_f64(),
                    "write_wait_s": t.write_wait.as_secs_f64(),
                })
            })
            .collect();
        rows_json.push(json!({
            "step": k + 1, "loss": s.loss, "secs": s.secs, "compute_s": sp.compute,
            "swap_read_wait_s": sp.read, "swap_write_wait_s": sp.write, "comm_wait_s": sp.comm,
            "swap_files": files,
            "read_bytes": s.read, "write_bytes": s.written, "disk_s": disk, "hidden": hidden,
        }));
    }
    // Steps after the first (which records the gather order and touches
    // every buffer for the first time).
    let later: Vec<&StepRow> = r.steps.iter().skip(1).collect();
    let step_s = median(later.iter().map(|s| s.secs).collect());
    let tokens = (a.batch * a.ranks * seq) as f64;
    let (first, last) = (r.steps[0].loss, r.steps[r.steps.len() - 1].loss);
    let falls = last < first;
    let bound = planned + planned / 10;
    let within = grown <= bound;
    println!(
        "\nraw O_DIRECT under {} ({} file):",
        dir.display(),
        gib(raw_bytes)
    );
    for l in &passes {
        println!("{l}");
    }
    println!(
        "best raw: write {:.2} GB/s, read {:.2} GB/s",
        raw_w / 1e9,
        raw_r / 1e9
    );
    let (rd, wr) = (
        median(later.iter().map(|s| s.read as f64).collect()),
        median(later.iter().map(|s| s.written as f64).collect()),
    );
    println!(
        "\nsteps 2..{n}, medians: step {step_s:.2} s, {:.1} tokens/s; disk per step: read {} \
         written {} ({:.2} GB/s through the step); the step takes {:.0}% of its time at raw \
         disk speed, {:.0}% of that disk time hidden behind compute",
        tokens / step_s,
        gib(rd as u64),
        gib(wr as u64),
        (rd + wr) / step_s / 1e9,
        100.0 * median(disk_share),
        100.0 * median(hidden_all),
        n = r.steps.len()
    );
    let mid = {
        let mut k: Vec<usize> = (1..r.steps.len()).collect();
        k.sort_by(|&x, &y| r.steps[x].secs.total_cmp(&r.steps[y].secs));
        k[k.len() / 2]
    };
    println!(
        "swap traffic of rank 0 in step {} (the median step), per file (EngineStats):",
        mid + 1
    );
    for (name, t) in ["optimizer", "parameter", "gradient"]
        .iter()
        .zip(&r.steps[mid].swaps)
    {
        println!(
            "  {name:<9}: read {:>10} (waited {:.2} s), written {:>10} (waited {:.2} s)",
            gib(t.read_bytes),
            t.read_wait.as_secs_f64(),
            gib(t.write_bytes),
            t.write_wait.as_secs_f64()
        );
    }
    println!(
        "swap files: {} (all ranks); parameter shards read from swap: {} ({} issued ahead)",
        gib(r.nvme_bytes),
        r.param_swap_reads,
        r.param_reads_ahead
    );
    println!(
        "peak RSS (VmHWM) {} − {} before the build = {}; planned {} (zero::estimate, all ranks, \
         device + host), tracker {} (largest rank × {}): {:.0}% of the plan (target ≤ 110%) {}",
        gib(hwm),
        gib(rss0),
        gib(grown),
        gib(planned),
        gib(ranks * (r.peaks[0] + r.peaks[1])),
        a.ranks,
        100.0 * grown as f64 / planned.max(1) as f64,
        if within { "ok" } else { "MISS" }
    );
    println!(
        "loss {first:.4} -> {last:.4} over {} steps: {}; wall {:.1} s",
        r.steps.len(),
        if falls { "falls" } else { "DOES NOT FALL" },
        wall.as_secs_f64()
    );
    let out = out_dir();
    let meta = json!({
        "params": psi, "dim": model_cfg.dim, "layers": model_cfg.n_layers,
        "heads": model_cfg.n_heads, "kv_heads": model_cfg.n_kv_heads,
        "hidden": model_cfg.hidden, "vocab": model_cfg.vocab, "seq": seq,
        "batch": a.batch, "ranks": a.ranks, "model_state_bytes": states, "mem_total": ram,
        "planned_bytes": planned,
        "tracker_peaks": r.peaks, "vm_hwm": hwm, "rss_before": rss0,
        "raw_write_bps": raw_w, "raw_read_bps": raw_r, "raw_bytes": raw_bytes,
        "step_s": step_s, "tokens_per_s": tokens / step_s, "swap_file_bytes": r.nvme_bytes,
        "config": doc, "steps": rows_json, "wall_s": wall.as_secs_f64(),
        "per_tier_estimate": BTreeMap::from([
            ("device", est.tier_peak(Tier::Device)),
            ("host", est.tier_peak(Tier::Host)),
            ("nvme", est.tier_peak(Tier::Nvme)),
        ]),
    });
    let file = out.join("infinity.json");
    if let Err(e) = std::fs::create_dir_all(&out).and_then(|()| {
        std::fs::write(
            &file,
            serde_json::to_string_pretty(&meta).unwrap_or_default(),
        )
    }) {
        eprintln!("error: writing {}: {e}", file.display());
    }
    println!("wrote {}", file.display());
    if !falls {
        fail(&format!("the loss did not fall ({first} -> {last})"));
    }
}
