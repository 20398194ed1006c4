//! `zero`: command-line tools of the `zero` crate.
//!
//! `zero estimate` prints the per-rank memory of a training configuration
//! (device, host and NVMe, split by the memory tracker's categories)
//! before anything is allocated; see [`zero::estimate`] and `zero estimate
//! --help`.
//!
//! `zero doctor` prints what a bug report needs about the build and the
//! machine (libraries, driver, GPUs, CPU, memory limits); see
//! [`zero::doctor`].

use std::path::PathBuf;
use std::process::ExitCode;

use zero::core::config::{AutoValues, DeepSpeedConfig, OffloadDevice, Precision, ResolvedConfig};
use zero::core::DType;
use zero::estimate::{
    estimate, estimate_device, estimate_table, estimate_table_device, format_bytes, LlamaDims,
    Lora, Model, Workload, LORA_TARGETS,
};

const USAGE: &str = "usage: zero estimate [OPTIONS]

Prints per rank the peak bytes on the device, in host memory and on NVMe of
training a model with ZeRO, split into params, grads, fp32 master, AdamW
moments, gathered stage-3 parameters, communication/transfer buffers and
activations, with the engine's own accounting. Without --stage: one row per
setup (stages 0, 1, 2, 3, 3 + optimizer offload to cpu, 3 + optimizer and
parameter offload to cpu, 3 + both on nvme).

Model (one of):
  --params N            N parameters (7e9, 7B, 350M) in --units equal units
  --units U             units for --params (default 32); no activations
  --hidden H --layers L --heads A --vocab V [--intermediate I] [--kv-heads K]
                        a Llama model as examples/llama (intermediate default:
                        8H/3 rounded up to 256; kv heads default: A)
  --lora-rank R         LoRA of rank R on the Llama dims: base weights frozen
                        (parameters only), adapters A (R x in) and B (out x R)
                        trainable
  --lora-targets LIST   PEFT module names, comma-separated (default: all of
                        q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)
  --lora-dropout        the adapters train with dropout: their masks are kept
                        from forward to backward (f32 per element; --device: 1 bit)

Training:
  --world N             data-parallel ranks (default 1)
  --stage S             ZeRO stage 0..=3 (default: the table of all setups)
  --offload D           offload_optimizer device: none, cpu or nvme (with --stage)
  --offload-param D     offload_param device: none, cpu or nvme (--stage 3)
  --swap-gradients      offload_optimizer.swap_gradients (--offload nvme): the
                        gradient shard goes to a swap file, the step streams
  --dtype T             bf16, fp16 or fp32 parameters and gradients (default bf16)
  --grad-accum-dtype T  data_types.grad_accum_dtype (default fp32, the engine's)
  --grad-accum N        gradient_accumulation_steps (default 1)
  --micro N             sequences per rank per micro-batch (default 1)
  --seq-len N           tokens per sequence (default 2048; Llama dims only)
  --activation-checkpointing
                        keep block inputs only, recompute in backward
  --device              the engine on a device backend (a GPU): adds the pinned
                        host buffers its transfers go through (offload staging,
                        parameter-step slots, the stage-3 shard uploads, the
                        device trainer's two slots for LoRA's dropout masks)
  --reduce-bucket-size N  zero_optimization.reduce_bucket_size (default 5e8)
  --config FILE         a DeepSpeed JSON config; the flags above override it
  -h, --help            this text";

const DOCTOR_USAGE: &str = "usage: zero doctor

Prints what a bug report needs: zero's version and features, OS and kernel,
CPU and the CPU AdamW's SIMD paths, memory (locked-memory limit, huge
pages), the NVIDIA driver and GPUs, the CUDA driver API, NVRTC, cuBLAS and
NCCL (version and path, or why they cannot be used), MPI, and the
environment variables that decide where libraries come from. Exits 0 also
when something is missing: the report says what.";

