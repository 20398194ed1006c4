//! The memory estimator (`zero::estimate`):
//!
//! - it answers the rules of thumb: ~2n GB of fp16 weights for an n-B
//!   model; ZeRO's model states 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N with bf16
//!   parameters and gradients accumulated in bf16 (7B: 112 GB at stage 0,
//!   14 GB per rank at stage 3 on 8 ranks), and the engine's default fp32
//!   gradient accumulation on top of them;
//! - it matches the tracker: for the llama_sft presets `tiny` and `task`
//!   (the example's config: bf16, default buckets, micro-batch 16, the
//!   task's longest sample) on 2 thread ranks, every stage × offload row of
//!   the table is trained for two optimizer steps and each tier's peak, and
//!   each category's, must be within 10% of the estimate (they agree to the
//!   byte today; the test prints every deviation). A variant with small
//!   buckets, stage-3 prefetch, reuse eviction, gradient accumulation,
//!   fp32 and no nvme host cache covers the other code paths.

use std::path::PathBuf;

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::bf16;
use zero::core::config::{OffloadDevice, Precision, ResolvedConfig};
use zero::core::memory::{Category, MemoryReport, Tier};
use zero::core::DType;
use zero::estimate::{estimate, estimate_table, LlamaDims, Model, Setup, Workload};
use zero::{Engine, Tracer};
use zero_llama as llama;

use llama::data;
use llama::train::SftModel;
use llama::Config;

const GB: f64 = 1e9;

/// `a` is within `tol` (relative) of `b`.
fn close(a: f64, b: f64, tol: f64, what: &str) {
    let dev = a / b - 1.0;
    assert!(
        dev.abs() <= tol,
        "{what}: {a:.4e} vs {b:.4e} ({:+.3}%)",
        100.0 * dev
    );
}

/// 7e9 parameters in 32 equal units.
fn seven_b() -> Model {
    Model::from_param_count(7_000_000_000, 32).unwrap()
}

/// The classic ZeRO setting: bf16 parameters and gradients, gradients
/// accumulated in bf16 (no separate fp32 accumulation buffer).
fn classic(stage: u8, world: usize) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(stage, world, 1);
    c.precision = Precision::Bf16;
    c.grad_accum_dtype = DType::BF16;
    c
}

fn states(model: &Model, cfg: &ResolvedConfig) -> f64 {
    estimate(model, cfg, &Workload::default())
        .unwrap()
        .model_states(Tier::Device) as f64
}

// ---------------------------------------------------------------------------
// Rules of thumb

#[test]
fn fp16_weights_of_an_n_b_model_take_2n_gb() {
    for (model, n) in [
        (seven_b(), 7e9),
        (
            Model::llama(LlamaDims::LLAMA2_7B).unwrap(),
            LlamaDims::LLAMA2_7B.numel() as f64,
        ),
    ] {
        let mut c = ResolvedConfig::simple(0, 1, 1);
        c.precision = Precision::Fp16;
        let e = estimate(&model, &c, &Workload::default()).unwrap();
        close(
            e.peak(Tier::Device, Category::Params) as f64,
            2.0 * n,
            0.01,
            "fp16 weights",
        );
    }
    let mut c = ResolvedConfig::simple(0, 1, 1);
    c.precision = Precision::Fp16;
    let e = estimate(&seven_b(), &c, &Workload::default()).unwrap();
    close(
        e.peak(Tier::Device, Category::Params) as f64 / GB,
        14.0,
        0.01,
        "7B in fp16 is 14 GB",
    );
}

