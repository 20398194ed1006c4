//! The smallest complete use of the engine: a two-hidden-layer MLP learns a
//! synthetic function under any ZeRO stage.
//!
//! ```text
//! cargo run --example mlp_regression -- --stage 3 --ranks 2
//! mpirun -n 2 cargo run --example mlp_regression -- --stage 2
//! cargo run --example mlp_regression -- --config tests/fixtures/ds_stage1.json
//! cargo run --example mlp_regression -- --stage 3 --offload cpu
//! cargo run --example mlp_regression -- --stage 2 --offload nvme --nvme-path /local_nvme
//! cargo run --example mlp_regression -- --stage 3 --offload cpu --offload-param nvme
//! ```
//!
//! Flags: `--stage 0..3` (default 2), `--ranks N` threads when not under
//! mpirun (default 2), `--steps N` (default 40), `--dtype fp32|bf16|fp16`
//! (default bf16), `--ga N` gradient accumulation (default 1), `--micro N`
//! samples per rank per micro-batch (default 16), `--lr X` (default 3e-3),
//! `--config FILE` a DeepSpeed JSON config (its `"auto"` values are filled
//! from the flags above), `--offload none|cpu|nvme` where the fp32 master
//! and AdamW moments live (`zero_optimization.offload_optimizer.device`),
//! `--offload-param none|cpu|nvme` where the bf16 parameter shards live
//! (`zero_optimization.offload_param.device`, stage 3 only), `--nvme-path
//! DIR` for nvme
//! (default a directory under the system temp dir). The offload flags
//! override a `--config` file's blocks only when given. Every rank trains on its own samples; rank 0
//! prints the loss (averaged over ranks) per step, a held-out loss at the
//! end, and every rank prints its memory report.
//!
//! The model, [`Mlp`] (one unit per layer: registered with the builder,
//! gathered for forward and backward, its gradient handed back with
//! `grad_ready`), is the engine tests' model, in `zero-testkit/src/mlp.rs`.

use std::path::PathBuf;
use std::process::exit;

use zero::comm::{launch, CommOptions, Communicator, ReduceOp};
use zero::core::config::{AutoValues, DeepSpeedConfig, OffloadDevice, Precision, ResolvedConfig};
use zero::core::optim::LrSchedule;
use zero::core::{bf16, f16, Element, HostBuffer};
use zero::Engine;
use zero_testkit::mlp::{batch, Mlp};

struct Args {
    stage: u8,
    ranks: usize,
    steps: usize,
    dtype: String,
    ga: usize,
    micro: usize,
    lr: f64,
    config: Option<String>,
    offload: Option<OffloadDevice>,
    offload_param: Option<OffloadDevice>,
    nvme_path: Option<PathBuf>,
}

fn device(flag: &str, v: &str) -> Result<OffloadDevice, String> {
    match v {
        "none" => Ok(OffloadDevice::None),
        "cpu" => Ok(OffloadDevice::Cpu),
        "nvme" => Ok(OffloadDevice::Nvme),
        _ => Err(format!("{flag}: `{v}` is not none, cpu or nvme")),
    }
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        stage: 2,
        ranks: 2,
        steps: 40,
        dtype: "bf16".into(),
        ga: 1,
        micro: 16,
        lr: 3e-3,
        config: None,
        offload: None,
        offload_param: None,
        nvme_path: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let bad = |v: &str| format!("{flag}: invalid value `{v}`");
        match flag.as_str() {
            "--stage" => {
                let v = value()?;
                a.stage = v.parse().ok().filter(|s| *s <= 3).ok_or(bad(&v))?;
            }
            "--ranks" => {
                let v = value()?;
                a.ranks = v.parse().ok().filter(|n| *n > 0).ok_or(bad(&v))?;
            }
            "--steps" => {
                let v = value()?;
                a.steps = v.parse().map_err(|_| bad(&v))?;
            }
            "--ga" => {
                let v = value()?;
                a.ga = v.parse().ok().filter(|n| *n > 0).ok_or(bad(&v))?;
            }
            "--micro" => {
                let v = value()?;
                a.micro = v.parse().ok().filter(|n| *n > 0).ok_or(bad(&v))?;
            }
            "--lr" => {
                let v = value()?;
                a.lr = v.parse().ok().filter(|x: &f64| *x >= 0.0).ok_or(bad(&v))?;
            }
            "--dtype" => {
                let v = value()?;
                if !["fp32", "bf16", "fp16"].contains(&v.as_str()) {
                    return Err(format!("--dtype: `{v}` is not fp32, bf16 or fp16"));
                }
                a.dtype = v;
            }
            "--config" => a.config = Some(value()?),
            "--offload" => a.offload = Some(device(&flag, &value()?)?),
            "--offload-param" => a.offload_param = Some(device(&flag, &value()?)?),
            "--nvme-path" => a.nvme_path = Some(PathBuf::from(value()?)),
            _ => return Err(format!("unknown flag `{flag}`")),
        }
    }
    Ok(a)
}

/// The config with the offload flags applied (those given).
fn config(a: &Args, world: usize) -> Result<ResolvedConfig, String> {
    let mut c = base_config(a, world)?;
    let nvme_path = || {
        a.nvme_path.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("zero-mlp-nvme-{}", std::process::id()))
        })
    };
    if let Some(d) = a.offload {
        let o = &mut c.zero.offload_optimizer;
        o.device = d;
        if d == OffloadDevice::Nvme && (o.nvme_path.is_none() || a.nvme_path.is_some()) {
            o.nvme_path = Some(nvme_path());
        }
    }
    if let Some(d) = a.offload_param {
        let o = &mut c.zero.offload_param;
        o.device = d;
        if d == OffloadDevice::Nvme && (o.nvme_path.is_none() || a.nvme_path.is_some()) {
            o.nvme_path = Some(nvme_path());
        }
    }
    Ok(c)
}