/// `zero doctor`: prints the report.
fn doctor(mut args: impl Iterator<Item = String>) -> ExitCode {
    match args.next().as_deref() {
        None => {
            print!("{}", zero::doctor::report());
            ExitCode::SUCCESS
        }
        Some("-h" | "--help") => {
            println!("{DOCTOR_USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("zero doctor: unexpected argument `{other}`\n\n{DOCTOR_USAGE}");
            ExitCode::from(2)
        }
    }
}

/// Parsed `zero estimate` options.
#[derive(Debug, Default)]
struct Opts {
    params: Option<usize>,
    units: Option<usize>,
    hidden: Option<usize>,
    intermediate: Option<usize>,
    layers: Option<usize>,
    heads: Option<usize>,
    kv_heads: Option<usize>,
    vocab: Option<usize>,
    world: Option<usize>,
    stage: Option<u8>,
    offload: Option<OffloadDevice>,
    offload_param: Option<OffloadDevice>,
    dtype: Option<Precision>,
    grad_accum_dtype: Option<DType>,
    grad_accum: Option<usize>,
    micro: Option<usize>,
    seq_len: Option<usize>,
    checkpointing: bool,
    swap_gradients: bool,
    reduce_bucket_size: Option<usize>,
    config: Option<PathBuf>,
    lora_rank: Option<usize>,
    lora_targets: Option<Vec<String>>,
    lora_dropout: bool,
    device: bool,
}

/// A count such as `7e9`, `7B`, `350M`, `1.5k` or `4096`.
fn count(flag: &str, v: &str) -> Result<usize, String> {
    let bad = || format!("{flag}: expected a positive count (e.g. 4096, 7e9, 7B), got `{v}`");
    let (num, mul) = match v.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() && !v.ends_with(['e', 'E']) => {
            let mul = match c.to_ascii_lowercase() {
                'k' => 1e3,
                'm' => 1e6,
                'b' | 'g' => 1e9,
                't' => 1e12,
                _ => return Err(bad()),
            };
            (&v[..i], mul)
        }
        _ => (v, 1.0),
    };
    let x: f64 = num.trim().parse().map_err(|_| bad())?;
    let n = x * mul;
    if !(n.is_finite() && n >= 1.0 && n.fract() == 0.0 && n < 2f64.powi(63)) {
        return Err(bad());
    }
    Ok(n as usize)
}

fn device(flag: &str, v: &str) -> Result<OffloadDevice, String> {
    match v {
        "none" => Ok(OffloadDevice::None),
        "cpu" => Ok(OffloadDevice::Cpu),
        "nvme" => Ok(OffloadDevice::Nvme),
        _ => Err(format!("{flag}: expected none, cpu or nvme, got `{v}`")),
    }
}

fn precision(flag: &str, v: &str) -> Result<Precision, String> {
    match v {
        "bf16" => Ok(Precision::Bf16),
        "fp16" | "f16" => Ok(Precision::Fp16),
        "fp32" | "f32" => Ok(Precision::Fp32),
        _ => Err(format!("{flag}: expected bf16, fp16 or fp32, got `{v}`")),
    }
}

