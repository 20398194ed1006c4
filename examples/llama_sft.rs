//! Supervised fine-tuning of a Llama-architecture model on the addition task
//! (`1807=` → `王大丫丫的回答是--->1800 + 7`), under any ZeRO stage and
//! offload mode, on 1..N ranks.
//!
//! ```text
//! mpirun -n 2 cargo run --example llama_sft -- --stage 3 --offload cpu
//! cargo run --example llama_sft -- --stage 3 --offload cpu          # 2 ranks as threads
//! cargo run --example llama_sft -- --stage 2 --offload nvme --nvme-path /mnt/nvme
//! cargo run --example llama_sft -- --config ds_config.json --metrics m.jsonl --trace t.json
//! cargo run --example llama_sft -- --model-dir Qwen2.5-0.5B-Instruct --data math.json --export out/
//! cargo run --example llama_sft -- --model-dir DIR --lora 8 --lora-targets q_proj,v_proj --export-adapter adapter/
//! cargo run --example llama_sft -- --model-dir DIR --data chat.jsonl --val-split 0.05 --generate "Hi!"
//! cargo run --example llama_sft -- --help
//! ```
//!
//! With `--model-dir` the model, its weights, tokenizer and chat template
//! come from a Hugging Face directory (`zero_llama::hf`); `--export DIR`
//! writes one back. `--lora R` trains PEFT-style adapters with the base
//! frozen; `--export-adapter DIR` writes them in PEFT's layout, `--adapter
//! DIR` loads one, `--merge-lora` folds them into the `--export`ed model.
//!
//! The model, the data and the engine glue are the `zero-llama` crate in
//! `examples/llama/` (`src/lib.rs`, `data.rs`, `train.rs`); `--help`
//! explains every flag.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::process::exit;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use zero::comm::agree::first_failure;
use zero::comm::{launch, CommOptions, Communicator, ReduceOp};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::config::{AutoValues, DeepSpeedConfig, OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::Tier;
use zero::core::optim::{LossScaleConfig, LrSchedule, WarmupType};
use zero::core::{bf16, f16, Element, HostBuffer};
use zero::engine::{EngineBackend, EngineComm};
use zero::trace::{gather_events, overlap, write_chrome_trace, Tracer};
use zero::{Engine, EngineBuilder, Init};
use zero_llama as llama;

use llama::data::{self, Sample, Task};
use llama::device::{workspace_bytes, DeviceModel, Trainer};
use llama::hf::{ExportSource, HfDir, HfTokenizer};
use llama::lora::LoraConfig;
use llama::recipe::{LossWatch, Recipe};
use llama::sampling::Sampler;
use llama::train::{
    forward_flops, generate_from, generate_with, measure_gemm_peak, EngineSource, LoraSetup,
    SftModel,
};
use llama::Config;

/// Where offloaded state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dev {
    /// Not offloaded.
    None,
    /// Host memory (page-aligned pool; pinned when the config asks).
    Cpu,
    /// A swap file under --nvme-path.
    Nvme,
}

impl From<Dev> for OffloadDevice {
    fn from(d: Dev) -> Self {
        match d {
            Dev::None => OffloadDevice::None,
            Dev::Cpu => OffloadDevice::Cpu,
            Dev::Nvme => OffloadDevice::Nvme,
        }
    }
}

/// Where the model computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Compute {
    /// The CPU trainer: f32 compute on the host's cores.
    Cpu,
    /// The device trainer on a CUDA GPU (the `cuda` feature): cuBLAS GEMMs and
    /// the Llama NVRTC kernels, activations in device memory; rank r on GPU
    /// r modulo the GPUs present.
    Cuda,
    /// The device trainer on the CPU backend under its hazard checker (what
    /// `cuda` runs, op for op, checked on the host; for tests).
    #[value(hide = true)]
    CpuChecked,
}

/// Parameter and gradient dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dtype {
    /// fp32 throughout.
    Fp32,
    /// bf16 parameters and gradients, fp32 master weights and compute.
    Bf16,
    /// fp16 parameters and gradients with dynamic loss scaling.
    Fp16,
}

/// The dtype of --export's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ExportAs {
    /// bfloat16, rounded to nearest even from the fp32 master.
    Bf16,
    /// IEEE half, rounded to nearest even from the fp32 master.
    Fp16,
    /// The fp32 master as it is.
    Fp32,
}

impl ExportAs {
    fn dtype(self) -> llama::weights::Dtype {
        match self {
            ExportAs::Bf16 => llama::weights::Dtype::Bf16,
            ExportAs::Fp16 => llama::weights::Dtype::F16,
            ExportAs::Fp32 => llama::weights::Dtype::F32,
        }
    }
}

/// Model presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Preset {
    /// ~0.1 M parameters: smoke tests.
    Tiny,
    /// ~0.9 M parameters: the default, sized for the addition task on a
    /// 2-core CPU.
    Task,
    /// ~48 M parameters with a byte vocabulary (a real but slow model on a CPU).
    Small,
    /// Qwen2.5-14B's published shape (14.8 B parameters, vocab 152064, q/k/v biases) with
    /// random weights on every core at once (`llama::shapes`); the byte tokenizer's ids, and
    /// the recipe of LoRA on a pretrained checkpoint. For time and memory; with its weights,
    /// --model-dir.
    #[value(name = "qwen2.5-14b")]
    Qwen2_5_14b,
}

#[derive(Parser, Debug)]
#[command(
    name = "llama_sft",
    about = "Fine-tune a Llama-architecture model on the addition task with ZeRO stages 0-3 and offload.",
    long_about = "Fine-tune a Llama-architecture model on the addition task (prompt `N=`, answer \
`王大丫丫的回答是--->a + b` with a + b = N) with ZeRO stages 0-3 and optimizer/parameter offload, \
on 1..N ranks: threads of this process (--ranks), or one process per rank under mpirun. Reports \
held-out accuracy before and after training, time, tokens/s, FLOP/s and MFU, and peak memory per \
rank and tier."
)]
struct Args {
    /// ZeRO stage 0-3 (zero_optimization.stage). Default 3, or the --config file's.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: Option<u8>,
    /// Where the fp32 master weights and AdamW moments live
    /// (zero_optimization.offload_optimizer.device). Default none, or the --config file's.
    #[arg(long, value_enum)]
    offload: Option<Dev>,
    /// Where stage 3's parameter shards live (zero_optimization.offload_param.device; stage 3
    /// only). Default none, or the --config file's.
    #[arg(long, value_enum)]
    offload_param: Option<Dev>,
    /// Directory for the nvme swap files (offload_*.nvme_path). Default: a directory under
    /// the system temp dir.
    #[arg(long)]
    nvme_path: Option<PathBuf>,
    /// Where the model computes: `cpu` (the host's cores) or `cuda` (a GPU; build with
    /// `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: Compute,
    /// Ranks to run as threads of this process; ignored under mpirun (one rank per process).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    ranks: u64,
    /// A DeepSpeed JSON config. Flags given on the command line override its values; its
    /// "auto" values are filled from the flags (or their defaults).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model preset; --dim, --layers, --heads, --kv-heads and --hidden override its dims.
    #[arg(long, value_enum, default_value = "task")]
    model: Preset,
    /// A Hugging Face model directory (LlamaForCausalLM or Qwen2ForCausalLM: config.json,
    /// model.safetensors or sharded files with their index, tokenizer.json,
    /// tokenizer_config.json): its weights are the initial values, its tokenizer and chat
    /// template make the samples. Instead of --model and the dims, --init-from.
    #[arg(long, conflicts_with_all = ["model", "init_from", "dim", "layers", "heads", "kv_heads", "hidden", "vocab"])]
    model_dir: Option<PathBuf>,
    /// Model width.
    #[arg(long)]
    dim: Option<usize>,
    /// Number of transformer blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads (grouped-query attention when fewer than --heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// SwiGLU inner width.
    #[arg(long)]
    hidden: Option<usize>,
    /// Rows of the embedding and the LM head (at least the byte tokenizer's 261).
    #[arg(long)]
    vocab: Option<usize>,
    /// Optimizer steps (0: evaluate and export the initial weights). Default: --epochs over
    /// the training set.
    #[arg(long)]
    steps: Option<usize>,
    /// Passes over the training set (ignored with --steps).
    #[arg(long, default_value_t = 12.0, value_parser = positive_f64)]
    epochs: f64,
    /// Samples per rank per micro-batch (train_micro_batch_size_per_gpu). Default 16.
    #[arg(long, value_parser = positive)]
    batch: Option<usize>,
    /// Tokens per sequence. Default: the longest training sample.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Peak learning rate (warmup, then cosine decay). Default 3e-3 (5% warmup, decay to 10%);
    /// with --model-dir 1e-4 for LoRA and 1e-5 for a full fine-tune (3% warmup, decay to 0).
    #[arg(long)]
    lr: Option<f64>,
    /// AdamW's decoupled weight decay. Default 0; with --model-dir 0.1.
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Micro-batches per optimizer step (gradient_accumulation_steps). Default 1.
    #[arg(long, value_parser = positive)]
    grad_accum: Option<usize>,
    /// Parameter dtype. Default bf16, or the --config file's.
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Keep only each block's input in forward and recompute the block in backward.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Seed of the initialisation, the held-out split and the data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Training data: a JSON list or JSON Lines of records, each {"messages": [{"role",
    /// "content"}..]} (every assistant turn is learned), {"instruction", "input", "output"}
    /// (the original experiment's format; input optional) or {"prompt", "response" or
    /// "completion"}; rendered with the model's chat template, loss on the answers only.
    /// Default: the addition task, generated in-process.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Hold out this fraction of --data's records (a seeded choice) for the validation
    /// loss (each epoch) and the exact-match accuracy.
    #[arg(long, value_parser = fraction, conflicts_with = "val_data")]
    val_split: Option<f64>,
    /// Validation records, in --data's layouts: their loss each epoch, and (without
    /// --eval-data, for a task other than addition) the exact-match accuracy.
    #[arg(long)]
    val_data: Option<PathBuf>,
    /// Evaluation records, in --data's layouts: greedy answers are compared with each
    /// record's answer (trimmed, exact match); records whose prompts are all `N=` are the
    /// addition task, scored by the sum. Default: the held-out records, or the addition
    /// task's 200 held-out numbers.
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Answer this prompt after training (with --steps 0: the model as loaded), as a user
    /// turn in the model's chat template; repeatable.
    #[arg(long)]
    generate: Vec<String>,
    /// Prompts to answer after training: one per line, or JSON (a list or JSON Lines) in
    /// --data's layouts, the answers optional.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Tokens --generate and --prompts may write at most.
    #[arg(long, default_value_t = 128, value_parser = positive)]
    max_new_tokens: usize,
    /// Sampling temperature of --generate and --prompts (0: greedy), seeded with --seed.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample from the smallest set of tokens whose probability reaches P (with
    /// --temperature above 0).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Print the token ids, pieces and labels (-100: no loss) of the first N training
    /// samples.
    #[arg(long)]
    show_tokens: Option<usize>,
    /// Initial weights from a safetensors file with HF-Llama tensor names (checked from its
    /// header, then streamed into the engine range by range).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Write one JSON line per optimizer step (loss, lr, grad norm, loss scale, tokens/s,
    /// memory) to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write a Chrome trace (open in https://ui.perfetto.dev) to this file: per rank, tracks
    /// for compute (forward, backward), the optimizer, waits for communication (gather,
    /// reduce), the collectives themselves and offload; prints how much communication was
    /// hidden behind compute.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The machine's peak TFLOP/s for MFU. Default: measured (an fp32 GEMM on every rank at once).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Write the trained model: a path ending in `.safetensors` gets the weights alone
    /// (HF-Llama names; loadable with --init-from); any other path is a Hugging Face
    /// directory that transformers loads as it is (config.json, generation_config.json,
    /// safetensors sharded above 5 GB; with --model-dir its tokenizer files). The values are
    /// the fp32 master weights (not a bf16 run's working copy) and, with LoRA, the frozen
    /// base as the checkpoint holds it; the dtype is --export-dtype's.
    #[arg(long)]
    export: Option<PathBuf>,
    /// The dtype of --export's tensors (narrower ones rounded to nearest even from the
    /// fp32 master). Default: the checkpoint's own (--model-dir's weights or --init-from's
    /// file, tensor by tensor, so that --steps 0 gives it back bit for bit), else fp32.
    #[arg(long, value_enum, requires = "export")]
    export_dtype: Option<ExportAs>,
    /// Checkpoint root: sharded checkpoints `step########/` (each rank writes its shard) and a
    /// `latest` pointer, written every --save-every steps and at the end.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps (with --save-dir; default: only at the end).
    #[arg(long, value_parser = positive)]
    save_every: Option<usize>,
    /// Keep only the newest N checkpoints under --save-dir (0 keeps all).
    #[arg(long, default_value_t = 0)]
    keep_last: usize,
    /// Resume from a checkpoint directory, or a --save-dir root (its `latest`): weights,
    /// optimizer state, step, loss scale and data position. Any rank count, stage and offload
    /// mode; with the same ones the run continues bit-identically.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// LoRA: train rank-R adapters (PEFT's LoraConfig.r) on --lora-targets, with every base
    /// weight frozen (no gradient, master or moments).
    #[arg(long, value_parser = positive, conflicts_with = "adapter")]
    lora: Option<usize>,
    /// LoRA's lora_alpha: the adapters' output is scaled by alpha / r. Default 8 (PEFT's).
    #[arg(long, requires = "lora")]
    lora_alpha: Option<f32>,
    /// LoRA's lora_dropout: the probability of dropping an adapter input element in
    /// training. Default 0 (PEFT's).
    #[arg(long, requires = "lora")]
    lora_dropout: Option<f32>,
    /// LoRA's target_modules, comma-separated, among q_proj, k_proj, v_proj, o_proj,
    /// gate_proj, up_proj, down_proj. Default q_proj,v_proj (PEFT's for Llama and Qwen2).
    #[arg(long, value_delimiter = ',', requires = "lora")]
    lora_targets: Option<Vec<String>>,
    /// Start from a PEFT LoRA adapter directory (adapter_config.json,
    /// adapter_model.safetensors) and train it further, the base frozen.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Write the trained adapters to this directory in PEFT's layout (adapter_config.json,
    /// adapter_model.safetensors with PEFT's tensor names): `PeftModel.from_pretrained` loads it.
    #[arg(long)]
    export_adapter: Option<PathBuf>,
    /// Fold the adapters into the base weights (PEFT's merge_and_unload) for --export.
    #[arg(long, requires = "export")]
    merge_lora: bool,
    /// Leave out the held-out accuracy before and after training (greedy decoding on the
    /// host, long for a large model): for runs that measure time and memory.
    #[arg(long, conflicts_with = "min_accuracy")]
    skip_eval: bool,
    /// Exit with status 3 if the held-out accuracy after training is below this percentage
    /// (for scripts and CI).
    #[arg(long)]
    min_accuracy: Option<f64>,
}

