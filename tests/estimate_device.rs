//! The estimate of a device backend ([`estimate_device`]) against the
//! tracker of the device trainer (`zero_llama::device::DeviceModel`) on the
//! checked CPU backend staging its transfers as a GPU does
//! (`EngineBuilder::stage_offload_for_tests`: the pinned host slots a
//! device backend adds; the device trainer's own for LoRA's dropout masks
//! at every stage), for the experiment's shape at a reduced width:
//! Qwen2.5-14B's structure (48 layers, 40 heads, 8 kv heads, its ratios
//! of widths) with every width divided by 64, LoRA r=8 on the seven
//! projections with dropout, 16 sequences of 51 tokens per rank, 2 ranks,
//! activation checkpointing, bf16, under the four DeepSpeed configs of
//! the experiment (tests/fixtures) as they are.
//!
//! Per rank and tier, the peak of the model states, gradient and
//! communication buffers and gathered units (everything but the
//! activations, which the device trainer plans itself) is within 10% of
//! the estimate, and so is the host tier's peak as a whole (the host
//! estimate without the pinned slots, [`estimate`], is smaller where the
//! optimizer or the parameters are offloaded).

use zero::comm::{Communicator, ThreadComm, ThreadGroup};
use zero::core::backend::{CpuBackend, CpuMode};
use zero::core::bf16;
use zero::core::config::{AutoValues, DeepSpeedConfig, Precision, ResolvedConfig};
use zero::core::memory::{Category, MemoryReport, Tier};
use zero::estimate::{
    estimate, estimate_device, Estimate, LlamaDims, Lora, Model, Workload, LORA_TARGETS,
};
use zero::{Engine, Tracer};
use zero_llama as llama;

use llama::device::DeviceModel;
use llama::lora::LoraConfig;
use llama::train::{LoraSetup, SftModel};
use llama::Config;

const WORLD: usize = 2;
const MICRO: usize = 16;
const SEQ: usize = 51;
const STEPS: usize = 2;

/// Qwen2.5-14B's structure, every width divided by 64.
fn dims() -> LlamaDims {
    LlamaDims {
        vocab: 152_064 / 64,
        hidden: 5120 / 64,
        intermediate: 13_824 / 64,
        layers: 48,
        heads: 40,
        kv_heads: 8,
    }
}

fn model_config() -> Config {
    let d = dims();
    Config {
        vocab: d.vocab,
        dim: d.hidden,
        n_layers: d.layers,
        n_heads: d.heads,
        n_kv_heads: d.kv_heads,
        hidden: d.intermediate,
        max_seq: SEQ,
        tie_embeddings: false,
        qkv_bias: false,
        ..Config::tiny()
    }
}

/// One of the experiment's DeepSpeed configs for 2 ranks of 16 sequences.
fn experiment_config(json: &str) -> ResolvedConfig {
    let (doc, _) = DeepSpeedConfig::from_json_str(json).unwrap();
    let auto = AutoValues {
        world_size: WORLD,
        micro_batch_size: Some(MICRO),
        gradient_accumulation_steps: Some(1),
        gradient_clipping: Some(1.0),
        fp16: Some(false),
        bf16: Some(true),
        lr: Some(1e-4),
        betas: Some((0.9, 0.999)),
        eps: Some(1e-8),
        weight_decay: Some(0.1),
        warmup_min_lr: Some(0.0),
        warmup_max_lr: Some(1e-4),
        warmup_num_steps: Some(1),
        hidden_size: Some(dims().hidden),
        ..AutoValues::default()
    };
    doc.resolve(&auto).unwrap()
}