/// `Ok(None)`: help was asked for.
fn parse(args: impl IntoIterator<Item = String>) -> Result<Option<Opts>, String> {
    let mut o = Opts::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(None);
        }
        if arg == "--activation-checkpointing" {
            o.checkpointing = true;
            continue;
        }
        if arg == "--swap-gradients" {
            o.swap_gradients = true;
            continue;
        }
        if arg == "--lora-dropout" {
            o.lora_dropout = true;
            continue;
        }
        if arg == "--device" {
            o.device = true;
            continue;
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if !flag.starts_with("--") {
            return Err(format!("unexpected argument `{arg}`"));
        }
        let known = [
            "--params",
            "--units",
            "--hidden",
            "--intermediate",
            "--layers",
            "--heads",
            "--kv-heads",
            "--vocab",
            "--world",
            "--stage",
            "--offload",
            "--offload-param",
            "--dtype",
            "--grad-accum-dtype",
            "--grad-accum",
            "--micro",
            "--seq-len",
            "--reduce-bucket-size",
            "--config",
            "--lora-rank",
            "--lora-targets",
        ];
        if !known.contains(&flag.as_str()) {
            return Err(format!("unknown option `{flag}`"));
        }
        let v = match inline.or_else(|| args.next()) {
            Some(v) => v,
            None => return Err(format!("{flag}: needs a value")),
        };
        let f = flag.as_str();
        match f {
            "--params" => o.params = Some(count(f, &v)?),
            "--lora-rank" => o.lora_rank = Some(count(f, &v)?),
            "--lora-targets" => {
                o.lora_targets = Some(v.split(',').map(|t| t.trim().to_string()).collect())
            }
            "--units" => o.units = Some(count(f, &v)?),
            "--hidden" => o.hidden = Some(count(f, &v)?),
            "--intermediate" => o.intermediate = Some(count(f, &v)?),
            "--layers" => o.layers = Some(count(f, &v)?),
            "--heads" => o.heads = Some(count(f, &v)?),
            "--kv-heads" => o.kv_heads = Some(count(f, &v)?),
            "--vocab" => o.vocab = Some(count(f, &v)?),
            "--world" => o.world = Some(count(f, &v)?),
            "--stage" => {
                o.stage = Some(match v.as_str() {
                    "0" => 0,
                    "1" => 1,
                    "2" => 2,
                    "3" => 3,
                    _ => return Err(format!("--stage: expected 0, 1, 2 or 3, got `{v}`")),
                })
            }
            "--offload" => o.offload = Some(device(f, &v)?),
            "--offload-param" => o.offload_param = Some(device(f, &v)?),
            "--dtype" => o.dtype = Some(precision(f, &v)?),
            "--grad-accum-dtype" => o.grad_accum_dtype = Some(precision(f, &v)?.param_dtype()),
            "--grad-accum" => o.grad_accum = Some(count(f, &v)?),
            "--micro" => o.micro = Some(count(f, &v)?),
            "--seq-len" => o.seq_len = Some(count(f, &v)?),
            "--reduce-bucket-size" => o.reduce_bucket_size = Some(count(f, &v)?),
            _ => o.config = Some(PathBuf::from(v)),
        }
    }
    Ok(Some(o))
}

/// The model of the options; the error names the flag.
fn model(o: &Opts) -> Result<Model, String> {
    let dims = [o.hidden, o.layers, o.heads, o.vocab];
    let any_dim =
        dims.iter().any(Option::is_some) || o.intermediate.is_some() || o.kv_heads.is_some();
    match (o.params, any_dim) {
        (Some(_), true) => Err(
            "--params: give either --params or the Llama dims (--hidden, --layers, --heads, \
             --vocab), not both"
                .into(),
        ),
        (Some(_), false) if o.lora_rank.is_some() => {
            Err("--lora-rank: needs the Llama dims (--hidden, --layers, --heads, --vocab)".into())
        }
        (Some(p), false) => {
            Model::from_param_count(p, o.units.unwrap_or(32)).map_err(|e| format!("--units: {e}"))
        }
        (None, true) => {
            let names = ["--hidden", "--layers", "--heads", "--vocab"];
            if let Some(i) = dims.iter().position(Option::is_none) {
                return Err(format!("{}: required with Llama dims", names[i]));
            }
            if o.units.is_some() {
                return Err("--units: only with --params".into());
            }
            let hidden = o.hidden.unwrap_or_default();
            let heads = o.heads.unwrap_or_default();
            let d = LlamaDims {
                vocab: o.vocab.unwrap_or_default(),
                hidden,
                intermediate: o
                    .intermediate
                    .unwrap_or_else(|| LlamaDims::default_intermediate(hidden)),
                layers: o.layers.unwrap_or_default(),
                heads,
                kv_heads: o.kv_heads.unwrap_or(heads),
            };
            let built = match (o.lora_rank, &o.lora_targets) {
                (None, Some(_)) => return Err("--lora-targets: needs --lora-rank".into()),
                (None, None) if o.lora_dropout => {
                    return Err("--lora-dropout: needs --lora-rank".into())
                }
                (None, None) => Model::llama(d),
                (Some(rank), targets) => {
                    let lora = Lora {
                        rank,
                        targets: targets.clone().unwrap_or_else(|| {
                            LORA_TARGETS.iter().map(|t| t.to_string()).collect()
                        }),
                    };
                    if let Err(e) = lora.validate() {
                        let flag = if e.to_string().contains("lora.rank") {
                            "--lora-rank"
                        } else {
                            "--lora-targets"
                        };
                        return Err(format!("{flag}: {e}"));
                    }
                    Model::llama_lora(d, &lora).map(|m| m.lora_dropout(o.lora_dropout))
                }
            };
            built.map_err(|e| {
                let text = e.to_string();
                let flag = [
                    "kv_heads",
                    "heads",
                    "hidden",
                    "intermediate",
                    "layers",
                    "vocab",
                ]
                .into_iter()
                .find(|k| text.contains(&format!("model.{k}")))
                .map_or("--hidden".to_string(), |k| {
                    format!("--{}", k.replace('_', "-"))
                });
                format!("{flag}: {text}")
            })
        }
        (None, false) => Err("--params: give a model: --params N, or Llama dims".into()),
    }
}