/// The config: from `--config` (with "auto" filled from the flags) or the
/// defaults with the flags applied.
fn base_config(a: &Args, world: usize) -> Result<ResolvedConfig, String> {
    let fp16 = a.dtype == "fp16";
    let bf16 = a.dtype == "bf16";
    if let Some(path) = &a.config {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        // Its warnings travel in the config: the engine prints each once.
        let (ds, _) = DeepSpeedConfig::from_json_str(&text).map_err(|e| format!("{path}: {e}"))?;
        let auto = AutoValues {
            world_size: world,
            micro_batch_size: Some(a.micro),
            gradient_accumulation_steps: Some(a.ga),
            gradient_clipping: Some(1.0),
            fp16: Some(fp16),
            bf16: Some(bf16),
            lr: Some(a.lr),
            betas: Some((0.9, 0.999)),
            eps: Some(1e-8),
            weight_decay: Some(0.0),
            warmup_min_lr: Some(0.0),
            warmup_max_lr: Some(a.lr),
            warmup_num_steps: Some(5),
            total_num_steps: Some(a.steps as u64),
            hidden_size: Some(64),
            ..AutoValues::default()
        };
        return ds.resolve(&auto).map_err(|e| format!("{path}: {e}"));
    }
    let mut c = ResolvedConfig::simple(a.stage, world, a.micro);
    c.gradient_accumulation_steps = a.ga;
    c.train_batch_size = a.micro * a.ga * world;
    c.precision = match a.dtype.as_str() {
        "fp32" => Precision::Fp32,
        "fp16" => Precision::Fp16,
        _ => Precision::Bf16,
    };
    if fp16 {
        c.loss_scale = Some(zero::core::optim::LossScaleConfig::Dynamic {
            initial_scale_power: 16,
            window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        });
    }
    c.optimizer.lr = a.lr;
    c.optimizer.weight_decay = 0.0;
    c.scheduler = LrSchedule::Constant { lr: a.lr };
    c.gradient_clipping = 1.0;
    Ok(c)
}

fn run<T: Element, C: Communicator>(comm: C, a: &Args, cfg: ResolvedConfig) -> zero::Result<()> {
    let rank = comm.rank();
    let world = comm.world_size();
    let ga = cfg.gradient_accumulation_steps;
    let micro = cfg.micro_batch_size;
    if rank == 0 {
        println!(
            "mlp_regression: stage {}, {world} ranks ({}), {}, micro-batch {micro}, accumulation {ga}, \
             optimizer offload {:?}, param offload {:?}",
            cfg.zero.stage,
            comm.backend(),
            T::DTYPE,
            cfg.zero.offload_optimizer.device,
            cfg.zero.offload_param.device
        );
    }
    let mut b = Engine::builder(cfg, comm).seed(1);
    let model = Mlp::register(&mut b, &[4, 64, 64, 1])?;
    let mut e = b.build()?;
    if rank == 0 {
        println!("parameters: {}", e.plan().numel());
    }
    for step in 0..a.steps {
        let mut loss = 0f32;
        for m in 0..ga {
            let first = (((step * ga + m) * world + rank) * micro) as u64;
            let (x, y) = batch(first, micro, 4);
            loss += model.train_micro_batch::<T, C, _>(&mut e, &x, &y)? / ga as f32;
            e.step()?;
        }
        // The loss averaged over ranks, for the log (a collective).
        let l = e
            .comm()
            .all_reduce(HostBuffer::from_slice(&[loss])?, ReduceOp::Avg)
            .wait()?[0];
        let o = e.last_step();
        if rank == 0 && (step % 5 == 0 || step + 1 == a.steps) {
            println!(
                "step {:>4}  loss {l:.5}  grad norm {:.4}  lr {:.2e}{}",
                step + 1,
                o.grad_norm.unwrap_or(f64::NAN),
                o.lr,
                if o.skipped {
                    "  (skipped: overflow)"
                } else {
                    ""
                }
            );
        }
    }
    // Held out: samples no rank trained on.
    let (x, y) = batch(u64::MAX / 2, 256, 4);
    let pred = model.predict::<T, C, _>(&mut e, &x)?;
    let mse = pred
        .iter()
        .zip(&y)
        .map(|(p, t)| (p - t) * (p - t))
        .sum::<f32>()
        / y.len() as f32;
    if rank == 0 {
        println!(
            "held-out mse {mse:.5} (predicting 0 gives {:.5})",
            y.iter().map(|t| t * t).sum::<f32>() / y.len() as f32
        );
    }
    // One rank at a time, so the reports do not interleave.
    for r in 0..world {
        if r == rank {
            println!("{}", e.memory_report());
        }
        e.comm().barrier().wait()?;
    }
    Ok(())
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            exit(2);
        }
    };
    let out = launch(
        a.ranks,
        &CommOptions::from_env().unwrap_or_default(),
        |comm| {
            let cfg = config(&a, comm.world_size())?;
            match cfg.precision {
                Precision::Fp32 => run::<f32, _>(comm, &a, cfg),
                Precision::Bf16 => run::<bf16, _>(comm, &a, cfg),
                Precision::Fp16 => run::<f16, _>(comm, &a, cfg),
            }
            .map_err(|e| e.to_string())
        },
    );
    match out {
        Ok(results) => {
            for r in results {
                if let Err(e) = r {
                    eprintln!("error: {e}");
                    exit(1);
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit(1);
        }
    }
}