/// A whole number of at least 1.
fn positive(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{v}` is not a whole number of at least 1")),
    }
}

/// A number strictly between 0 and 1.
fn fraction(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x > 0.0 && x < 1.0 => Ok(x),
        _ => Err(format!("`{v}` is not a number between 0 and 1")),
    }
}

/// A finite number above 0.
fn positive_f64(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("`{v}` is not a number above 0")),
    }
}

const DEFAULT_STAGE: u8 = 3;
const DEFAULT_BATCH: usize = 16;

impl Args {
    /// The optimizer recipe: the pretrained one with --model-dir, the
    /// presets' otherwise; --lr and --weight-decay win.
    fn recipe(&self) -> Recipe {
        // A published shape stands in for its pretrained checkpoint.
        Recipe::choose(
            self.model_dir.is_some() || self.model == Preset::Qwen2_5_14b,
            self.lora.is_some() || self.adapter.is_some(),
            self.lr,
            self.weight_decay,
        )
    }

    fn model_config(&self, seq: usize) -> Result<Config, String> {
        let mut c = match self.model {
            Preset::Tiny => Config::tiny(),
            Preset::Task => Config {
                dim: 128,
                n_layers: 4,
                n_heads: 4,
                n_kv_heads: 2,
                hidden: 344,
                ..Config::tiny()
            },
            Preset::Small => Config::small(),
            Preset::Qwen2_5_14b => llama::shapes::qwen2_5_14b(),
        };
        if self.model != Preset::Qwen2_5_14b {
            c.vocab = data::VOCAB;
        }
        c.vocab = self.vocab.unwrap_or(c.vocab);
        c.max_seq = seq;
        if let Some(v) = self.dim {
            c.dim = v;
        }
        if let Some(v) = self.layers {
            c.n_layers = v;
        }
        if let Some(v) = self.heads {
            c.n_heads = v;
        }
        if let Some(v) = self.kv_heads {
            c.n_kv_heads = v;
        }
        if let Some(v) = self.hidden {
            c.hidden = v;
        }
        let bad = |m: &str| {
            Err(format!(
                "model dims: {m} (dim {}, heads {}, kv-heads {})",
                c.dim, c.n_heads, c.n_kv_heads
            ))
        };
        if c.vocab < data::VOCAB {
            return Err(format!(
                "--vocab {}: the byte tokenizer's ids need {} rows",
                c.vocab,
                data::VOCAB
            ));
        }
        if c.dim == 0 || c.n_layers == 0 || c.hidden == 0 {
            return bad("--dim, --layers and --hidden must be positive");
        }
        if c.n_heads == 0 || c.dim % c.n_heads != 0 {
            return bad("--heads must divide --dim");
        }
        if c.n_kv_heads == 0 || c.n_heads % c.n_kv_heads != 0 {
            return bad("--kv-heads must divide --heads");
        }
        if c.head_dim() % 2 != 0 {
            return bad("the head dim (--dim / --heads) must be even for RoPE");
        }
        Ok(c)
    }
}

/// The engine config: the --config file (its "auto" values from the flags)
/// or the defaults, then the flags given on the command line.
/// The engine config: `--config`'s file with its `"auto"` values filled
/// from the flags and the model (`hidden_size`: the model's width, from
/// which DeepSpeed's `"auto"` bucket and persistence sizes follow, as the
/// Hugging Face Trainer fills them), or llama_sft's own defaults; then the
/// flags given on the command line.
fn engine_config(
    a: &Args,
    world: usize,
    total_steps: usize,
    hidden: usize,
) -> Result<ResolvedConfig, String> {
    let recipe = a.recipe();
    let lr = recipe.lr;
    let warmup = recipe.warmup_steps(total_steps);
    let cosine = |lr| cosine(lr, warmup, total_steps, recipe.cos_min_ratio);
    let dtype = a.dtype.unwrap_or(Dtype::Bf16);
    let mut c = if let Some(path) = &a.config {
        let p = path.display();
        let text = std::fs::read_to_string(path).map_err(|e| format!("--config {p}: {e}"))?;
        // Its warnings travel in the config: the engine prints each once.
        let (ds, _) =
            DeepSpeedConfig::from_json_str(&text).map_err(|e| format!("--config {p}: {e}"))?;
        let auto = AutoValues {
            world_size: world,
            micro_batch_size: Some(a.batch.unwrap_or(DEFAULT_BATCH)),
            gradient_accumulation_steps: Some(a.grad_accum.unwrap_or(1)),
            gradient_clipping: Some(1.0),
            fp16: Some(dtype == Dtype::Fp16),
            bf16: Some(dtype == Dtype::Bf16),
            lr: Some(lr),
            betas: Some((0.9, 0.95)),
            eps: Some(1e-8),
            weight_decay: Some(recipe.weight_decay),
            warmup_min_lr: Some(0.0),
            warmup_max_lr: Some(lr),
            warmup_num_steps: Some(warmup),
            total_num_steps: Some(total_steps as u64),
            hidden_size: Some(hidden),
            ..AutoValues::default()
        };
        ds.resolve(&auto)
            .map_err(|e| format!("--config {p}: {e}"))?
    } else {
        let mut c = ResolvedConfig::simple(DEFAULT_STAGE, world, DEFAULT_BATCH);
        c.precision = Precision::Bf16;
        c.optimizer.lr = lr;
        c.optimizer.beta2 = 0.95;
        c.optimizer.weight_decay = recipe.weight_decay;
        c.gradient_clipping = 1.0;
        c.scheduler = cosine(lr);
        c
    };
    // Flags given on the command line win over the file.
    if let Some(s) = a.stage {
        c.zero.stage = s;
        if a.config.is_none() {
            // DeepSpeed's default: overlap_comm on for stage 3 only.
            c.zero.overlap_comm = s == 3;
        }
    }
    if let Some(b) = a.batch {
        c.micro_batch_size = b;
    }
    if let Some(g) = a.grad_accum {
        c.gradient_accumulation_steps = g;
    }
    c.train_batch_size = c.micro_batch_size * c.gradient_accumulation_steps * world;
    if let Some(d) = a.dtype {
        c.precision = match d {
            Dtype::Fp32 => Precision::Fp32,
            Dtype::Bf16 => Precision::Bf16,
            Dtype::Fp16 => Precision::Fp16,
        };
        c.loss_scale = (d == Dtype::Fp16).then_some(LossScaleConfig::Dynamic {
            initial_scale_power: 16,
            window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        });
    }
    if a.lr.is_some() && a.config.is_some() {
        c.optimizer.lr = lr;
        c.scheduler = cosine(lr);
    }
    if let Some(wd) = a.weight_decay {
        c.optimizer.weight_decay = wd;
    }
    let nvme = || a.nvme_path.clone().unwrap_or_else(default_nvme_dir);
    if let Some(d) = a.offload {
        let o = &mut c.zero.offload_optimizer;
        o.device = d.into();
        if d == Dev::Nvme && (o.nvme_path.is_none() || a.nvme_path.is_some()) {
            o.nvme_path = Some(nvme());
        }
    }
    if let Some(d) = a.offload_param {
        let o = &mut c.zero.offload_param;
        o.device = d.into();
        if d == Dev::Nvme && (o.nvme_path.is_none() || a.nvme_path.is_some()) {
            o.nvme_path = Some(nvme());
        }
    }
    Ok(c)
}

/// Optimizer steps of the run: --steps, or --epochs over `samples` in
/// global batches of `per_step` samples.
fn total_steps(a: &Args, samples: usize, per_step: usize) -> usize {
    let per_epoch = (samples / per_step.max(1)).max(1);
    a.steps
        .unwrap_or(((a.epochs * per_epoch as f64).round() as usize).max(1))
}

/// Whether a global micro-batch (`micro` samples on each of `world`
/// ranks) fits in the training set of `samples`; `--steps 0` trains on
/// nothing, so any data size will do.
fn batch_fits(
    steps: Option<usize>,
    micro: usize,
    world: usize,
    samples: usize,
) -> Result<(), String> {
    if micro * world > samples && steps != Some(0) {
        return Err(format!(
            "a micro-batch of {micro} samples per rank on {world} ranks needs {} samples; \
             the training set has {samples} (lower --batch or train_micro_batch_size_per_gpu)",
            micro * world,
        ));
    }
    Ok(())
}

/// `--nvme-path`'s default: a directory of this process under the temp dir.
fn default_nvme_dir() -> PathBuf {
    std::env::temp_dir().join(format!("zero-llama-sft-{}", std::process::id()))
}

/// DeepSpeed's `WarmupCosineLR`: linear warmup from 0 to `lr` over
/// `warmup` steps, then cosine decay to `cos_min_ratio * lr` at `total`.
fn cosine(lr: f64, warmup: u64, total: usize, cos_min_ratio: f64) -> LrSchedule {
    LrSchedule::WarmupCosineLr {
        base_lr: lr,
        total_steps: total as u64,
        warmup_min_ratio: 0.0,
        warmup_steps: warmup,
        cos_min_ratio,
        warmup_type: WarmupType::Linear,
    }
}

/// What the run holds out, for the data line: validation samples and
/// what accuracy is measured on.
fn held_out(s: &Setup) -> String {
    let judged = if !s.chat.exact.is_empty() {
        format!("{} held-out records (exact match)", s.chat.exact.len())
    } else if !s.task.eval.is_empty() {
        format!("{} held-out numbers", s.task.eval.len())
    } else {
        "no held-out records to score".to_string()
    };
    if s.chat.val.is_empty() {
        judged
    } else {
        format!("{} validation samples, {judged}", s.chat.val.len())
    }
}

/// The optimizer line of the report: learning rate, weight decay and
/// schedule as the engine runs them, and where the rate and decay came
/// from (a flag, the --config file, or `r`'s defaults).
fn describe_optimizer(c: &ResolvedConfig, r: &Recipe, steps: usize) -> String {
    use llama::recipe::Origin;
    let whence = |origin: Origin, value: f64, default: f64, flag: &str| match origin {
        Origin::Flag => flag.to_string(),
        Origin::Default if value == default => "default".to_string(),
        Origin::Default => "--config".to_string(),
    };
    let o = &c.optimizer;
    let schedule = match c.scheduler {
        LrSchedule::Constant { .. } => "constant".to_string(),
        LrSchedule::WarmupLr { warmup_steps, .. } => {
            format!("WarmupLR ({warmup_steps} warmup steps, then constant)")
        }
        LrSchedule::WarmupDecayLr {
            warmup_steps,
            total_steps,
            ..
        } => format!(
            "WarmupDecayLR ({warmup_steps} warmup steps, linear decay to step {total_steps})"
        ),
        LrSchedule::WarmupCosineLr {
            warmup_steps,
            cos_min_ratio,
            total_steps,
            ..
        } => format!(
            "WarmupCosineLR ({warmup_steps} warmup steps, cosine decay to {}% of lr at step \
             {total_steps})",
            100.0 * cos_min_ratio
        ),
    };
    format!(
        "optimizer: AdamW, lr {:e} ({}), weight decay {} ({}), {schedule}, {steps} steps \
         (the defaults are those for {})",
        o.lr,
        whence(r.lr_origin, o.lr, r.lr, "--lr"),
        o.weight_decay,
        whence(
            r.weight_decay_origin,
            o.weight_decay,
            r.weight_decay,
            "--weight-decay"
        ),
        r.label,
    )
}

/// Everything `run` needs that does not depend on the rank.
struct Setup {
    args: Args,
    task: Task,
    /// Validation, exact-match evaluation and generation.
    chat: ChatData,
    model: Config,
    seq: usize,
    max_new: usize,
    /// The weights of --model-dir or --init-from, one per tensor, read
    /// from their files as the engine's build asks for each range.
    init: Option<Vec<Init>>,
    tok: Tok,
    /// The Hugging Face directory of --model-dir, its config read and its
    /// weights checked.
    hf: Option<HfDir>,
    /// The dtypes of the weights the model starts from (--model-dir or
    /// --init-from), tensor by tensor: --export's default.
    checkpoint_dtypes: Option<llama::weights::TensorDtypes>,
    /// --lora or --adapter.
    lora: Option<LoraSetup>,
}

/// What the run holds out, judges and generates (`--val-split`,
/// `--val-data`, `--eval-data`, `--generate`, `--prompts`).
struct ChatData {
    /// Held-out samples: their loss is the validation loss.
    val: Vec<Sample>,
    /// Records whose greedy answers must equal the reference (empty: the
    /// addition task's numbers, or nothing, are judged).
    exact: Vec<llama::chat::Reference>,
    /// Prompts to answer after training: (the user's text, the tokens).
    gen: Vec<(String, Vec<u32>)>,
}

/// The tokenizer: the byte one of the built-in presets, or a model's.
enum Tok {
    Bytes,
    Hf(Box<HfTokenizer>),
}

impl Tok {
    /// The chat template over token ids.
    fn template(&self) -> &dyn llama::chat::Template {
        match self {
            Tok::Bytes => &llama::chat::ByteTemplate,
            Tok::Hf(t) => t.as_ref(),
        }
    }
    /// How token `id` reads in the vocabulary, for --show-tokens.
    fn piece(&self, id: u32) -> String {
        match self {
            Tok::Bytes => data::piece(id),
            Tok::Hf(t) => t.piece(id),
        }
    }
    /// The prompt asking for a split of `n`.
    fn prompt_for(&self, n: u64) -> Result<Vec<u32>, String> {
        match self {
            Tok::Bytes => Ok(data::prompt_for(n)),
            Tok::Hf(t) => t.prompt(&format!("{n}="), ""),
        }
    }
    /// Where generation stops.
    fn eos(&self) -> u32 {
        match self {
            Tok::Bytes => data::EOS,
            Tok::Hf(t) => t.eos_id(),
        }
    }
    /// Padding of a batch row.
    fn pad(&self) -> u32 {
        match self {
            Tok::Bytes => data::PAD,
            Tok::Hf(t) => t.pad_id(),
        }
    }
    /// The text of generated tokens up to EOS.
    fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tok::Bytes => data::decode(ids),
            Tok::Hf(t) => t.decode(ids),
        }
    }
}

/// One rank's results for the report.
#[derive(Clone, Debug, Default)]
struct Outcome {
    lines: Vec<String>,
    /// Held-out accuracy after training (0..1).
    accuracy: f64,
}

/// Sums `values` over ranks (f32; exact for the counts used here).
fn sum_over_ranks<C: Communicator>(comm: &C, values: &[f32]) -> zero::Result<Vec<f32>> {
    Ok(comm
        .all_reduce(HostBuffer::from_slice(values)?, ReduceOp::Sum)
        .wait()?
        .to_vec())
}

/// The held-out accuracy over all ranks (NaN when nothing is held out)
/// and a few (prompt, answer) examples of rank 0: exact match on
/// --eval-data's or the held-out records, or the addition task's numbers.
fn evaluate<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
    m: &SftModel,
    s: &Setup,
    threads: usize,
) -> zero::Result<(f64, Vec<(String, String)>)> {
    if !s.chat.exact.is_empty() {
        return evaluate_exact(e, m, s, threads);
    }
    if s.task.eval.is_empty() {
        return Ok((f64::NAN, Vec::new()));
    }
    let (acc, examples) = evaluate_numbers(e, m, s, threads)?;
    let examples = examples
        .into_iter()
        .map(|(n, t)| (format!("{n}="), t))
        .collect();
    Ok((acc, examples))
}

/// Greedy-decodes this rank's share of the exact-match records; the
/// accuracy over all ranks and a few (prompt, answer) examples of rank 0.
fn evaluate_exact<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
    m: &SftModel,
    s: &Setup,
    threads: usize,
) -> zero::Result<(f64, Vec<(String, String)>)> {
    let (rank, world) = (e.rank(), e.world_size());
    let mine: Vec<&llama::chat::Reference> =
        s.chat.exact.iter().skip(rank).step_by(world).collect();
    let prompts: Vec<Vec<u32>> = mine.iter().map(|r| r.prompt.clone()).collect();
    let (acc, texts) = score_greedy(e, m, s, threads, &prompts, |i, t| {
        llama::chat::exact_match(t, &mine[i].answer)
    })?;
    let examples = mine
        .iter()
        .map(|r| r.shown.clone())
        .zip(texts)
        .take(3)
        .collect();
    Ok((acc, examples))
}

/// Greedy-decodes `prompts` (this rank's share: every rank decodes in
/// step, reading the model unit by unit with LoRA's adapters folded in,
/// never the whole model in memory) and counts the answers `correct`
/// accepts (by prompt index); the accuracy over all ranks and this rank's
/// answers.
fn score_greedy<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
    m: &SftModel,
    s: &Setup,
    threads: usize,
    prompts: &[Vec<u32>],
    correct: impl Fn(usize, &str) -> bool,
) -> zero::Result<(f64, Vec<String>)> {
    let outs = generate_from(
        &m.cfg,
        &m.block,
        &mut EngineSource { e, model: m },
        prompts,
        s.max_new,
        s.tok.eos(),
        threads,
    )?;
    let texts: Vec<String> = outs.iter().map(|o| s.tok.decode(o)).collect();
    let right = texts
        .iter()
        .enumerate()
        .filter(|(i, t)| correct(*i, t))
        .count();
    let tot = sum_over_ranks(e.comm(), &[right as f32, prompts.len() as f32])?;
    Ok((f64::from(tot[0]) / f64::from(tot[1]).max(1.0), texts))
}

/// The validation loss (mean cross-entropy over the answer tokens of the
/// held-out samples, forward only), or `None` without held-out samples.
/// Every rank takes its share in micro-batches; all read the model together.
fn validation_loss<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
    m: &SftModel,
    s: &Setup,
    threads: usize,
) -> zero::Result<Option<f64>> {
    let val = &s.chat.val;
    if val.is_empty() {
        return Ok(None);
    }
    let (rank, world) = (e.rank(), e.world_size());
    let micro = e.config().micro_batch_size;
    let mine: Vec<&Sample> = val.iter().skip(rank).step_by(world).collect();
    let batches = val.len().div_ceil(world).div_ceil(micro);
    let (sum, count) = llama::eval::answer_loss(
        &m.cfg,
        &m.block,
        &mut EngineSource { e, model: m },
        &mine,
        batches,
        micro,
        s.tok.pad(),
        threads,
    )?;
    let tot = sum_over_ranks(e.comm(), &[sum as f32, count as f32])?;
    Ok(Some(f64::from(tot[0]) / f64::from(tot[1]).max(1.0)))
}

/// Answers --generate's and --prompts' prompts (rank 0 holds them; every
/// rank reads the model with it), greedy or sampled as --temperature and
/// --top-p say; (prompt, answer) pairs on rank 0.
fn generate_answers<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
    m: &SftModel,
    s: &Setup,
    threads: usize,
) -> zero::Result<Vec<(String, String)>> {
    let a = &s.args;
    let rank = e.rank();
    let gen: &[(String, Vec<u32>)] = if rank == 0 { &s.chat.gen } else { &[] };
    let prompts: Vec<Vec<u32>> = gen.iter().map(|g| g.1.clone()).collect();
    let mut sampler = Sampler::new(a.temperature, a.top_p, a.seed)
        .map_err(|what| zero::Error::Usage { rank, what })?;
    let outs = generate_with(
        &m.cfg,
        &m.block,
        &mut EngineSource { e, model: m },
        &prompts,
        a.max_new_tokens,
        s.tok.eos(),
        threads,
        &mut |row| sampler.pick(row),
    )?;
    Ok(gen
        .iter()
        .zip(outs)
        .map(|(g, o)| (g.0.clone(), s.tok.decode(&o)))
        .collect())
}

/// The token ids of the first `n` training samples, one line per token:
/// position, id, label (the id where the loss falls on the token, -100
/// elsewhere, as transformers' `labels`) and the vocabulary's piece.
fn show_tokens(s: &Setup, n: usize) {
    for (i, sample) in s.task.train.iter().take(n).enumerate() {
        println!(
            "sample {i}: {} tokens, prompt {} + answer {} (the answer carries the loss)",
            sample.len(),
            sample.prompt.len(),
            sample.answer.len()
        );
        println!("  {:>5} {:>8} {:>8}  piece", "pos", "id", "label");
        for (p, &id) in sample.prompt.iter().chain(&sample.answer).enumerate() {
            let label = if p >= sample.prompt.len() {
                i64::from(id)
            } else {
                i64::from(data::IGNORE)
            };
            println!("  {p:>5} {id:>8} {label:>8}  {:?}", s.tok.piece(id));
        }
    }
}

/// Greedy-decodes this rank's share of the evaluation numbers; returns the
/// accuracy over all ranks and a few (number, answer) examples of rank 0.
fn evaluate_numbers<C: EngineComm<B>, B: EngineBackend>(
    e: &mut Engine<C, B>,
    m: &SftModel,
    s: &Setup,
    threads: usize,
) -> zero::Result<(f64, Vec<(u64, String)>)> {
    let (rank, world) = (e.rank(), e.world_size());
    let mine: Vec<u64> = s
        .task
        .eval
        .iter()
        .copied()
        .skip(rank)
        .step_by(world)
        .collect();
    let prompts: Vec<Vec<u32>> = mine
        .iter()
        .map(|&n| s.tok.prompt_for(n))
        .collect::<Result<_, _>>()
        .map_err(|what| zero::Error::Usage { rank, what })?;
    let (acc, texts) = score_greedy(e, m, s, threads, &prompts, |i, t| data::score(mine[i], t))?;
    let examples = mine.into_iter().zip(texts).take(3).collect();
    Ok((acc, examples))
}

fn mib(bytes: f32) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

/// What `run` settles before the engine is built, for the training loop.
struct Prep {
    threads: usize,
    steps: usize,
    tracer: Tracer,
    offload_desc: String,
    stage: u8,
    /// The device's dense bf16 peak FLOP/s (a GPU's datasheet figure);
    /// `None` on the CPU, which measures its own.
    device_peak: Option<f64>,
}

fn run<T: Element, C: Communicator>(
    comm: C,
    s: &Setup,
    cfg: ResolvedConfig,
) -> zero::Result<Outcome> {
    let a = &s.args;
    let rank = comm.rank();
    let world = comm.world_size();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / comm.ranks_on_host().max(1)).max(1);
    let micro = cfg.micro_batch_size;
    let ga = cfg.gradient_accumulation_steps;
    let per_step = micro * ga * world;
    batch_fits(a.steps, micro, world, s.task.train.len())
        .map_err(|what| zero::Error::Usage { rank, what })?;
    let steps = total_steps(a, s.task.train.len(), per_step);
    let tracer = if a.trace.is_some() {
        Tracer::new()
    } else {
        Tracer::disabled()
    };
    let offload_desc = format!(
        "optimizer offload {}, param offload {}",
        cfg.zero.offload_optimizer.device, cfg.zero.offload_param.device
    );
    let stage = cfg.zero.stage;
    let mut b = Engine::builder(cfg, comm)
        .seed(a.seed)
        .tracer(tracer.clone());
    let model = SftModel::register_from(
        &mut b,
        s.model,
        s.init.clone(),
        s.lora.clone(),
        threads,
        a.activation_checkpointing,
    )?;
    let b = b.keep_last_checkpoints(a.keep_last);
    // The device trainer's activations and workspaces are reserved with
    // the engine's plan, so its first step does not grow the pool.
    let b = match a.device {
        Compute::Cpu => b,
        Compute::CpuChecked | Compute::Cuda => b.device_workspace(
            workspace_bytes(
                &s.model,
                s.lora.as_ref().map(|l| &l.cfg),
                micro,
                s.seq,
                a.activation_checkpointing,
                T::DTYPE.size_in_bytes(),
            )
            .total(),
        ),
    };
    let p = Prep {
        threads,
        steps,
        tracer,
        offload_desc,
        stage,
        device_peak: None,
    };
    match a.device {
        Compute::Cpu => {
            let (e, resumed) = build(b, a)?;
            train::<T, _, _, _>(e, resumed, &model, s, p)
        }
        Compute::CpuChecked => {
            let (e, resumed) = build(b.backend(CpuBackend::new(CpuMode::Checked)?), a)?;
            let dm = DeviceModel::new(model, e.device_backend(), threads)?;
            train::<T, _, _, _>(e, resumed, &dm, s, p)
        }
        Compute::Cuda => run_cuda::<T, C>(b, model, s, p, rank),
    }
}

/// Builds the engine, or loads it from --resume: the engine and the
/// checkpoint's client state.
fn build<C: EngineComm<B>, B: EngineBackend>(
    b: EngineBuilder<C, B>,
    a: &Args,
) -> zero::Result<(Engine<C, B>, Option<serde_json::Value>)> {
    Ok(match &a.resume {
        Some(path) => {
            let (e, state) = Engine::load_checkpoint(b, path)?;
            (e, Some(state))
        }
        None => (b.build()?, None),
    })
}

/// `--device cuda`: the engine on GPU `rank % GPUs` with NCCL device
/// collectives when every rank has a GPU of its own, else staged through
/// host memory (ranks sharing a GPU), and the device trainer.
#[cfg(feature = "cuda")]
fn run_cuda<T: Element, C: Communicator>(
    b: EngineBuilder<C>,
    model: SftModel,
    s: &Setup,
    mut p: Prep,
    rank: usize,
) -> zero::Result<Outcome> {
    use std::sync::Arc;
    use zero::comm::{HostStaged, Paired};
    use zero::core::backend::CudaBackend;
    use zero::core::cuda::libs::{require, Lib};
    if T::DTYPE == zero::core::DType::F16 {
        return Err(zero::Error::Unsupported {
            what: "--device cuda trains bf16 or fp32 parameters (the Llama GPU kernels have no \
                   fp16 variant): use --dtype bf16, or --device cpu for fp16"
                .into(),
        });
    }
    // The driver first: without it cudarc's calls would panic.
    require(Lib::Driver).map_err(|e| zero::Error::Unsupported {
        what: format!("--device cuda: {e}"),
    })?;
    let gpus =
        cudarc::driver::CudaContext::device_count().map_err(|e| zero::Error::Unsupported {
            what: format!("--device cuda: no CUDA device ({e})"),
        })?;
    let ordinal = rank % (gpus.max(1) as usize);
    let gpu = CudaBackend::new(ordinal)?;
    let name = cudarc::driver::CudaContext::new(ordinal)
        .and_then(|c| c.name())
        .unwrap_or_default();
    p.device_peak = llama::train::gpu_bf16_peak(&name);
    let gpus = gpus.max(1) as usize;
    // One rank per GPU: NCCL on the backend's communication stream. More
    // ranks than GPUs on this host (ranks as threads on one GPU, or NCCL
    // before 2.30, which refuses two ranks of a communicator on one GPU):
    // the device collectives go through host memory.
    // Every rank takes the same path (NCCL's set-up is a collective): the
    // hosts agree on it.
    let shares = f32::from(u8::from(b.comm().ranks_on_host() > gpus));
    let sharing = b
        .comm()
        .all_reduce(HostBuffer::from_slice(&[shares])?, ReduceOp::Sum)
        .wait()?
        .to_vec();
    if sharing[0] == 0.0 {
        use zero::comm::{CommOptions, NcclComm};
        let opts = CommOptions::from_env().unwrap_or_default();
        let nccl = NcclComm::for_backend(b.comm(), &gpu, &opts)?;
        let b = b.map_comm(|c| Paired::new(c, nccl)).backend(gpu);
        let (e, resumed) = build(b, &s.args)?;
        announce(&e, rank, ordinal, gpus, &name, "NCCL");
        let dm = DeviceModel::new(model, e.device_backend(), p.threads)?;
        train::<T, _, _, _>(e, resumed, &dm, s, p)
    } else {
        let b = b
            .map_comm(|c| {
                let c = Arc::new(c);
                Paired::new(c.clone(), HostStaged::new(c))
            })
            .backend(gpu);
        let (e, resumed) = build(b, &s.args)?;
        announce(&e, rank, ordinal, gpus, &name, "staged through host memory");
        let dm = DeviceModel::new(model, e.device_backend(), p.threads)?;
        train::<T, _, _, _>(e, resumed, &dm, s, p)
    }
}

/// The GPU line of the report (rank 0).
#[cfg(feature = "cuda")]
fn announce<C: EngineComm<zero::core::backend::CudaBackend>>(
    e: &Engine<C, zero::core::backend::CudaBackend>,
    rank: usize,
    ordinal: usize,
    gpus: usize,
    name: &str,
    collectives: &str,
) {
    if rank == 0 {
        println!(
            "device: GPU {ordinal} of {gpus} ({name}, {}), device collectives {collectives}",
            e.device_backend().arch()
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::extra_unused_type_parameters)]
fn run_cuda<T: Element, C: Communicator>(
    _: EngineBuilder<C>,
    _: SftModel,
    _: &Setup,
    _: Prep,
    _: usize,
) -> zero::Result<Outcome> {
    Err(zero::Error::Unsupported {
        what: CUDA_MISSING.into(),
    })
}

/// Why `--device cuda` cannot run in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
const CUDA_MISSING: &str = "--device cuda: this build has no CUDA support; build with the \
     `cuda` feature: cargo run --features cuda --example llama_sft -- --device cuda";

/// Trains `trainer`'s model on engine `e` (built, or loaded from
/// --resume with client state `resumed`), evaluates, exports and reports.
fn train<T: Element, C: EngineComm<B>, B: EngineBackend, M: Trainer<C, B>>(
    mut e: Engine<C, B>,
    resumed: Option<serde_json::Value>,
    trainer: &M,
    s: &Setup,
    p: Prep,
) -> zero::Result<Outcome> {
    let a = &s.args;
    let model = trainer.model();
    let Prep {
        threads,
        steps,
        tracer,
        offload_desc,
        stage,
        device_peak,
    } = p;
    let (rank, world) = (e.rank(), e.world_size());
    let lead = rank == 0;
    let micro = e.config().micro_batch_size;
    let ga = e.config().gradient_accumulation_steps;
    let per_step = micro * ga * world;
    if lead {
        println!(
            "llama_sft: stage {stage}, {world} ranks ({}), {}, {offload_desc}",
            e.comm().backend(),
            T::DTYPE,
        );
        println!(
            "model: {} parameters (dim {}, {} layers, {} heads, {} kv heads, hidden {}, vocab {}), seq {}{}",
            e.plan().numel(),
            s.model.dim,
            s.model.n_layers,
            s.model.n_heads,
            s.model.n_kv_heads,
            s.model.hidden,
            s.model.vocab,
            s.seq,
            if a.activation_checkpointing { ", activation checkpointing" } else { "" }
        );
        if let Some(l) = &s.lora {
            println!(
                "LoRA: r {}, alpha {}, dropout {}, targets {}{}: {} trainable parameters, the base's {} frozen",
                l.cfg.r,
                l.cfg.alpha,
                l.cfg.dropout,
                l.cfg.targets.join(","),
                a.adapter
                    .as_ref()
                    .map_or(String::new(), |d| format!(" (from {})", d.display())),
                e.plan().trainable_numel(),
                e.plan().frozen_numel(),
            );
        }
        if let Some(m) = &s.hf {
            let c = &s.model;
            println!(
                "from {}: {} ({}), rope_theta {}, rms_norm_eps {}, q/k/v biases {}, tied embeddings {}, {}",
                m.dir.display(),
                m.hf.model_type.architecture(),
                m.dtype.torch_name(),
                c.rope_theta,
                c.norm_eps,
                c.qkv_bias,
                c.tie_embeddings,
                match &s.tok {
                    Tok::Hf(t) if t.has_chat_template() => "tokenizer.json with its chat template",
                    _ => "tokenizer.json without a chat template (prompt, then answer and EOS)",
                }
            );
        }
        println!("{}", describe_optimizer(e.config(), &a.recipe(), steps));
        println!(
            "data: {} training samples, {}; {steps} steps of {per_step} samples \
             ({micro} per rank x {ga} accumulation x {world} ranks), {threads} GEMM thread(s) per rank",
            s.task.train.len(),
            held_out(s),
        );
        if let Some(n) = a.show_tokens {
            show_tokens(s, n);
        }
    }
    // Peak FLOP/s of the machine: every rank measures at once, the sum is
    // the machine's.
    let peak = match (a.peak_tflops, device_peak, a.device) {
        (Some(t), _, _) => t * 1e12,
        (None, Some(p), _) => p,
        (None, None, Compute::Cuda) => {
            if lead {
                eprintln!(
                    "warning: the GPU's bf16 peak is not known: pass --peak-tflops for the MFU"
                );
            }
            f64::NAN
        }
        (None, None, _) => {
            f64::from(sum_over_ranks(e.comm(), &[measure_gemm_peak(threads) as f32])?[0])
        }
    };

    let (acc_before, _) = evaluate(&mut e, model, s, threads)?;
    if lead && !acc_before.is_nan() {
        println!("accuracy before training: {:.1}%", 100.0 * acc_before);
    }
    let val_before = validation_loss(&mut e, model, s, threads)?;
    if let (Some(v), true) = (val_before, lead) {
        println!("validation loss before training: {v:.4}");
    }
    let mut val_last = val_before;
    let steps_per_epoch = (s.task.train.len() / per_step).max(1);
    // The validation loss goes to --metrics every epoch, to the log about
    // ten times a run (and at the end).
    let print_every = steps.div_ceil(steps_per_epoch).div_ceil(10).max(1) * steps_per_epoch;

    let mut metrics = match (&a.metrics, lead) {
        (Some(p), true) => Some(BufWriter::new(File::create(p).map_err(|err| {
            zero::Error::Usage {
                rank,
                what: format!("--metrics {}: {err}", p.display()),
            }
        })?)),
        _ => None,
    };
    let bar = (lead && std::io::stderr().is_terminal()).then(|| {
        let pb = ProgressBar::new(steps as u64);
        pb.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  eta {eta}")
                .expect("valid template"),
        );
        pb
    });
    let log_every = (steps / 10).max(1);
    let mut watch = LossWatch::new();
    // The data position: epoch, samples of its order consumed, steps done.
    let mut order = Vec::new();
    let mut epoch = u64::MAX;
    let mut cursor = 0usize;
    let mut first_step = 0usize;
    if let Some(state) = &resumed {
        let field = |k: &str| {
            state[k].as_u64().ok_or_else(|| zero::Error::Usage {
                rank,
                what: format!(
                    "--resume: the checkpoint's client state has no `{k}` (not written by llama_sft?)"
                ),
            })
        };
        first_step = field("step")? as usize;
        epoch = field("epoch")?;
        cursor = field("cursor")? as usize;
        order = data::epoch_order(s.task.train.len(), epoch, a.seed);
        if field("seed")? != a.seed && lead {
            eprintln!(
                "warning: --resume: the checkpoint was trained with --seed {}, this run uses {}: \
                 the data order differs",
                field("seed")?,
                a.seed
            );
        }
        if lead {
            println!(
                "resumed from {} at step {first_step} (epoch {epoch}, sample {cursor} of its order)",
                a.resume.as_ref().map_or(String::new(), |p| p.display().to_string())
            );
        }
    }
    let mut tokens_total = 0f64;
    let mut flops_total = 0f64;
    let mut act_peak = 0u64;
    let mut driver_peak: Option<u64> = None;
    // The device pool after this run's first step (activations included):
    // what later steps add to it is memory they asked the driver for.
    let mut pool_first: Option<u64> = None;
    e.reset_stats();
    let t0 = Instant::now();
    for step in first_step..steps {
        let ts = Instant::now();
        let mut loss_sum = 0f32;
        let mut target_tokens = 0usize;
        for _ in 0..ga {
            // The global micro-batch: `micro * world` samples of the epoch
            // order; this rank takes its slice.
            if cursor + micro * world > order.len() || epoch == u64::MAX {
                epoch = epoch.wrapping_add(1);
                order = data::epoch_order(s.task.train.len(), epoch, a.seed);
                cursor = 0;
            }
            let mine: Vec<&Sample> = order[cursor + rank * micro..cursor + (rank + 1) * micro]
                .iter()
                .map(|&i| &s.task.train[i])
                .collect();
            cursor += micro * world;
            let (tokens, targets) = data::make_batch_with_pad(&mine, s.seq, s.tok.pad())
                .map_err(|what| zero::Error::Usage { rank, what })?;
            let st =
                trainer.train_micro_batch::<T>(&mut e, &tokens, &targets, micro, s.seq, &tracer)?;
            loss_sum += st.loss * st.target_tokens as f32;
            target_tokens += st.target_tokens;
            act_peak = act_peak.max(st.activation_bytes);
            flops_total += 3.0 * forward_flops(&s.model, micro, s.seq, st.target_tokens);
            e.step()?;
        }
        let g = sum_over_ranks(e.comm(), &[loss_sum, target_tokens as f32])?;
        let loss = g[0] / g[1].max(1.0);
        if let (Some(w), true) = (watch.observe(step + 1, loss), lead) {
            match &bar {
                Some(pb) => pb.println(&w),
                None => eprintln!("{w}"),
            }
        }
        let o = e.last_step();
        // What the driver says is in use on the device (every process's
        // memory), next to the tracker's plan in the report.
        if let Some(used) = e.device_backend().device_used()? {
            driver_peak = Some(driver_peak.unwrap_or(0).max(used));
        }
        if step == first_step {
            pool_first = e.device_backend().device_pool()?;
        }
        let dt = ts.elapsed().as_secs_f64();
        let step_tokens = (per_step * s.seq) as f64;
        tokens_total += step_tokens;
        if let Some(w) = metrics.as_mut() {
            let tr = e.tracker();
            let line = serde_json::json!({
                "step": step + 1,
                "epoch": epoch,
                "loss": loss,
                "lr": o.lr,
                "grad_norm": o.grad_norm,
                "loss_scale": o.loss_scale,
                "skipped": o.skipped,
                "tokens_per_s": step_tokens / dt,
                "step_time_s": dt,
                "memory_rank0": {
                    "device_bytes": tr.tier_current(Tier::Device),
                    "host_bytes": tr.tier_current(Tier::Host),
                    "nvme_bytes": tr.tier_current(Tier::Nvme),
                },
            });
            writeln!(w, "{line}").map_err(|err| zero::Error::Usage {
                rank,
                what: format!("--metrics: {err}"),
            })?;
        }
        if let Some(dir) = &a.save_dir {
            if (step + 1) % a.save_every.unwrap_or(usize::MAX) == 0 || step + 1 == steps {
                let state = serde_json::json!({
                    "step": step + 1,
                    "epoch": epoch,
                    "cursor": cursor,
                    "seed": a.seed,
                });
                let path = e.save_checkpoint(dir, state)?;
                if lead {
                    let msg = format!("saved {}", path.display());
                    match &bar {
                        Some(pb) => pb.println(msg),
                        None => println!("{msg}"),
                    }
                }
            }
        }
        if (step + 1) % steps_per_epoch == 0 || step + 1 == steps {
            val_last = validation_loss(&mut e, model, s, threads)?;
            if let (Some(v), true) = (val_last, lead) {
                let msg = format!(
                    "step {}/{steps} (epoch {:.2}): validation loss {v:.4}",
                    step + 1,
                    (step + 1) as f64 / steps_per_epoch as f64
                );
                if (step + 1) % print_every == 0 || step + 1 == steps {
                    match &bar {
                        Some(pb) => pb.println(msg),
                        None => println!("{msg}"),
                    }
                }
                if let Some(w) = metrics.as_mut() {
                    let line =
                        serde_json::json!({ "step": step + 1, "epoch": epoch, "val_loss": v });
                    writeln!(w, "{line}").map_err(|err| zero::Error::Usage {
                        rank,
                        what: format!("--metrics: {err}"),
                    })?;
                }
            }
        }
        let tps = tokens_total / t0.elapsed().as_secs_f64();
        if let Some(pb) = &bar {
            pb.set_position(step as u64 + 1);
            pb.set_message(format!("loss {loss:.4}  {tps:.0} tok/s"));
        } else if lead && ((step + 1) % log_every == 0 || step == 0) {
            println!(
                "step {:>5}/{steps}  loss {loss:.4}  lr {:.2e}  grad norm {:.3}  {tps:.0} tok/s  {:.0} s",
                step + 1,
                o.lr,
                o.grad_norm.unwrap_or(f64::NAN),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    let train_time = t0.elapsed().as_secs_f64();
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    if let Some(mut w) = metrics {
        w.flush().map_err(|err| zero::Error::Usage {
            rank,
            what: format!("--metrics: {err}"),
        })?;
    }
    let (acc_after, examples) = evaluate(&mut e, model, s, threads)?;
    if !s.chat.gen.is_empty() {
        for (prompt, answer) in generate_answers(&mut e, model, s, threads)? {
            println!("prompt: {prompt}\nanswer: {answer}\n");
        }
    }
    if let (Some(dir), Some(l)) = (&a.export_adapter, &s.lora) {
        // A collective read of every block unit; rank 0 writes the files.
        let adapters = model.snapshot_adapters(&mut e)?;
        if lead {
            let base = a
                .model_dir
                .as_ref()
                .map_or(String::new(), |d| d.display().to_string());
            let files = llama::lora::save_adapter(dir, &s.model, &l.cfg, &adapters, &base)
                .map_err(|what| zero::Error::Usage {
                    rank,
                    what: format!("--export-adapter {what}"),
                })?;
            println!(
                "exported the LoRA adapter (PEFT) to {}: {}",
                dir.display(),
                files.join(", ")
            );
        }
    }
    if let Some(path) = &a.export {
        // Streamed: every rank reads the units one at a time in the same
        // order (collectives in stages 1-3), rank 0 writes each as it
        // comes: the fp32 master, the frozen base from its checkpoint.
        // With LoRA (--merge-lora, checked before training) the adapters
        // are folded into each block.
        let mut engine_err = None;
        let written = export(
            path,
            s,
            &mut |part| {
                model.export_tensors(&mut e, part).map_err(|err| {
                    let what = err.to_string();
                    engine_err = Some(err);
                    what
                })
            },
            lead,
        );
        if let Some(err) = engine_err {
            return Err(err);
        }
        // Every rank ends with rank 0's error, if it had one.
        if let Some((_, what)) = first_failure(e.comm(), written.as_ref().err())? {
            return Err(zero::Error::Usage { rank, what });
        }
    }

    // Per-rank peaks, in KiB (f32 is exact enough for a report).
    let tr = e.tracker();
    let kib = |t: Tier| tr.tier_peak(t) as f32 / 1024.0;
    let grown = match (pool_first, e.device_backend().device_pool()?) {
        (Some(first), Some(last)) => last.saturating_sub(first) as f32 / 1024.0,
        _ => -1.0,
    };
    let mut mine = vec![0f32; 6 * world];
    mine[6 * rank..6 * rank + 6].copy_from_slice(&[
        kib(Tier::Device),
        kib(Tier::Host),
        kib(Tier::Nvme),
        act_peak as f32 / 1024.0,
        driver_peak.map_or(-1.0, |b| b as f32 / 1024.0),
        grown,
    ]);
    let mem = sum_over_ranks(e.comm(), &mine)?;
    let flops = f64::from(sum_over_ranks(e.comm(), &[flops_total as f32])?[0]);
    let stats = e.stats().clone();
    let events = gather_events(e.comm(), tracer.events())?;
    if let (Some(path), Some(events)) = (&a.trace, events) {
        write_chrome_trace(path, &events).map_err(|err| zero::Error::Usage {
            rank,
            what: format!("--trace {}: {err}", path.display()),
        })?;
        println!("trace: {} ({} spans)", path.display(), events.len());
        let mut ranks: Vec<usize> = events.iter().map(|e| e.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let per_rank: Vec<String> = ranks
            .iter()
            .map(|&r| {
                let o = overlap(&events, r);
                format!(
                    "rank {r} {} of {:.0} ms (waited {:.0} ms)",
                    o.fraction()
                        .map_or("-".into(), |f| format!("{:.0}%", 100.0 * f)),
                    o.collective_us / 1e3,
                    o.wait_us / 1e3
                )
            })
            .collect();
        println!(
            "communication hidden behind compute: {}",
            per_rank.join(", ")
        );
    }
    let mut lines = Vec::new();
    if lead {
        for (p, t) in &examples {
            lines.push(format!("  {p} → {t}"));
        }
        if let (Some(b), Some(v)) = (val_before, val_last) {
            lines.push(format!(
                "validation loss: {b:.4} before training, {v:.4} after ({} held-out samples)",
                s.chat.val.len()
            ));
        }
        let pct = |x: f64| {
            if x.is_nan() {
                "-".to_string()
            } else {
                format!("{:.1}%", 100.0 * x)
            }
        };
        let off = |d: OffloadDevice| d.to_string();
        let c = e.config();
        lines.push(String::new());
        lines.push("| stage | offload | offload_param | ranks | dtype | acc. before | acc. after | time | tokens/s | TFLOP/s | MFU |".into());
        lines.push("|---|---|---|---|---|---|---|---|---|---|---|".into());
        lines.push(format!(
            "| {} | {} | {} | {world} | {} | {} | {} | {:.1} s | {:.0} | {:.3} | {:.1}% |",
            c.zero.stage,
            off(c.zero.offload_optimizer.device),
            off(c.zero.offload_param.device),
            T::DTYPE,
            pct(acc_before),
            pct(acc_after),
            train_time,
            tokens_total / train_time,
            flops / train_time / 1e12,
            100.0 * flops / train_time / peak,
        ));
        lines.push(String::new());
        lines.push(format!(
            "peak {:.3} TFLOP/s ({}); time in reduce {:.1} s, gather {:.1} s, optimizer {:.1} s (rank 0)",
            peak / 1e12,
            match (a.peak_tflops, device_peak) {
                (Some(_), _) => "--peak-tflops",
                (None, Some(_)) => "the GPU's dense bf16 datasheet peak",
                (None, None) if a.device == Compute::Cuda => "unknown",
                _ => "measured fp32 GEMM, all ranks at once",
            },
            stats.reduce_time.as_secs_f64(),
            stats.gather_time.as_secs_f64(),
            stats.optimizer_time.as_secs_f64(),
        ));
        lines.push(
            "| rank | peak device | peak host | peak nvme | activations | device in use (driver, peak) | device pool grown after step 1 |"
                .into(),
        );
        lines.push("|---|---|---|---|---|---|---|".into());
        let or_dash = |kib: f32| {
            if kib < 0.0 {
                "-".into()
            } else {
                mib(kib * 1024.0)
            }
        };
        for r in 0..world {
            let m = &mem[6 * r..6 * r + 6];
            lines.push(format!(
                "| {r} | {} | {} | {} | {} | {} | {} |",
                mib(m[0] * 1024.0),
                mib(m[1] * 1024.0),
                mib(m[2] * 1024.0),
                mib(m[3] * 1024.0),
                or_dash(m[4]),
                or_dash(m[5])
            ));
        }
    }
    Ok(Outcome {
        lines,
        accuracy: acc_after,
    })
}

/// Writes the model to `path` as --export says (`llama::export`): a
/// `.safetensors` file, or a Hugging Face directory, its values streamed
/// from `fetch` one unit at a time, in --export-dtype or the checkpoint's
/// own dtypes. Only `write` (rank 0) writes; the other ranks fetch the
/// same units in the same order.
fn export(
    path: &std::path::Path,
    s: &Setup,
    fetch: &mut llama::weights::FetchPart<'_>,
    write: bool,
) -> Result<(), String> {
    let fail = |e: String| format!("--export {e}");
    let dtypes = llama::export::choose(
        s.args.export_dtype.map(ExportAs::dtype),
        s.checkpoint_dtypes.clone(),
    );
    if write {
        println!("{}", dtypes.describe(llama::tensors(&s.model).len()));
    }
    // A directory gets the model's own positions, not the training run's.
    let mut cfg = s.model;
    let source = s.hf.as_ref().map(|m| {
        cfg.max_seq = m.hf.config.max_seq;
        ExportSource {
            dir: &m.dir,
            hf: &m.hf,
        }
    });
    let target = llama::export::Target {
        path,
        source,
        bos_eos: (Some(data::BOS), Some(data::EOS)),
    };
    let file = target.is_file();
    let files = llama::export::write(target, &cfg, &dtypes, fetch, write).map_err(fail)?;
    if write && file {
        println!("exported the weights to {}", path.display());
    } else if write {
        println!(
            "exported a Hugging Face directory ({}) to {}: {}",
            dtypes.dtypes.config_dtype().torch_name(),
            path.display(),
            files.join(", ")
        );
    }
    Ok(())
}

/// The training samples (generated addition records, or --data in any
/// layout of `llama::chat`), less the --val-split, through the byte
/// tokenizer or the model's template; the held-out samples and how
/// answers are judged; the --generate and --prompts prompts.
fn load_task(args: &Args, tok: &Tok) -> Result<(Task, ChatData), String> {
    use llama::chat::{self, Eval, Need};
    let generated = data::addition_task(args.seed);
    let t = tok.template();
    let examples = match &args.data {
        Some(p) => chat::load_examples(p, Need::Answers).map_err(|e| format!("--data {e}"))?,
        None => generated
            .train
            .iter()
            .filter_map(|s| s.number)
            .map(|n| chat::Example {
                messages: vec![
                    chat::Message::new(chat::Role::User, format!("{n}=")),
                    chat::Message::new(chat::Role::Assistant, data::answer_for(n)),
                ],
                origin: format!("generated record {n}="),
            })
            .collect(),
    };
    let (train_idx, val_idx) =
        chat::split_indices(examples.len(), args.val_split.unwrap_or(0.0), args.seed);
    if let (Some(f), true) = (args.val_split, val_idx.is_empty()) {
        return Err(format!(
            "--val-split {f}: {} record(s) cannot be split into training and validation",
            examples.len()
        ));
    }
    let pick = |idx: &[usize]| -> Vec<chat::Example> {
        idx.iter().map(|&i| examples[i].clone()).collect()
    };
    let (train_ex, mut val_ex) = (pick(&train_idx), pick(&val_idx));
    if let Some(p) = &args.val_data {
        val_ex = chat::load_examples(p, Need::Answers).map_err(|e| format!("--val-data {e}"))?;
    }
    let train = chat::samples(t, &train_ex).map_err(|e| format!("--data {e}"))?;
    let val = chat::samples(t, &val_ex).map_err(|e| format!("--val-data/--val-split {e}"))?;
    let addition = train.iter().all(|s| s.number.is_some());
    // Held-out records to judge: --eval-data, else the validation records
    // of a task other than addition, else (addition) the generated 200.
    let eval = match &args.eval_data {
        Some(p) => chat::eval_of(
            t,
            &chat::load_examples(p, Need::Answers).map_err(|e| format!("--eval-data {e}"))?,
        )
        .map_err(|e| format!("--eval-data {e}"))?,
        None if !addition => chat::eval_of(t, &val_ex)?,
        None => Eval::Numbers(generated.eval),
    };
    let (numbers, exact) = match eval {
        Eval::Numbers(n) => (n, Vec::new()),
        Eval::Exact(r) => (Vec::new(), r),
        Eval::None => (Vec::new(), Vec::new()),
    };
    let mut gen: Vec<chat::Example> = args
        .generate
        .iter()
        .map(|g| chat::Example {
            messages: vec![chat::Message::new(chat::Role::User, g.clone())],
            origin: format!("--generate {g:?}"),
        })
        .collect();
    if let Some(p) = &args.prompts {
        gen.extend(prompts_file(p)?);
    }
    let gen = gen
        .iter()
        .map(|e| {
            let shown = e.prompt().iter().rev().find(|m| m.role == chat::Role::User);
            let shown = shown.map_or(String::new(), |m| m.content.clone());
            Ok((
                shown,
                t.prompt(e.prompt())
                    .map_err(|err| format!("{}: {err}", e.origin))?,
            ))
        })
        .collect::<Result<_, String>>()?;
    Ok((
        Task {
            train,
            eval: numbers,
        },
        ChatData { val, exact, gen },
    ))
}

/// The records of --prompts: JSON (a list or JSON Lines) in any layout of
/// `llama::chat` (answers optional), or plain text, one prompt a line.
fn prompts_file(p: &std::path::Path) -> Result<Vec<llama::chat::Example>, String> {
    use llama::chat::{self, Need};
    let text = std::fs::read_to_string(p)
        .map_err(|e| format!("--prompts {}: cannot read: {e}", p.display()))?;
    let file = p.display().to_string();
    if text.trim_start().starts_with(['{', '[']) {
        return chat::parse_examples(&text, &file, Need::Prompts)
            .map_err(|e| format!("--prompts {e}"));
    }
    let out: Vec<chat::Example> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| chat::Example {
            messages: vec![chat::Message::new(chat::Role::User, l)],
            origin: format!("{file}: line {}", n + 1),
        })
        .collect();
    if out.is_empty() {
        return Err(format!("--prompts {file}: no prompts"));
    }
    Ok(out)
}

/// The engine's initialisers of weights in files: each streams its tensor.
fn sources(files: Vec<llama::weights::TensorFile>) -> Vec<Init> {
    files
        .into_iter()
        .map(|f| Init::Source(std::sync::Arc::new(f)))
        .collect()
}

fn setup(args: Args) -> Result<Setup, String> {
    #[cfg(not(feature = "cuda"))]
    if args.device == Compute::Cuda {
        return Err(CUDA_MISSING.into());
    }
    let mut hf = match &args.model_dir {
        Some(d) => Some(HfDir::open(d).map_err(|e| format!("--model-dir {e}"))?),
        None => None,
    };
    let tok = match &hf {
        Some(m) => Tok::Hf(Box::new(
            HfTokenizer::load(&m.dir, m.hf.eos_token_ids.first().copied())
                .map_err(|e| format!("--model-dir {e}"))?,
        )),
        None => Tok::Bytes,
    };
    let (mut task, mut chat) = load_task(&args, &tok)?;
    if args.skip_eval {
        task.eval.clear();
        chat.exact.clear();
    }
    Sampler::new(args.temperature, args.top_p, args.seed)?;
    let longest = data::max_len(&task.train);
    let seq = args.seq_len.unwrap_or(longest);
    if seq < longest {
        return Err(format!(
            "--seq-len {seq}: the longest training sample has {longest} tokens"
        ));
    }
    let mut max_prompt = 0;
    for &n in &task.eval {
        max_prompt = max_prompt.max(tok.prompt_for(n)?.len());
    }
    for r in &chat.exact {
        max_prompt = max_prompt.max(r.prompt.len());
    }
    let max_answer = task.train.iter().map(|s| s.answer.len()).max().unwrap_or(0);
    let max_answer = chat
        .exact
        .iter()
        .map(|r| r.answer_tokens)
        .fold(max_answer, usize::max);
    let max_new = max_answer + 4;
    let positions = seq.max(max_prompt + max_new).max(data::max_len(&chat.val));
    // Generation: the prompts and --max-new-tokens, within the model's
    // positions (generation stops at the last).
    let gen_prompt = chat.gen.iter().map(|g| g.1.len()).max().unwrap_or(0);
    let gen_positions = gen_prompt + args.max_new_tokens;
    let positions = match &hf {
        Some(m) if gen_prompt > 0 => positions.max(gen_positions.min(m.hf.config.max_seq)),
        _ if gen_prompt > 0 => positions.max(gen_positions),
        _ => positions,
    };
    if args.min_accuracy.is_some() && task.eval.is_empty() && chat.exact.is_empty() {
        return Err(
            "--min-accuracy: there are no held-out records to score (add --val-split, \
                    --val-data or --eval-data)"
                .into(),
        );
    }
    let (model, init) = match &mut hf {
        Some(m) => {
            let mut c = m.hf.config;
            let dir = m.dir.display();
            if gen_prompt >= c.max_seq {
                return Err(format!(
                    "--model-dir {dir}: a generation prompt has {gen_prompt} tokens, the \
                     model's max_position_embeddings is {}",
                    c.max_seq
                ));
            }
            if positions > c.max_seq {
                return Err(format!(
                    "--model-dir {dir}: the data needs {positions} positions, \
                     the model's max_position_embeddings is {}",
                    c.max_seq
                ));
            }
            // RoPE tables for the positions this run uses.
            c.max_seq = positions;
            if let Tok::Hf(t) = &tok {
                if t.max_id() as usize >= c.vocab {
                    return Err(format!(
                        "--model-dir {dir}: the tokenizer has token id {}, the model's \
                         vocab_size is {}",
                        t.max_id(),
                        c.vocab
                    ));
                }
            }
            // The weights move to the engine's initialisation; an export
            // needs only the directory, its config and dtypes.
            (c, Some(std::mem::take(&mut m.weights)))
        }
        None => {
            let model = args.model_config(positions)?;
            let init = match &args.init_from {
                Some(p) => {
                    Some(llama::weights::open(p, &model).map_err(|e| format!("--init-from {e}"))?)
                }
                None => None,
            };
            (model, init)
        }
    };
    let checkpoint_dtypes = init.as_deref().map(llama::weights::TensorDtypes::of_files);
    let init = match init {
        Some(files) => Some(sources(files)),
        // Random weights that start in seconds at 14.8 B parameters.
        None if hf.is_none() && args.model == Preset::Qwen2_5_14b => {
            Some(llama::shapes::random_init(&model, args.seed))
        }
        None => None,
    };
    let lora = lora_setup(&args, &model)?;
    Ok(Setup {
        args,
        task,
        chat,
        model,
        seq,
        max_new,
        init,
        tok,
        hf,
        checkpoint_dtypes,
        lora,
    })
}

/// LoRA from --lora and its flags or from --adapter; `None` without. Every
/// bad value is an error naming the flag (and the module, file or tensor).
fn lora_setup(args: &Args, model: &Config) -> Result<Option<LoraSetup>, String> {
    let lora = match (args.lora, &args.adapter) {
        (Some(r), _) => {
            let targets: Vec<&str> = match &args.lora_targets {
                Some(t) => t.iter().map(|s| s.trim()).collect(),
                None => vec!["q_proj", "v_proj"],
            };
            let cfg = LoraConfig::new(
                r,
                args.lora_alpha.unwrap_or(8.0),
                args.lora_dropout.unwrap_or(0.0),
                &targets,
            )
            .map_err(|e| format!("--lora: {e}"))?;
            Some(LoraSetup {
                cfg,
                seed: args.seed,
                adapters: None,
            })
        }
        (None, Some(dir)) => {
            let (cfg, values) =
                llama::lora::load_adapter(dir, model).map_err(|e| format!("--adapter {e}"))?;
            Some(LoraSetup {
                cfg,
                seed: args.seed,
                adapters: Some(values),
            })
        }
        (None, None) => None,
    };
    if lora.is_none() {
        if let Some(d) = &args.export_adapter {
            return Err(format!(
                "--export-adapter {}: there are no adapters to export (add --lora R or --adapter DIR)",
                d.display()
            ));
        }
        if args.merge_lora {
            return Err(
                "--merge-lora: there are no adapters to merge (add --lora R or --adapter DIR)"
                    .into(),
            );
        }
    } else if let (Some(p), false) = (&args.export, args.merge_lora) {
        return Err(format!(
            "--export {}: with LoRA the base weights do not change; add --merge-lora to fold the \
             adapters into the exported model, or write the adapters alone with --export-adapter",
            p.display()
        ));
    }
    Ok(lora)
}

fn main() {
    let args = Args::parse();
    let ranks = args.ranks as usize;
    let s = match setup(args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            exit(2);
        }
    };
    let out = launch(
        ranks,
        &CommOptions::from_env().unwrap_or_default(),
        |comm| {
            let world = comm.world_size();
            // The schedule's total_num_steps depends on the batch, which a
            // --config file may set: resolve, count the steps with the
            // resolved batch, and resolve again if the count changed.
            let guess = total_steps(
                &s.args,
                s.task.train.len(),
                s.args.batch.unwrap_or(DEFAULT_BATCH) * s.args.grad_accum.unwrap_or(1) * world,
            );
            let mut cfg = engine_config(&s.args, world, guess, s.model.dim)?;
            let steps = total_steps(&s.args, s.task.train.len(), cfg.train_batch_size);
            if steps != guess {
                cfg = engine_config(&s.args, world, steps, s.model.dim)?;
            }
            match cfg.precision {
                Precision::Fp32 => run::<f32, _>(comm, &s, cfg),
                Precision::Bf16 => run::<bf16, _>(comm, &s, cfg),
                Precision::Fp16 => run::<f16, _>(comm, &s, cfg),
            }
            .map_err(|e| e.to_string())
        },
    );
    if s.args.nvme_path.is_none() {
        // The default swap directory, once the engine removed its files;
        // left alone if anything else is in it.
        let _ = std::fs::remove_dir(default_nvme_dir());
    }
    let mut failed = false;
    let mut accuracy = f64::INFINITY;
    match out {
        Ok(results) => {
            // Ranks that fail alike (a bad config) say so once.
            let mut said: Vec<String> = Vec::new();
            for r in results {
                match r {
                    Ok(o) => {
                        o.lines.iter().for_each(|l| println!("{l}"));
                        accuracy = accuracy.min(o.accuracy);
                    }
                    Err(e) => {
                        if !said.contains(&e) {
                            eprintln!("error: {e}");
                            said.push(e);
                        }
                        failed = true;
                    }
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            failed = true;
        }
    }
    if failed {
        exit(1);
    }
    if let Some(min) = s.args.min_accuracy {
        if 100.0 * accuracy < min {
            eprintln!(
                "error: held-out accuracy {:.1}% is below --min-accuracy {min}%",
                100.0 * accuracy
            );
            exit(3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The resolved optimizer of these flags: (lr, weight decay, the
    /// schedule's warmup steps and cosine floor) for a 100-step run.
    fn optimizer(flags: &[&str]) -> (f64, f64, u64, f64) {
        let a = Args::try_parse_from(std::iter::once("llama_sft").chain(flags.iter().copied()))
            .unwrap();
        let c = engine_config(&a, 2, 100, 64).unwrap();
        let LrSchedule::WarmupCosineLr {
            warmup_steps,
            cos_min_ratio,
            base_lr,
            ..
        } = c.scheduler
        else {
            panic!("{:?}", c.scheduler);
        };
        assert_eq!(base_lr, c.optimizer.lr);
        (
            c.optimizer.lr,
            c.optimizer.weight_decay,
            warmup_steps,
            cos_min_ratio,
        )
    }

    /// A DeepSpeed config with these optimizer params, in the temp dir.
    fn ds_config(name: &str, params: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "llama_sft_recipe_{}_{name}.json",
            std::process::id()
        ));
        let text = format!(
            r#"{{"train_micro_batch_size_per_gpu": "auto",
                "optimizer": {{"type": "AdamW", "params": {params}}},
                "scheduler": {{"type": "WarmupCosineLR",
                    "params": {{"total_num_steps": "auto", "warmup_num_steps": "auto"}}}},
                "zero_optimization": {{"stage": 2}}}}"#
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    fn args(flags: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("llama_sft").chain(flags.iter().copied())).unwrap()
    }

    #[test]
    fn the_published_shape_is_qwen2_5_14b_with_its_recipe() {
        let a = args(&["--model", "qwen2.5-14b", "--lora", "8"]);
        let c = a.model_config(51).unwrap();
        assert_eq!(
            (
                c.vocab,
                c.dim,
                c.n_layers,
                c.n_heads,
                c.n_kv_heads,
                c.hidden
            ),
            (152_064, 5120, 48, 40, 8, 13_824)
        );
        assert!(c.qkv_bias && !c.tie_embeddings && c.rope_theta == 1e6 && c.max_seq == 51);
        // It stands in for the checkpoint: LoRA's fine-tuning recipe.
        assert_eq!(
            optimizer(&["--model", "qwen2.5-14b", "--lora", "8"]),
            (1e-4, 0.1, 3, 0.0)
        );
        let small = ["--model", "qwen2.5-14b", "--dim", "160", "--vocab", "261"];
        let c = args(&small).model_config(51).unwrap();
        assert_eq!((c.vocab, c.dim, c.n_layers), (261, 160, 48));
        let e = args(&["--vocab", "100"]).model_config(51).unwrap_err();
        assert!(e.contains("--vocab 100") && e.contains("261"), "{e}");
        assert!(Args::try_parse_from(["llama_sft", "--model-dir", "m", "--vocab", "300"]).is_err());
    }

    #[test]
    fn a_random_published_shape_and_skip_eval() {
        let flags = [
            "--model",
            "qwen2.5-14b",
            "--dim",
            "64",
            "--layers",
            "1",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--hidden",
            "96",
            "--vocab",
            "300",
            "--skip-eval",
        ];
        let s = setup(args(&flags)).unwrap();
        let init = s.init.as_ref().expect("random initialisers");
        assert_eq!(init.len(), s.model.tensor_count());
        assert!(matches!(init[0], Init::Source(_)), "{:?}", init[0]);
        assert!(s.task.eval.is_empty() && s.chat.exact.is_empty());
        // The presets keep the engine's own initialisation, and their evaluation.
        let s = setup(args(&["--model", "tiny"])).unwrap();
        assert!(s.init.is_none() && !s.task.eval.is_empty());
        let both = ["--skip-eval", "--min-accuracy", "90"];
        assert!(Args::try_parse_from(std::iter::once("llama_sft").chain(both)).is_err());
    }

    #[test]
    fn steps_0_takes_any_data_size() {
        assert!(batch_fits(Some(0), 16, 2, 3).is_ok());
        assert!(batch_fits(None, 16, 2, 32).is_ok());
        let e = batch_fits(None, 16, 2, 31).unwrap_err();
        assert!(
            e.contains("needs 32 samples") && e.contains("has 31"),
            "{e}"
        );
        assert!(batch_fits(Some(1), 16, 2, 3).is_err());
    }

    #[test]
    fn pretrained_checkpoints_get_the_fine_tuning_recipe() {
        assert_eq!(optimizer(&[]), (3e-3, 0.0, 5, 0.1), "the presets'");
        assert_eq!(optimizer(&["--model-dir", "m"]), (1e-5, 0.1, 3, 0.0));
        assert_eq!(optimizer(&["--model-dir", "m", "--lora", "8"]).0, 1e-4);
        assert_eq!(optimizer(&["--model-dir", "m", "--adapter", "a"]).0, 1e-4);
    }

    #[test]
    fn flags_and_config_values_win_over_the_recipe() {
        let flags = ["--model-dir", "m", "--lr", "3e-4", "--weight-decay", "0"];
        assert_eq!(optimizer(&flags), (3e-4, 0.0, 3, 0.0));
        let auto = ds_config("auto", r#"{"lr": "auto", "weight_decay": "auto"}"#);
        let given = ds_config("given", r#"{"lr": 2e-4, "weight_decay": 0.05}"#);
        let (a, g) = (auto.to_str().unwrap(), given.to_str().unwrap());
        assert_eq!(
            optimizer(&["--model-dir", "m", "--config", a]),
            // The file's scheduler keeps DeepSpeed's cos_min_ratio default.
            (1e-5, 0.1, 3, 1e-4),
            "\"auto\" takes the recipe"
        );
        let (lr, wd, _, _) = optimizer(&["--model-dir", "m", "--config", g]);
        assert_eq!((lr, wd), (2e-4, 0.05), "the file's values win");
        let (lr, wd, _, _) = optimizer(&[
            "--model-dir",
            "m",
            "--config",
            g,
            "--lr",
            "7e-5",
            "--weight-decay",
            "0.2",
        ]);
        assert_eq!((lr, wd), (7e-5, 0.2), "flags win over the file");
        let _ = std::fs::remove_file(auto);
        let _ = std::fs::remove_file(given);
    }
}