/// The resolved config of the options (stage and offload are set per row
/// when there is no --stage).
fn config(o: &Opts, model: &Model) -> Result<ResolvedConfig, String> {
    let world = o.world.unwrap_or(1);
    let micro = o.micro.unwrap_or(1);
    let ga = o.grad_accum.unwrap_or(1);
    let dtype = o.dtype.unwrap_or(Precision::Bf16);
    let mut c = match &o.config {
        Some(path) => {
            let p = path.display();
            let text = std::fs::read_to_string(path).map_err(|e| format!("--config {p}: {e}"))?;
            let (ds, warnings) =
                DeepSpeedConfig::from_json_str(&text).map_err(|e| format!("--config {p}: {e}"))?;
            for w in warnings {
                eprintln!("zero estimate: --config {p}: warning: {w}");
            }
            let auto = AutoValues {
                world_size: world,
                micro_batch_size: Some(micro),
                gradient_accumulation_steps: Some(ga),
                gradient_clipping: Some(1.0),
                fp16: Some(dtype == Precision::Fp16),
                bf16: Some(dtype == Precision::Bf16),
                lr: Some(1e-3),
                betas: Some((0.9, 0.999)),
                eps: Some(1e-8),
                weight_decay: Some(0.0),
                warmup_min_lr: Some(0.0),
                warmup_max_lr: Some(1e-3),
                warmup_num_steps: Some(1),
                total_num_steps: Some(1),
                hidden_size: model.llama_dims().map(|d| d.hidden),
                ..AutoValues::default()
            };
            ds.resolve(&auto)
                .map_err(|e| format!("--config {p}: {e}"))?
        }
        None => {
            let mut c = ResolvedConfig::simple(o.stage.unwrap_or(0), world, micro);
            c.precision = dtype;
            c
        }
    };
    if o.config.is_none() || o.world.is_some() {
        c.world_size = world;
    }
    if let Some(m) = o.micro {
        c.micro_batch_size = m;
    }
    if let Some(g) = o.grad_accum {
        c.gradient_accumulation_steps = g;
    }
    if let Some(d) = o.dtype {
        c.precision = d;
    }
    if let Some(s) = o.stage {
        c.zero.stage = s;
        c.zero.overlap_comm = c.zero.overlap_comm || s == 3;
    }
    if let Some(d) = o.grad_accum_dtype {
        c.grad_accum_dtype = d;
    }
    if let Some(b) = o.reduce_bucket_size {
        c.zero.reduce_bucket_size = b;
    }
    if let Some(d) = o.offload {
        c.zero.offload_optimizer.device = d;
    }
    if let Some(d) = o.offload_param {
        c.zero.offload_param.device = d;
    }
    if o.swap_gradients {
        if c.zero.offload_optimizer.device != OffloadDevice::Nvme {
            return Err(
                "--swap-gradients: needs the optimizer state on nvme (--offload nvme, or the \
                 --config file's offload_optimizer.device)"
                    .into(),
            );
        }
        c.zero.offload_optimizer.swap_gradients = true;
    }
    c.train_batch_size = c.micro_batch_size * c.gradient_accumulation_steps * c.world_size;
    Ok(c)
}