#[test]
fn mixed_precision_adamw_model_states_are_16_psi() {
    let m = seven_b();
    close(states(&m, &classic(0, 1)) / GB, 112.0, 0.01, "7B stage 0");
    close(
        states(&m, &classic(0, 8)) / GB,
        112.0,
        0.01,
        "7B stage 0, 8 ranks",
    );
    close(
        states(&m, &classic(3, 8)) / GB,
        14.0,
        0.01,
        "7B stage 3, 8 ranks",
    );
    // The real 7B shape (6.74e9 parameters), too.
    let llama = Model::llama(LlamaDims::LLAMA2_7B).unwrap();
    let psi = llama.numel() as f64;
    close(
        states(&llama, &classic(0, 1)),
        16.0 * psi,
        0.01,
        "Llama-2 7B stage 0",
    );
    close(
        states(&llama, &classic(3, 8)),
        2.0 * psi,
        0.01,
        "Llama-2 7B stage 3",
    );
}

#[test]
fn zero_formulas_per_stage() {
    let m = seven_b();
    let psi = 7e9;
    for n in [2usize, 8, 64] {
        let nf = n as f64;
        let want = [
            16.0 * psi,
            4.0 * psi + 12.0 * psi / nf,
            2.0 * psi + 14.0 * psi / nf,
            16.0 * psi / nf,
        ];
        for (stage, w) in want.into_iter().enumerate() {
            close(
                states(&m, &classic(stage as u8, n)),
                w,
                0.01,
                &format!("stage {stage}, {n} ranks"),
            );
        }
        // The engine's default accumulates gradients in fp32: a separate
        // A buffer (full at stage 0, a shard at 1–3) and fp32 gradient
        // shards at stages 2/3.
        let mut fp32_acc = classic(0, n);
        fp32_acc.grad_accum_dtype = DType::F32;
        let want = [
            20.0 * psi,
            4.0 * psi + 16.0 * psi / nf,
            2.0 * psi + 16.0 * psi / nf,
            18.0 * psi / nf,
        ];
        for (stage, w) in want.into_iter().enumerate() {
            let mut c = fp32_acc.clone();
            c.zero.stage = stage as u8;
            close(
                states(&m, &c),
                w,
                0.01,
                &format!("stage {stage}, {n} ranks, fp32 accumulation"),
            );
        }
    }
}

#[test]
fn table_orders_device_memory_as_zero_promises() {
    let model = Model::llama(LlamaDims::LLAMA2_7B).unwrap();
    let work = Workload {
        seq_len: 2048,
        activation_checkpointing: true,
    };
    let t = estimate_table(&model, &classic(0, 8), &work);
    assert_eq!(t.rows.len(), Setup::ALL.len());
    let device: Vec<u64> = t
        .rows
        .iter()
        .map(|(s, r)| {
            r.as_ref()
                .unwrap_or_else(|e| panic!("{}: {e}", s.label()))
                .tier_peak(Tier::Device)
        })
        .collect();
    for w in device[..6].windows(2) {
        assert!(w[0] > w[1], "{device:?}\n{t}");
    }
    let host = |i: usize| t.rows[i].1.as_ref().unwrap().tier_peak(Tier::Host);
    assert_eq!(host(3), 0);
    assert!(host(5) > host(4) && host(4) > 0, "{t}");
    let nvme = t.rows[6].1.as_ref().unwrap();
    assert!(nvme.peak(Tier::Nvme, Category::Moments) > 0);
    // Activations do not depend on the stage.
    let act: Vec<u64> = t
        .rows
        .iter()
        .map(|(_, r)| {
            r.as_ref()
                .unwrap()
                .peak(Tier::Device, Category::Activations)
        })
        .collect();
    assert!(act.iter().all(|&a| a == act[0] && a > 0), "{act:?}");
    // Checkpointing keeps less.
    let full = estimate(
        &model,
        &classic(3, 8),
        &Workload {
            seq_len: 2048,
            activation_checkpointing: false,
        },
    )
    .unwrap();
    assert!(full.peak(Tier::Device, Category::Activations) > act[0]);
}