/// Trains `STEPS` steps on one rank with the device trainer; its report.
fn train_rank(comm: ThreadComm, cfg: &ResolvedConfig) -> zero::Result<MemoryReport> {
    let rank = comm.rank();
    let mut b = Engine::builder(cfg.clone(), comm)
        .seed(3)
        .backend(CpuBackend::new(CpuMode::Checked)?)
        .stage_offload_for_tests();
    let lora = LoraSetup {
        cfg: LoraConfig::new(8, 64.0, 0.01, &LORA_TARGETS).unwrap(),
        seed: 3,
        adapters: None,
    };
    let model = SftModel::register_lora(&mut b, model_config(), None, Some(lora), 1, true)?;
    let mut e = b.build()?;
    let dm = DeviceModel::new(model, e.device_backend(), 1)?;
    let vocab = dims().vocab as u32;
    let tracer = Tracer::disabled();
    for s in 0..STEPS {
        let tokens: Vec<u32> = (0..MICRO * SEQ)
            .map(|i| ((i * 31 + s * 7 + rank * 13) as u32) % vocab)
            .collect();
        // The answer: the last 11 tokens of each sequence.
        let targets: Vec<i32> = (0..MICRO * SEQ)
            .map(|i| {
                if i % SEQ >= SEQ - 11 {
                    tokens[(i + 1) % tokens.len()] as i32
                } else {
                    -100
                }
            })
            .collect();
        match cfg.precision {
            Precision::Bf16 => {
                dm.train_micro_batch::<bf16, _>(&mut e, &tokens, &targets, MICRO, SEQ, &tracer)?
            }
            _ => dm.train_micro_batch::<f32, _>(&mut e, &tokens, &targets, MICRO, SEQ, &tracer)?,
        };
        e.step()?;
    }
    Ok(e.memory_report())
}

/// Everything of `tier` but the activations: the sum of the categories'
/// peaks.
fn states(tier: Tier, peak: impl Fn(Tier, Category) -> u64) -> u64 {
    Category::ALL
        .into_iter()
        .filter(|&c| c != Category::Activations)
        .map(|c| peak(tier, c))
        .sum()
}

fn close(planned: u64, measured: u64, what: &str, failures: &mut Vec<String>) {
    let dev = planned as f64 / measured.max(1) as f64 - 1.0;
    println!(
        "  {what}: estimate {planned} B, measured {measured} B ({:+.2}%)",
        100.0 * dev
    );
    if measured == 0 || dev.abs() > 0.10 {
        failures.push(format!("{what}: {planned} vs {measured}"));
    }
}

#[test]
fn the_device_estimate_of_the_experiment_is_within_10_percent() {
    let lora = Lora {
        rank: 8,
        targets: LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
    };
    let model = Model::llama_lora(dims(), &lora).unwrap().lora_dropout(true);
    let work = Workload {
        seq_len: SEQ,
        activation_checkpointing: true,
    };
    let mut failures = Vec::new();
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
        let est: Estimate = estimate_device(&model, &cfg, &work).unwrap();
        // Without the device's pinned slots the host tier is smaller
        // wherever the optimizer or the parameters are offloaded.
        let plain = estimate(&model, &cfg, &work).unwrap();
        let offloaded = est.tier_peak(Tier::Host) > 0;
        assert_eq!(
            plain.tier_peak(Tier::Host) < est.tier_peak(Tier::Host),
            offloaded,
            "{name}: the pinned host slots"
        );
        let reports = ThreadGroup::run(WORLD, |comm| train_rank(comm, &cfg)).expect("ranks ran");
        println!("{name}:");
        for (rank, r) in reports.into_iter().enumerate() {
            let r = r.unwrap_or_else(|e| panic!("{name} rank {rank}: {e}"));
            let measured = |t: Tier, c: Category| r.get(t, c).map_or(0, |x| x.peak);
            for tier in [Tier::Device, Tier::Host] {
                let planned = states(tier, |t, c| est.peak(t, c));
                let got = states(tier, measured);
                if planned == 0 && got == 0 {
                    continue;
                }
                close(
                    planned,
                    got,
                    &format!("{name} rank {rank} {tier} (no activations)"),
                    &mut failures,
                );
                for c in Category::ALL {
                    let (p, m) = (est.peak(tier, c), measured(tier, c));
                    if p != m && c != Category::Activations {
                        println!("    {tier} {c}: estimate {p} vs {m}");
                    }
                }
            }
            let host = r.tier(Tier::Host).map_or(0, |t| t.peak);
            if host > 0 || est.tier_peak(Tier::Host) > 0 {
                close(
                    est.tier_peak(Tier::Host),
                    host,
                    &format!("{name} rank {rank} host peak"),
                    &mut failures,
                );
            }
        }
    }
    assert!(failures.is_empty(), "beyond 10%: {failures:?}");
}