fn run(o: &Opts) -> Result<String, String> {
    if o.stage.is_none() {
        if o.offload.is_some() {
            return Err("--offload: needs --stage (without it every setup is shown)".into());
        }
        if o.offload_param.is_some() {
            return Err("--offload-param: needs --stage 3".into());
        }
    }
    let m = model(o)?;
    let c = config(o, &m)?;
    let work = Workload {
        seq_len: if m.llama_dims().is_some() {
            o.seq_len.unwrap_or(2048)
        } else {
            0
        },
        activation_checkpointing: o.checkpointing,
    };
    if m.llama_dims().is_none() && (o.seq_len.is_some() || o.checkpointing) {
        eprintln!(
            "zero estimate: warning: activations are estimated for Llama dims only; \
             --seq-len and --activation-checkpointing are ignored with --params"
        );
    }
    let mut out = String::new();
    let mut what = match m.llama_dims() {
        Some(d) => format!(
            "Llama: vocab {}, hidden {}, intermediate {}, {} layers, {} heads, {} kv heads; \
             micro-batch {} x {} tokens{}",
            d.vocab,
            d.hidden,
            d.intermediate,
            d.layers,
            d.heads,
            d.kv_heads,
            c.micro_batch_size,
            work.seq_len,
            if work.activation_checkpointing {
                ", activation checkpointing"
            } else {
                ""
            }
        ),
        None => format!("{} units; activations not estimated", m.units().len()),
    };
    let dt = |d: DType| match d {
        DType::F32 => "fp32",
        DType::BF16 => "bf16",
        DType::F16 => "fp16",
    };
    let frozen = m.numel() - m.trainable_numel();
    if frozen > 0 {
        what.push_str(&format!(
            "; {} trainable (LoRA), {} frozen: parameters only",
            m.trainable_numel(),
            frozen
        ));
    }
    out.push_str(&format!(
        "zero estimate: {:.3e} parameters ({what})\n{} rank(s), {} parameters and gradients, \
         {} gradient accumulation, {} reductions, reduce_bucket_size {}, \
         gradient_accumulation_steps {}\n",
        m.numel() as f64,
        c.world_size,
        dt(c.precision.param_dtype()),
        dt(c.grad_accum_dtype),
        dt(c.communication_data_type),
        c.zero.reduce_bucket_size,
        c.gradient_accumulation_steps,
    ));
    out.push_str(
        "Per rank. peak: the most the tier holds at once; states: model states \
         (params, grads, master, moments) once built, ZeRO's figure; the other columns: \
         each category's own peak.\n\n",
    );
    if o.stage.is_some() {
        let run = if o.device { estimate_device } else { estimate };
        let e = run(&m, &c, &work).map_err(|e| {
            let text = e.to_string();
            let flag = if text.contains("offload_param") {
                "--offload-param"
            } else if text.contains("offload_optimizer") {
                "--offload"
            } else {
                "--stage"
            };
            format!("{flag}: {text}")
        })?;
        out.push_str(&e.to_string());
    } else {
        let t = if o.device {
            estimate_table_device(&m, &c, &work)
        } else {
            estimate_table(&m, &c, &work)
        };
        out.push_str(&t.to_string());
        if let Some(best) = t
            .rows
            .iter()
            .filter_map(|(s, r)| r.as_ref().ok().map(|e| (s, e)))
            .min_by_key(|(_, e)| e.tier_peak(zero::core::memory::Tier::Device))
        {
            out.push_str(&format!(
                "\n\nleast device memory: {} ({} per rank)",
                best.0.label(),
                format_bytes(best.1.tier_peak(zero::core::memory::Tier::Device))
            ));
        }
    }
    Ok(out)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("estimate") => {}
        Some("doctor") => return doctor(args),
        Some("-h" | "--help") | None => {
            println!("{USAGE}\n\n{DOCTOR_USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!(
                "zero: unknown command `{other}` (commands: estimate, doctor)\n\n{USAGE}\n\n\
                 {DOCTOR_USAGE}"
            );
            return ExitCode::from(2);
        }
    }
    let opts = match parse(args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("zero estimate: error: {e}\n(see `zero estimate --help`)");
            return ExitCode::from(2);
        }
    };
    match run(&opts) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("zero estimate: error: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn counts() {
        assert_eq!(count("--params", "7e9"), Ok(7_000_000_000));
        assert_eq!(count("--params", "7B"), Ok(7_000_000_000));
        assert_eq!(count("--params", "1.5k"), Ok(1500));
        assert_eq!(count("--world", "8"), Ok(8));
        assert!(count("--world", "0").unwrap_err().starts_with("--world"));
        assert!(count("--world", "x").unwrap_err().starts_with("--world"));
        assert!(count("--params", "7q").is_err());
    }

    #[test]
    fn errors_name_the_flag() {
        let err = |s: &str| match parse(args(s)) {
            Ok(Some(o)) => run(&o).unwrap_err(),
            Ok(None) => panic!("help"),
            Err(e) => e,
        };
        assert!(err("--params 7e9 --offload cpu").starts_with("--offload:"));
        assert!(err("--params 7e9 --stage 4").starts_with("--stage:"));
        assert!(err("--params 7e9 --dtype fp8").starts_with("--dtype:"));
        assert!(err("--hidden 4096 --layers 2 --heads 32").starts_with("--vocab:"));
        assert!(
            err("--hidden 4096 --layers 2 --heads 32 --vocab 10 --kv-heads 5")
                .starts_with("--kv-heads:")
        );
        assert!(err("--params").starts_with("--params:"));
        assert!(err("--bogus 1").contains("--bogus"));
        assert!(err("--params 7e9 --stage 2 --offload-param cpu").contains("offload_param.device"));
        assert!(err("--params 7e9 --stage 3 --offload cpu --swap-gradients")
            .starts_with("--swap-gradients:"));
    }

    /// `--swap-gradients` moves the gradient shard from the host to the
    /// nvme tier of the 3+nvme setup.
    #[test]
    fn swap_gradients_moves_the_gradient_shard_to_nvme() {
        let tier = |flags: &str, tier: zero::core::memory::Tier| {
            let o = parse(args(&format!(
                "--params 1e9 --stage 3 --offload nvme --offload-param nvme {flags}"
            )))
            .unwrap()
            .unwrap();
            let m = model(&o).unwrap();
            let c = config(&o, &m).unwrap();
            let e = estimate(&m, &c, &Workload::default()).unwrap();
            e.peak(tier, zero::core::memory::Category::Grads)
        };
        use zero::core::memory::Tier::{Host, Nvme};
        // fp32: 4 bytes per parameter of the (one rank's) shard.
        assert!(tier("", Host) >= 4_000_000_000, "{}", tier("", Host));
        assert_eq!(tier("", Nvme), 0);
        assert!(tier("--swap-gradients", Host) < 200_000_000);
        assert!(tier("--swap-gradients", Nvme) >= 4_000_000_000);
    }

    #[test]
    fn table_and_single_rows() {
        let o = parse(args("--params 7e9 --world 8")).unwrap().unwrap();
        let text = run(&o).unwrap();
        for label in ["3+opt cpu", "3+opt+param cpu", "3+nvme", "nvme", "host"] {
            assert!(text.contains(label), "{label}: {text}");
        }
        let o = parse(args(
            "--stage 3 --world 8 --hidden 4096 --layers 32 --heads 32 --vocab 32000 \
             --micro 1 --seq-len 4096 --activation-checkpointing",
        ))
        .unwrap()
        .unwrap();
        let text = run(&o).unwrap();
        assert!(text.contains("GiB"), "{text}");
    }
}