/// The device plan an engine checks against the GPU's free memory before
/// it allocates: its buffers add up to the estimate's device peak in every
/// setup (so the named buffers of the build are exactly what the
/// estimator accounts), and a device too small is an error naming the
/// rank, the bytes missing and the largest buffers.
#[test]
fn the_device_plan_is_the_device_peak_and_names_what_does_not_fit() {
    let model = Model::from_unit_sizes(&[3000, 50_000, 70_001, 12_345]).unwrap();
    for setup in Setup::ALL {
        let variants = [
            (1, Precision::Bf16, false),
            (2, Precision::Bf16, false),
            (1, Precision::Fp32, false),
            (2, Precision::Bf16, true),
        ];
        for (ga, precision, swap) in variants {
            let mut cfg = setup.apply(&classic(0, 2));
            cfg.gradient_accumulation_steps = ga;
            cfg.precision = precision;
            cfg.grad_accum_dtype = DType::F32;
            if swap {
                if cfg.zero.offload_optimizer.device != OffloadDevice::Nvme {
                    continue;
                }
                cfg.zero.offload_optimizer.swap_gradients = true;
            }
            let e = estimate(&model, &cfg, &Workload::default())
                .unwrap_or_else(|e| panic!("{}: {e}", setup.label()));
            let plan = e.device_plan(1).unwrap();
            let sum: u64 = plan.buffers().iter().map(|b| b.bytes).sum();
            // With optimizer offload, the gradient homes: host memory here,
            // device memory on a GPU.
            let homes = match e.offload_optimizer {
                OffloadDevice::None => 0,
                _ => e.peak(Tier::Host, Category::Grads),
            };
            assert_eq!(
                sum,
                e.tier_peak(Tier::Device) + homes,
                "{} ga {ga} {precision:?} swap {swap}: {:?}",
                setup.label(),
                plan.buffers()
                    .iter()
                    .map(|b| (&b.name, b.bytes))
                    .collect::<Vec<_>>()
            );
        }
    }
    // Parameter offload with the optimizer state on the device: on a GPU
    // AdamW writes two device slots of the largest shard (unit 2: 70,001
    // elements padded to 70,016, a shard of 35,008 bf16 on 2 ranks).
    let mut cfg = classic(3, 2);
    cfg.zero.offload_param.device = OffloadDevice::Cpu;
    let e = estimate(&model, &cfg, &Workload::default()).unwrap();
    let plan = e.device_plan(0).unwrap();
    let slots: Vec<_> = plan
        .buffers()
        .iter()
        .filter(|b| b.name == "parameter step slots")
        .map(|b| b.bytes)
        .collect();
    assert_eq!(slots, [2 * 35_008 * 2]);
    let sum: u64 = plan.buffers().iter().map(|b| b.bytes).sum();
    assert_eq!(sum, e.tier_peak(Tier::Device) + slots[0]);
    let e = estimate(&model, &classic(0, 2), &Workload::default()).unwrap();
    let plan = e.device_plan(1).unwrap();
    let need = plan.total_bytes();
    plan.check_capacity(need).unwrap();
    let err = plan.check_capacity(need / 2).unwrap_err().to_string();
    for part in ["rank 1", "missing", "m and v `unit.2`"] {
        assert!(err.contains(part), "{part:?} not in: {err}");
    }
    // A plan that fits the free memory but that the device would not
    // reserve (another process took the memory meanwhile, fragmentation).
    let err = plan
        .refused(need + 1, "cuMemAllocAsync: out of memory")
        .to_string();
    for part in [
        "rank 1",
        "could not reserve",
        "cuMemAllocAsync: out of memory",
        "m and v `unit.2`",
    ] {
        assert!(err.contains(part), "{part:?} not in: {err}");
    }
}

#[test]
fn refused_configs_name_the_key() {
    let m = seven_b();
    let mut c = classic(2, 8);
    c.zero.offload_param.device = OffloadDevice::Cpu;
    let err = estimate(&m, &c, &Workload::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("zero_optimization.offload_param.device"),
        "{err}"
    );
    let mut c = classic(3, 1);
    c.zero.offload_param.device = OffloadDevice::Nvme;
    let err = estimate(&m, &c, &Workload::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("offload_param.buffer_size"), "{err}");
}

/// The experiment's stage-3 config as it is (`offload_param` cpu, so
/// DeepSpeed's default `max_in_cpu` of 1e9 elements) plans Qwen2.5-14B's
/// shape on 2 ranks, whose parameter shard per rank is far over 1e9
/// elements: `max_in_cpu` bounds the host cache of the nvme tier only, as
/// in DeepSpeed.
#[test]
fn max_in_cpu_bounds_only_the_nvme_cache() {
    let cfg = experiment_config(include_str!("fixtures/ds_stage3_offload.json"));
    assert_eq!(cfg.zero.offload_param.device, OffloadDevice::Cpu);
    assert_eq!(cfg.zero.offload_param.max_in_cpu, 1_000_000_000);
    let qwen = Model::llama(qwen14b()).unwrap();
    let shard = qwen.numel() / 2;
    assert!(shard > 7_000_000_000, "{shard} elements per rank");
    let e = estimate(&qwen, &cfg, &Workload::default()).unwrap();
    // Every parameter shard (fp16) in host memory, none on the device.
    assert_eq!(e.model_states(Tier::Device), 0);
    assert!(e.model_states(Tier::Host) >= 2 * shard as u64);
}

// ---------------------------------------------------------------------------
// The estimate against the tracker

/// Ranks of the validation runs.
const WORLD: usize = 2;
/// The example's micro-batch (`DEFAULT_BATCH` of llama_sft).
const MICRO: usize = 16;
/// The example's seed.
const SEED: u64 = 42;
/// Optimizer steps per run: the first micro-batch records the stage-3
/// gather order, the second follows it (prefetch, reuse).
const STEPS: usize = 2;

/// The llama_sft presets (`Args::model_config`), over the task's
/// vocabulary with room for `seq` tokens.
fn preset(name: &str, seq: usize) -> Config {
    let base = Config::tiny();
    let c = match name {
        "tiny" => base,
        "task" => Config {
            dim: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            hidden: 344,
            ..base
        },
        other => panic!("no preset {other}"),
    };
    Config {
        vocab: data::VOCAB,
        max_seq: seq,
        ..c
    }
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

/// The example's engine config (`engine_config` of `llama_sft.rs` with no
/// --config: `ResolvedConfig::simple(3, ..)`, bf16, then `--stage`, with
/// `overlap_comm` on for stage 3 only, as DeepSpeed) for `setup`, nvme
/// under `dir`.
fn example_config(setup: Setup, dir: &std::path::Path) -> ResolvedConfig {
    let mut c = ResolvedConfig::simple(3, WORLD, MICRO);
    c.precision = Precision::Bf16;
    c.optimizer.beta2 = 0.95;
    c.optimizer.weight_decay = 0.0;
    c.gradient_clipping = 1.0;
    let (stage, oo, op) = setup.parts();
    c.zero.stage = stage;
    c.zero.overlap_comm = stage == 3;
    c.zero.offload_optimizer.device = oo;
    c.zero.offload_param.device = op;
    if oo == OffloadDevice::Nvme {
        c.zero.offload_optimizer.nvme_path = Some(dir.join("optimizer"));
    }
    if op == OffloadDevice::Nvme {
        c.zero.offload_param.nvme_path = Some(dir.join("params"));
    }
    c
}

/// Trains `STEPS` optimizer steps on one rank; its memory report.
fn train_rank(
    comm: ThreadComm,
    cfg: &ResolvedConfig,
    model_cfg: Config,
    checkpointing: bool,
    seq: usize,
) -> zero::Result<MemoryReport> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let train = data::addition_task(SEED).train;
    let order = data::epoch_order(train.len(), 0, SEED);
    let mut b = Engine::builder(cfg.clone(), comm).seed(SEED);
    let model = SftModel::register(&mut b, model_cfg, None, 1, checkpointing)?;
    let mut e = b.build()?;
    let tracer = Tracer::disabled();
    let ga = cfg.gradient_accumulation_steps;
    for s in 0..STEPS * ga {
        let first = (s * world + rank) * MICRO;
        let samples: Vec<&data::Sample> = (first..first + MICRO)
            .map(|i| &train[order[i % order.len()]])
            .collect();
        let (tokens, targets) = data::make_batch(&samples, seq).expect("samples fit");
        match cfg.precision {
            Precision::Bf16 => model
                .train_micro_batch::<bf16, _>(&mut e, &tokens, &targets, MICRO, seq, &tracer)?,
            _ => {
                model.train_micro_batch::<f32, _>(&mut e, &tokens, &targets, MICRO, seq, &tracer)?
            }
        };
        e.step()?;
    }
    Ok(e.memory_report())
}

/// A fresh directory for swap files.
fn scratch(tag: &str) -> PathBuf {
    // Tests run in parallel and may share a tag: one directory per call.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("zero-estimate-{}-{tag}-{n}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs every setup of `name` (with the example's config, changed by
/// `tweak`), compares each tier's peak with the estimate on every rank and
/// prints every deviation, per tier and (where not equal) per category.
fn validate(name: &str, checkpointing: bool, tweak: fn(&mut ResolvedConfig)) {
    let train = data::addition_task(SEED).train;
    let seq = data::max_len(&train);
    let model_cfg = preset(name, seq);
    let model = Model::llama(dims(&model_cfg)).unwrap();
    let work = Workload {
        seq_len: seq,
        activation_checkpointing: checkpointing,
    };
    let dir = scratch(&format!("{name}-{checkpointing}"));
    let mut worst: f64 = 0.0;
    let mut failures = Vec::new();
    println!(
        "{name} (seq {seq}, micro {MICRO}, {} parameters, checkpointing {checkpointing}):",
        model.numel()
    );
    for setup in Setup::ALL {
        let mut cfg = example_config(setup, &dir);
        tweak(&mut cfg);
        let est = estimate(&model, &cfg, &work).unwrap();
        let reports = ThreadGroup::run(WORLD, |comm| {
            train_rank(comm, &cfg, model_cfg, checkpointing, seq)
        })
        .expect("ranks ran");
        for (rank, r) in reports.into_iter().enumerate() {
            let r = r.unwrap_or_else(|e| panic!("{} rank {rank}: {e}", setup.label()));
            let mut line = format!("  {:<16} rank {rank}:", setup.label());
            for tier in Tier::ALL {
                let measured = r.tier(tier).map_or(0, |t| t.peak);
                let planned = est.tier_peak(tier);
                if measured == 0 && planned == 0 {
                    continue;
                }
                let dev = if measured == 0 {
                    f64::INFINITY
                } else {
                    planned as f64 / measured as f64 - 1.0
                };
                worst = worst.max(dev.abs());
                line.push_str(&format!(
                    " {tier} {planned}/{measured} B ({:+.2}%)",
                    100.0 * dev
                ));
                if dev.abs() > 0.10 {
                    failures.push(format!("{} rank {rank} {tier}", setup.label()));
                }
                for c in Category::ALL {
                    let m = r.get(tier, c).map_or(0, |x| x.peak);
                    let p = est.peak(tier, c);
                    if m != p {
                        line.push_str(&format!(" [{c}: {p} vs {m}]"));
                        if m == 0 || (p as f64 / m as f64 - 1.0).abs() > 0.10 {
                            failures.push(format!("{} rank {rank} {tier} {c}", setup.label()));
                        }
                    }
                }
            }
            println!("{line}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("  largest deviation: {:.3}%", 100.0 * worst);
    assert!(failures.is_empty(), "beyond 10%: {failures:?}");
}

#[test]
fn matches_the_tracker_tiny() {
    validate("tiny", false, |_| {});
}

#[test]
fn matches_the_tracker_task() {
    validate("task", false, |_| {});
}

#[test]
fn matches_the_tracker_task_with_checkpointing() {
    validate("task", true, |_| {});
}

/// The settings of `examples/llama/tests/sft.rs` and more: small buckets, prefetch
/// of a few units, no persistence, a live cap below the model (so reuse
/// evicts), gradient accumulation, fp32, no host cache with nvme.
#[test]
fn matches_the_tracker_with_prefetch_small_buckets_and_accumulation() {
    validate("task", false, |c| {
        c.precision = Precision::Fp32;
        c.gradient_accumulation_steps = 2;
        c.train_batch_size = MICRO * 2 * WORLD;
        c.zero.reduce_bucket_size = 60_000;
        c.zero.prefetch_bucket_size = 400_000;
        c.zero.param_persistence_threshold = 0;
        c.zero.max_live_parameters = 500_000;
        c.zero.max_reuse_distance = 600_000;
        c.zero.sub_group_size = 100_000;
        if c.zero.offload_param.device == OffloadDevice::Nvme {
            c.zero.offload_param.max_in_cpu = 0;
        }
        c.zero.offload_param.buffer_count = 3;
        c.zero.offload_optimizer.buffer_count = 3;
    });
}

/// ZeRO-Infinity's setup: with the optimizer state on nvme the gradients
/// are swapped too (`swap_gradients`), with accumulation, small tiles and
/// no host cache of parameter shards.
#[test]
fn matches_the_tracker_with_swapped_gradients() {
    validate("task", false, |c| {
        if c.zero.offload_optimizer.device == OffloadDevice::Nvme {
            c.zero.offload_optimizer.swap_gradients = true;
            c.zero.offload_param.max_in_cpu = 0;
        }
        c.gradient_accumulation_steps = 2;
        c.train_batch_size = MICRO * 2 * WORLD;
        c.zero.sub_group_size = 100_000;
    });
}

// ---------------------------------------------------------------------------
// LoRA: frozen base weights

/// The experiment's model: Qwen2.5-14B (its shapes without the q/k/v
/// biases).
fn qwen14b() -> LlamaDims {
    LlamaDims {
        vocab: 152_064,
        hidden: 5120,
        intermediate: 13_824,
        layers: 48,
        heads: 40,
        kv_heads: 8,
    }
}

/// One of the experiment's DeepSpeed configs (tests/fixtures) for 2 ranks.
fn experiment_config(json: &str) -> ResolvedConfig {
    use zero::core::config::{AutoValues, DeepSpeedConfig};
    let (doc, _) = DeepSpeedConfig::from_json_str(json).unwrap();
    let auto = AutoValues {
        world_size: 2,
        micro_batch_size: Some(1),
        gradient_accumulation_steps: Some(1),
        gradient_clipping: Some(1.0),
        fp16: Some(false),
        bf16: Some(true),
        lr: Some(1e-4),
        betas: Some((0.9, 0.999)),
        eps: Some(1e-8),
        weight_decay: Some(0.0),
        warmup_min_lr: Some(0.0),
        warmup_max_lr: Some(1e-4),
        warmup_num_steps: Some(10),
        hidden_size: Some(5120),
        ..AutoValues::default()
    };
    doc.resolve(&auto).unwrap()
}

#[test]
fn lora_on_qwen14b_counts_only_the_adapters_as_trainable() {
    use zero::core::partition::PartitionPlan;
    use zero::estimate::{Lora, LORA_TARGETS};
    let d = qwen14b();
    let lora = Lora {
        rank: 8,
        targets: LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
    };
    let m = Model::llama_lora(d, &lora).unwrap();
    // PEFT's count: r × (in + out) per targeted projection and layer.
    let (h, i, kv) = (5120, 13_824, 8 * 128);
    let per_layer = 8 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h));
    assert_eq!(m.trainable_numel(), 48 * per_layer);
    assert_eq!(m.trainable_numel(), 34_406_400);
    assert_eq!(m.numel(), Model::llama(d).unwrap().numel() + 34_406_400);
    let plan = PartitionPlan::new(m.units(), 2).unwrap();
    let trainable_padded = plan.padded_numel() as u64;
    let param_len = plan.param_numel() as u64;
    let frozen_padded = param_len - trainable_padded;
    let mut peaks = Vec::new();
    for (name, json) in [
        ("ds_stage0", include_str!("fixtures/ds_stage0.json")),
        ("ds_stage1", include_str!("fixtures/ds_stage1.json")),
        (
            "ds_stage2_offload",
            include_str!("fixtures/ds_stage2_offload.json"),
        ),
        (
            "ds_stage3_offload",
            include_str!("fixtures/ds_stage3_offload.json"),
        ),
    ] {
        let cfg = experiment_config(json);
        let e = estimate(&m, &cfg, &Workload::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(e.trainable_numel, 34_406_400, "{name}");
        let stage = cfg.zero.stage;
        let p = cfg.precision.param_dtype().size_in_bytes() as u64;
        // The fp32 master and the moments cover the adapters only: full at
        // stage 0, half of them per rank beyond.
        let state = if stage == 0 {
            trainable_padded
        } else {
            trainable_padded / 2
        };
        let tier = if cfg.zero.offload_optimizer.device == OffloadDevice::None {
            Tier::Device
        } else {
            Tier::Host
        };
        assert_eq!(e.peak(tier, Category::Master), 4 * state, "{name}: master");
        assert_eq!(
            e.peak(tier, Category::Moments),
            8 * state,
            "{name}: moments"
        );
        // Parameters: every weight at stages 0–2; at stage 3 the adapter
        // shard (offloaded with offload_param) and the frozen base,
        // resident on the device.
        let params = e.peak(Tier::Device, Category::Params);
        if stage < 3 {
            assert_eq!(params, p * param_len, "{name}: params");
        } else {
            assert_eq!(cfg.zero.offload_param.device, OffloadDevice::Cpu);
            assert_eq!(params, p * frozen_padded, "{name}: params");
            assert_eq!(
                e.peak(Tier::Host, Category::Params),
                p * trainable_padded / 2,
                "{name}"
            );
        }
        // Gradients: the adapters' only (at most a full buffer in the
        // parameter dtype and one in the accumulation dtype).
        let grads = e.peak(Tier::Device, Category::Grads) + e.peak(Tier::Host, Category::Grads);
        assert!(grads <= (2 + 4) * trainable_padded, "{name}: grads {grads}");
        assert!(grads > 0, "{name}");
        // Plausible: the base weights dominate (~29.6 GB of bf16 or ~59 GB
        // of fp32 per rank); stage 3 adds the gathered units, which copy
        // the frozen segment next to the trainable one (at most
        // stage3_max_live_parameters of them).
        let device = e.tier_peak(Tier::Device) as f64;
        let base = (p * frozen_padded) as f64;
        // Gathered units, and the trainer's activations and working
        // memory (the f32 copy of a gathered unit: 3.1 GB for the
        // embedding).
        let gathered = e.peak(Tier::Device, Category::GatheredParams) as f64;
        assert!(
            gathered <= (p as f64) * 1.1e9 + (p * 4 * 5120 * 152_064) as f64,
            "{name}"
        );
        let live = gathered + e.peak(Tier::Device, Category::Activations) as f64;
        assert!(
            device >= base && device <= 1.05 * base + live,
            "{name}: device {device:.3e} for a base of {base:.3e}"
        );
        peaks.push((cfg.precision, device));
        println!(
            "{name}: stage {stage}, {:?} params, device peak {:.2} GB per rank",
            cfg.precision,
            device / GB
        );
    }
    // The target: stage 3 with LoRA (frozen base resident) needs
    // no more device memory than stage 2 (same dtype in both configs).
    assert_eq!(peaks[2].0, peaks[3].0);
    assert!(
        peaks[3].1 <= peaks[2].1,
        "stage 3 {:.3e} vs stage 2 {:.3e}",
        peaks[3].1,
        peaks[2].1
    );
}
