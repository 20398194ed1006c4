//! DeepSpeed-compatible configuration: parsing, "auto", defaults, validation.

use std::path::PathBuf;

use zero_core::config::{
    Auto, AutoValues, DeepSpeedConfig, OffloadDevice, Precision, ResolvedConfig, ZeroConfig,
};
use zero_core::optim::{AdamWParams, LossScaleConfig, LrSchedule, WarmupType};
use zero_core::{DType, Error};

const STAGE0: &str = include_str!("../../tests/fixtures/ds_stage0.json");
const STAGE1: &str = include_str!("../../tests/fixtures/ds_stage1.json");
const STAGE2_OFFLOAD: &str = include_str!("../../tests/fixtures/ds_stage2_offload.json");
const STAGE3_OFFLOAD: &str = include_str!("../../tests/fixtures/ds_stage3_offload.json");

/// Every key zero reads, with a value that is valid and not the default.
const FULL: &str = r#"{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 0.5,
  "fp16": {
    "enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
    "hysteresis": 3, "consecutive_hysteresis": true, "min_loss_scale": 0.25
  },
  "bf16": { "enabled": false },
  "optimizer": {
    "type": "Adam",
    "params": {
      "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1,
      "bias_correction": true, "adam_w_mode": true, "amsgrad": false
    }
  },
  "scheduler": {
    "type": "WarmupDecayLR",
    "params": {
      "warmup_min_lr": 1e-6, "warmup_max_lr": 3e-4, "warmup_num_steps": 200,
      "warmup_type": "linear", "total_num_steps": 10000
    }
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": false,
    "overlap_comm": false,
    "reduce_scatter": false,
    "reduce_bucket_size": 1e7,
    "allgather_partitions": false,
    "allgather_bucket_size": 2e7,
    "stage3_prefetch_bucket_size": 3e7,
    "stage3_param_persistence_threshold": 4e4,
    "stage3_max_live_parameters": 5e8,
    "stage3_max_reuse_distance": 6e8,
    "stage3_gather_16bit_weights_on_model_save": true,
    "sub_group_size": 1e8,
    "round_robin_gradients": true,
    "offload_optimizer": {
      "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true, "buffer_count": 8,
      "pipeline_read": true, "pipeline_write": true, "fast_init": true, "ratio": 0.5
    },
    "offload_param": {
      "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true, "buffer_count": 6,
      "buffer_size": 2e8, "max_in_cpu": 2e9
    }
  },
  "aio": {
    "block_size": 262144, "queue_depth": 32, "thread_count": 2, "intra_op_parallelism": 4,
    "single_submit": true, "overlap_events": false, "use_gds": true
  },
  "communication_data_type": "bf16",
  "data_types": { "grad_accum_dtype": "bf16" },
  "steps_per_print": 10,
  "wall_clock_breakdown": true
}"#;

fn parse(json: &str) -> (DeepSpeedConfig, Vec<String>) {
    match DeepSpeedConfig::from_json_str(json) {
        Ok(parsed) => parsed,
        Err(e) => panic!("{json} did not parse: {e}"),
    }
}

fn parse_err(json: &str) -> String {
    match DeepSpeedConfig::from_json_str(json) {
        Ok(_) => panic!("{json} parsed, expected an error"),
        Err(e) => e.to_string(),
    }
}

fn resolve(json: &str, auto: &AutoValues) -> ResolvedConfig {
    let (doc, _) = parse(json);
    match doc.resolve(auto) {
        Ok(cfg) => cfg,
        Err(e) => panic!("{json} did not resolve: {e}"),
    }
}

fn resolve_err(json: &str, auto: &AutoValues) -> Error {
    let (doc, _) = parse(json);
    match doc.resolve(auto) {
        Ok(cfg) => panic!("{json} resolved to {cfg:?}, expected an error"),
        Err(e) => e,
    }
}

/// Asserts that resolving fails with a config error whose key is `key` and
/// whose text names it and contains each of `words`.
fn assert_resolve_err(json: &str, auto: &AutoValues, key: &str, words: &[&str]) {
    let err = resolve_err(json, auto);
    let text = err.to_string();
    match &err {
        Error::Config { key: k, .. } => assert_eq!(k, key, "{json}: {text}"),
        other => panic!("{json}: not a config error: {other}"),
    }
    assert!(text.contains(&format!("`{key}`")), "{json}: {text}");
    for w in words {
        assert!(text.contains(w), "{json}: `{text}` lacks `{w}`");
    }
}

/// What an HF-style trainer knows.
fn typical() -> AutoValues {
    AutoValues {
        world_size: 2,
        micro_batch_size: Some(4),
        gradient_accumulation_steps: Some(1),
        gradient_clipping: Some(1.0),
        fp16: Some(true),
        bf16: Some(false),
        lr: Some(2e-5),
        betas: Some((0.9, 0.999)),
        eps: Some(1e-8),
        weight_decay: Some(0.0),
        warmup_min_lr: Some(0.0),
        warmup_max_lr: Some(2e-5),
        warmup_num_steps: Some(100),
        total_num_steps: Some(1000),
        hidden_size: Some(512),
        ..AutoValues::default()
    }
}

fn world(n: usize) -> AutoValues {
    AutoValues {
        world_size: n,
        ..AutoValues::default()
    }
}

// ---------------------------------------------------------------------------
// The real configs
// ---------------------------------------------------------------------------

#[test]
fn fixtures_parse_without_warnings() {
    for json in [STAGE0, STAGE1, STAGE2_OFFLOAD, STAGE3_OFFLOAD] {
        let (_, warnings) = parse(json);
        assert!(warnings.is_empty(), "{warnings:?}");
    }
}

/// Every DeepSpeed config of the repository (fixtures and examples) parses
/// under the strict default without a warning, and resolves.
#[test]
fn every_config_of_the_repository_parses_strictly() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut seen = 0;
    for dir in ["tests/fixtures", "examples", "examples/llama"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if !(name.starts_with("ds_") && name.ends_with(".json")) {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let (doc, warnings) = match DeepSpeedConfig::from_json_str(&text) {
                Ok(parsed) => parsed,
                Err(e) => panic!("{}: {e}", path.display()),
            };
            assert!(warnings.is_empty(), "{}: {warnings:?}", path.display());
            if let Err(e) = doc.resolve(&typical()) {
                panic!("{}: {e}", path.display());
            }
            seen += 1;
        }
    }
    assert!(seen >= 6, "found {seen} configs");
}

#[test]
fn fixture_stage0_and_stage1() {
    for (json, stage) in [(STAGE0, 0u8), (STAGE1, 1)] {
        let cfg = resolve(json, &typical());
        assert_eq!(cfg.world_size, 2);
        assert_eq!(cfg.micro_batch_size, 4);
        assert_eq!(cfg.gradient_accumulation_steps, 1);
        assert_eq!(cfg.train_batch_size, 8);
        // No fp16 block: the trainer's fp16 only fills an "auto" key.
        assert_eq!(cfg.precision, Precision::Fp32);
        assert_eq!(cfg.loss_scale, None);
        assert_eq!(
            cfg.zero,
            ZeroConfig {
                stage,
                ..ZeroConfig::default()
            }
        );
        assert_eq!(cfg, ResolvedConfig::simple(stage, 2, 4));
    }
}

#[test]
fn fixture_stage2_offload() {
    let cfg = resolve(STAGE2_OFFLOAD, &typical());
    assert_eq!(
        (
            cfg.train_batch_size,
            cfg.micro_batch_size,
            cfg.gradient_accumulation_steps
        ),
        (8, 4, 1)
    );
    assert_eq!(cfg.gradient_clipping, 1.0);
    assert_eq!(cfg.precision, Precision::Fp16);
    assert_eq!(
        cfg.loss_scale,
        Some(LossScaleConfig::Dynamic {
            initial_scale_power: 16,
            window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        })
    );
    assert_eq!(
        cfg.optimizer,
        AdamWParams {
            lr: 2e-5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    );
    assert_eq!(
        cfg.scheduler,
        LrSchedule::WarmupLr {
            min_lr: 0.0,
            max_lr: 2e-5,
            warmup_steps: 100,
            warmup_type: WarmupType::Log,
        }
    );
    let z = &cfg.zero;
    assert_eq!(z.stage, 2);
    assert_eq!(z.reduce_bucket_size, 200_000_000);
    assert_eq!(z.allgather_bucket_size, 200_000_000);
    assert!(z.allgather_partitions && z.overlap_comm && z.reduce_scatter);
    assert!(z.contiguous_gradients);
    assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
    assert!(z.offload_optimizer.pin_memory);
    assert_eq!(z.offload_optimizer.buffer_count, 4);
    assert_eq!(z.offload_param.device, OffloadDevice::None);
    assert_eq!(cfg.communication_data_type, DType::F32);
    assert_eq!(cfg.grad_accum_dtype, DType::F32);
}

#[test]
fn fixture_stage3_offload() {
    let cfg = resolve(STAGE3_OFFLOAD, &typical());
    assert_eq!(cfg.precision, Precision::Fp16);
    let z = &cfg.zero;
    assert_eq!(z.stage, 3);
    assert!(z.overlap_comm && z.contiguous_gradients);
    assert_eq!(z.sub_group_size, 1_000_000_000);
    assert_eq!(z.max_live_parameters, 1_000_000_000);
    assert_eq!(z.max_reuse_distance, 1_000_000_000);
    assert!(z.gather_16bit_weights_on_model_save);
    // "auto" sizes from hidden_size 512, as the HF integration fills them.
    assert_eq!(z.reduce_bucket_size, 512 * 512);
    assert_eq!(z.prefetch_bucket_size, 235_929); // floor(0.9 * 512 * 512)
    assert_eq!(z.param_persistence_threshold, 5120);
    assert_eq!(z.offload_param.device, OffloadDevice::Cpu);
    assert!(z.offload_param.pin_memory);
    assert_eq!(z.offload_param.buffer_count, 5);
    assert_eq!(z.offload_param.buffer_size, 100_000_000);
    assert_eq!(z.offload_param.max_in_cpu, 1_000_000_000);
    assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
    assert!(z.offload_optimizer.pin_memory);

    // bf16 from the trainer: the fixture's fp16 block says "auto".
    let auto = AutoValues {
        fp16: Some(false),
        ..typical()
    };
    let cfg = resolve(STAGE3_OFFLOAD, &auto);
    assert_eq!(cfg.precision, Precision::Fp32);
    assert_eq!(cfg.loss_scale, None);
    let bf16 = STAGE3_OFFLOAD.replacen('{', r#"{ "bf16": { "enabled": "auto" },"#, 1);
    let auto = AutoValues {
        bf16: Some(true),
        ..auto
    };
    assert_eq!(resolve(&bf16, &auto).precision, Precision::Bf16);
}

// ---------------------------------------------------------------------------
// Defaults
// ---------------------------------------------------------------------------

#[test]
fn defaults_are_deepspeeds() {
    let cfg = resolve(r#"{ "train_micro_batch_size_per_gpu": 2 }"#, &world(3));
    assert_eq!(cfg, ResolvedConfig::simple(0, 3, 2));
    assert_eq!(cfg.train_batch_size, 6);
    assert_eq!(cfg.gradient_clipping, 1.0);
    assert_eq!(cfg.precision, Precision::Fp32);
    assert_eq!(
        cfg.optimizer,
        AdamWParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    );
    assert_eq!(cfg.scheduler, LrSchedule::Constant { lr: 1e-3 });
    let z = &cfg.zero;
    assert_eq!(z.stage, 0);
    assert!(z.contiguous_gradients && z.reduce_scatter && z.allgather_partitions);
    assert!(!z.overlap_comm && !z.round_robin_gradients && !z.gather_16bit_weights_on_model_save);
    assert_eq!(z.reduce_bucket_size, 500_000_000);
    assert_eq!(z.allgather_bucket_size, 500_000_000);
    assert_eq!(z.prefetch_bucket_size, 50_000_000);
    assert_eq!(z.param_persistence_threshold, 100_000);
    assert_eq!(z.max_live_parameters, 1_000_000_000);
    assert_eq!(z.max_reuse_distance, 1_000_000_000);
    assert_eq!(z.sub_group_size, 1_000_000_000);
    let oo = &z.offload_optimizer;
    assert_eq!(oo.device, OffloadDevice::None);
    assert_eq!(oo.nvme_path, None);
    assert!(!oo.pin_memory && !oo.fast_init);
    // Ours: overlapped by default (DeepSpeed's default is false).
    assert!(oo.pipeline_read && oo.pipeline_write);
    assert_eq!((oo.buffer_count, oo.ratio), (4, 1.0));
    let op = &z.offload_param;
    assert_eq!(op.device, OffloadDevice::None);
    assert_eq!(
        (op.buffer_count, op.buffer_size, op.max_in_cpu),
        (5, 100_000_000, 1_000_000_000)
    );
    assert!(!op.pin_memory);
    let aio = &z.aio;
    assert_eq!(
        (aio.block_size, aio.queue_depth, aio.thread_count),
        (1_048_576, 8, 1)
    );
    assert!(!aio.single_submit && aio.overlap_events && !aio.use_gds);
    assert_eq!(cfg.communication_data_type, DType::F32);
    assert_eq!(cfg.grad_accum_dtype, DType::F32);
}

#[test]
fn stage3_turns_overlap_comm_on_by_default() {
    let json = r#"{ "train_batch_size": 4, "zero_optimization": { "stage": 3 } }"#;
    let cfg = resolve(json, &world(4));
    assert!(cfg.zero.overlap_comm);
    assert_eq!(cfg, ResolvedConfig::simple(3, 4, 1));
    let json = r#"{ "train_batch_size": 4,
                    "zero_optimization": { "stage": 3, "overlap_comm": false } }"#;
    assert!(!resolve(json, &world(4)).zero.overlap_comm);
}

#[test]
fn fp16_defaults_and_static_scale() {
    let json = r#"{ "train_batch_size": 2, "fp16": { "enabled": true } }"#;
    let cfg = resolve(json, &world(1));
    assert_eq!(cfg.precision, Precision::Fp16);
    assert_eq!(cfg.precision.param_dtype(), DType::F16);
    assert_eq!(
        cfg.loss_scale,
        Some(LossScaleConfig::Dynamic {
            initial_scale_power: 16,
            window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        })
    );
    let json = r#"{ "train_batch_size": 2, "fp16": { "enabled": true, "loss_scale": 128 } }"#;
    assert_eq!(
        resolve(json, &world(1)).loss_scale,
        Some(LossScaleConfig::Static { scale: 128.0 })
    );
}

#[test]
fn optimizer_block_defaults_are_fused_adams() {
    let json = r#"{ "train_batch_size": 2, "optimizer": { "type": "AdamW" } }"#;
    assert_eq!(
        resolve(json, &world(1)).optimizer,
        AdamWParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    );
    // DeepSpeed compares optimizer names case-insensitively; Adam with its
    // default adam_w_mode is AdamW.
    for t in ["adamw", "Adam", "adam"] {
        let json = format!(
            r#"{{ "train_batch_size": 2, "optimizer": {{ "type": "{t}", "params": {{ "lr": 0.1 }} }} }}"#
        );
        assert_eq!(resolve(&json, &world(1)).optimizer.lr, 0.1);
    }
}

#[test]
fn scheduler_defaults() {
    let json = r#"{ "train_batch_size": 2, "scheduler": { "type": "WarmupLR" } }"#;
    assert_eq!(
        resolve(json, &world(1)).scheduler,
        LrSchedule::WarmupLr {
            min_lr: 0.0,
            max_lr: 0.001,
            warmup_steps: 1000,
            warmup_type: WarmupType::Log,
        }
    );
    let json = r#"{ "train_batch_size": 2, "optimizer": { "type": "AdamW", "params": { "lr": 0.5 } },
                    "scheduler": { "type": "WarmupCosineLR", "params": { "total_num_steps": 5000 } } }"#;
    assert_eq!(
        resolve(json, &world(1)).scheduler,
        LrSchedule::WarmupCosineLr {
            base_lr: 0.5,
            total_steps: 5000,
            warmup_min_ratio: 0.0,
            warmup_steps: 1000,
            cos_min_ratio: 0.0001,
            warmup_type: WarmupType::Log,
        }
    );
    let json = r#"{ "train_batch_size": 2, "scheduler": { "type": "WarmupDecayLR",
                    "params": { "total_num_steps": 1000, "warmup_num_steps": 1000 } } }"#;
    assert_eq!(
        resolve(json, &world(1)).scheduler,
        LrSchedule::WarmupDecayLr {
            min_lr: 0.0,
            max_lr: 0.001,
            warmup_steps: 1000,
            total_steps: 1000,
            warmup_type: WarmupType::Log,
        }
    );
}

/// The warnings of `FULL`: its `aio` block asks for DeepSpeed's libaio
/// modes that zero's I/O threads do not have, and each is said.
fn assert_only_unused_aio_modes(warnings: &[String]) {
    let keys = ["aio.single_submit", "aio.overlap_events", "aio.use_gds"];
    assert_eq!(warnings.len(), keys.len(), "{warnings:?}");
    for (w, key) in warnings.iter().zip(keys) {
        assert!(
            w.starts_with(&format!("key {key}: accepted, not used: ")),
            "{w}"
        );
    }
}

#[test]
fn every_key_is_read() {
    let (_, warnings) = parse(FULL);
    assert_only_unused_aio_modes(&warnings);
    let cfg = resolve(FULL, &world(4));
    assert_eq!(
        (
            cfg.train_batch_size,
            cfg.micro_batch_size,
            cfg.gradient_accumulation_steps
        ),
        (64, 4, 4)
    );
    assert_eq!(cfg.gradient_clipping, 0.5);
    assert_eq!(
        cfg.loss_scale,
        Some(LossScaleConfig::Dynamic {
            initial_scale_power: 12,
            window: 500,
            hysteresis: 3,
            consecutive_hysteresis: true,
            min_scale: 0.25,
        })
    );
    assert_eq!(
        cfg.optimizer,
        AdamWParams {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-6,
            weight_decay: 0.1,
        }
    );
    assert_eq!(
        cfg.scheduler,
        LrSchedule::WarmupDecayLr {
            min_lr: 1e-6,
            max_lr: 3e-4,
            warmup_steps: 200,
            total_steps: 10000,
            warmup_type: WarmupType::Linear,
        }
    );
    let z = &cfg.zero;
    assert_eq!(z.stage, 3);
    assert!(!z.contiguous_gradients && !z.overlap_comm && !z.reduce_scatter);
    assert!(!z.allgather_partitions);
    assert_eq!(
        (
            z.reduce_bucket_size,
            z.allgather_bucket_size,
            z.prefetch_bucket_size
        ),
        (10_000_000, 20_000_000, 30_000_000)
    );
    assert_eq!(z.param_persistence_threshold, 40_000);
    assert_eq!(
        (z.max_live_parameters, z.max_reuse_distance),
        (500_000_000, 600_000_000)
    );
    assert!(z.gather_16bit_weights_on_model_save && z.round_robin_gradients);
    assert_eq!(z.sub_group_size, 100_000_000);
    let oo = &z.offload_optimizer;
    assert_eq!(oo.device, OffloadDevice::Nvme);
    assert_eq!(oo.nvme_path, Some(PathBuf::from("/local_nvme")));
    assert!(oo.pin_memory && oo.pipeline_read && oo.pipeline_write && oo.fast_init);
    assert_eq!((oo.buffer_count, oo.ratio), (8, 0.5));
    let op = &z.offload_param;
    assert_eq!(op.device, OffloadDevice::Nvme);
    assert_eq!(
        (op.buffer_count, op.buffer_size, op.max_in_cpu),
        (6, 200_000_000, 2_000_000_000)
    );
    // intra_op_parallelism wins over thread_count, as in DeepSpeed.
    assert_eq!(
        (z.aio.block_size, z.aio.queue_depth, z.aio.thread_count),
        (262_144, 32, 4)
    );
    assert!(z.aio.single_submit && !z.aio.overlap_events && z.aio.use_gds);
    assert_eq!(cfg.communication_data_type, DType::BF16);
    assert_eq!(cfg.grad_accum_dtype, DType::BF16);
}

#[test]
fn dtype_spellings() {
    for (s, d) in [
        ("fp32", DType::F32),
        ("float32", DType::F32),
        ("fp16", DType::F16),
        ("float16", DType::F16),
        ("bf16", DType::BF16),
        ("bfloat16", DType::BF16),
        ("BF16", DType::BF16),
    ] {
        let json = format!(
            r#"{{ "train_batch_size": 1, "communication_data_type": "{s}",
                  "data_types": {{ "grad_accum_dtype": "{s}" }} }}"#
        );
        let cfg = resolve(&json, &world(1));
        assert_eq!((cfg.communication_data_type, cfg.grad_accum_dtype), (d, d));
    }
}

#[test]
fn aliases() {
    let json = r#"{ "train_batch_size": 1, "bfloat16": { "enabled": true },
                    "zero_optimization": { "stage": 3, "stage3_gather_fp16_weights_on_model_save": true } }"#;
    let (doc, warnings) = parse(json);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("zero_optimization.stage3_gather_fp16_weights_on_model_save"));
    assert!(warnings[0].contains("deprecated"));
    let cfg = doc.resolve(&world(1)).unwrap();
    assert_eq!(cfg.precision, Precision::Bf16);
    assert!(cfg.zero.gather_16bit_weights_on_model_save);

    let json = r#"{ "zero_optimization": { "stage3_gather_16bit_weights_on_model_save": true,
                                            "stage3_gather_fp16_weights_on_model_save": false } }"#;
    let text = parse_err(json);
    assert!(
        text.contains("zero_optimization.stage3_gather_16bit_weights_on_model_save"),
        "{text}"
    );
}

// ---------------------------------------------------------------------------
// Warnings and type errors
// ---------------------------------------------------------------------------

#[test]
fn typos_warn_with_the_full_path_when_not_strict() {
    let json = r#"{
      "strict": false,
      "train_batch_size": 8,
      "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_sise": 1e8,
        "offload_param": { "device": "cpu", "pin_memroy": true }
      },
      "fp16": { "enabeld": true },
      "optimiser": {}
    }"#;
    let (_, warnings) = parse(json);
    let all = warnings.join("\n");
    for path in [
        "unknown key zero_optimization.stage3_prefetch_bucket_sise (ignored)",
        "unknown key zero_optimization.offload_param.pin_memroy (ignored)",
        "unknown key fp16.enabeld (ignored)",
        "unknown key optimiser (ignored)",
    ] {
        assert!(all.contains(path), "{all}");
    }
    assert!(
        all.contains("did you mean `stage3_prefetch_bucket_size`?"),
        "{all}"
    );
    assert!(all.contains("did you mean `pin_memory`?"), "{all}");
    assert_eq!(warnings.len(), 4, "{all}");
}

/// The `strict` default: an unknown key inside any section is an error
/// naming the key (its full path) and the section.
#[test]
fn unknown_keys_inside_sections_are_errors() {
    let cases = [
        (
            r#"{ "zero_optimization": { "stage": 3, "stage3_prefetch_bucket_sise": 1e8 } }"#,
            "zero_optimization.stage3_prefetch_bucket_sise",
            "zero_optimization",
            Some("did you mean `stage3_prefetch_bucket_size`?"),
        ),
        (
            r#"{ "zero_optimization": { "offload_param": { "device": "cpu", "pin_memroy": true } } }"#,
            "zero_optimization.offload_param.pin_memroy",
            "zero_optimization.offload_param",
            Some("did you mean `pin_memory`?"),
        ),
        (
            r#"{ "fp16": { "enabeld": true } }"#,
            "fp16.enabeld",
            "fp16",
            Some("`enabled`"),
        ),
        (
            r#"{ "bf16": { "enabled": true, "colour": 1 } }"#,
            "bf16.colour",
            "bf16",
            None,
        ),
        (
            r#"{ "optimizer": { "type": "AdamW", "prams": {} } }"#,
            "optimizer.prams",
            "optimizer",
            Some("`params`"),
        ),
        (
            r#"{ "optimizer": { "params": { "lr": 1e-3, "momentum": 0.9 } } }"#,
            "optimizer.params.momentum",
            "optimizer.params",
            None,
        ),
        (
            r#"{ "scheduler": { "type": "WarmupLR", "params": { "warmup_step": 10 } } }"#,
            "scheduler.params.warmup_step",
            "scheduler.params",
            None,
        ),
        (
            r#"{ "aio": { "block_size": 4096, "queue_dept": 8 } }"#,
            "aio.queue_dept",
            "aio",
            Some("`queue_depth`"),
        ),
        (
            r#"{ "data_types": { "grad_acum_dtype": "fp32" } }"#,
            "data_types.grad_acum_dtype",
            "data_types",
            Some("`grad_accum_dtype`"),
        ),
        // DeepSpeed's own name for a key zero reads under its alias.
        (
            r#"{ "zero_optimization": { "prefetch_bucket_size": 1e8 } }"#,
            "zero_optimization.prefetch_bucket_size",
            "zero_optimization",
            Some("zero only as `stage3_prefetch_bucket_size`"),
        ),
    ];
    for (json, key, section, hint) in cases {
        let e = parse_err(json);
        assert!(
            e.starts_with(&format!(
                "config key `{key}`: unknown key in section `{section}`"
            )) && e.contains(r#"set "strict": false"#),
            "{e}"
        );
        if let Some(h) = hint {
            assert!(e.contains(h), "{e}");
        }
        // `"strict": false` keeps them warnings.
        let lax = json.replacen('{', r#"{ "strict": false, "#, 1);
        let (_, warnings) = parse(&lax);
        assert!(
            warnings.len() == 1 && warnings[0].starts_with(&format!("unknown key {key} (ignored)")),
            "{warnings:?}"
        );
    }
    let e = parse_err(r#"{ "strict": "no" }"#);
    assert!(
        e.contains("config key `strict`: expected true or false"),
        "{e}"
    );
}

/// A top-level key one typo away from a key zero reads is an error naming
/// both (`zero_optimizaton` would otherwise train at stage 0); other
/// unknown top-level keys (DeepSpeed ignores them) stay warnings, DeepSpeed
/// keys zero does not use are accepted with a warning, and every warning
/// travels with the document into the resolved config.
#[test]
fn a_top_level_typo_of_a_known_key_is_an_error() {
    for (typo, known) in [
        ("zero_optimizaton", "zero_optimization"),
        ("optimiser", "optimizer"),
        ("gradient_acumulation_steps", "gradient_accumulation_steps"),
        ("bf_16", "bf16"),
    ] {
        let json = format!(r#"{{ "{typo}": {{ "stage": 3 }} }}"#);
        let e = parse_err(&json);
        assert!(
            e.starts_with(&format!(
                "config key `{typo}`: unknown top-level key, one typo away from `{known}`"
            )) && e.contains(r#"set "strict": false"#),
            "{e}"
        );
        let lax = format!(r#"{{ "strict": false, "{typo}": {{ "stage": 3 }} }}"#);
        let (doc, warnings) = parse(&lax);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains(&format!("did you mean `{known}`?")),
            "{warnings:?}"
        );
        assert_eq!(doc.strict, Some(false));
    }
    // Not typos: a name of one's own, and `amp` (a DeepSpeed key two edits
    // from the short `aio`).
    let json = r#"{ "my_trainer_notes": "x", "amp": { "enabled": false },
                    "train_micro_batch_size_per_gpu": 4,
                    "zero_optimization": { "stage": 2, "zero_quantized_weights": false } }"#;
    let (doc, warnings) = parse(json);
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(
        warnings
            .iter()
            .any(|w| w == "unknown key my_trainer_notes (ignored)"),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("unknown key amp (ignored)")),
        "{warnings:?}"
    );
    assert!(
        warnings.iter().any(
            |w| w == "key zero_optimization.zero_quantized_weights: accepted, not used by zero"
        ),
        "{warnings:?}"
    );
    assert_eq!(&doc.warnings[..], &warnings[..]);
    let cfg = doc.resolve(&typical()).unwrap();
    assert_eq!(&cfg.warnings[..], &warnings[..]);
    // Warnings are no part of the config's identity.
    let (plain, _) =
        parse(r#"{ "train_micro_batch_size_per_gpu": 4, "zero_optimization": { "stage": 2 } }"#);
    assert_eq!(plain.resolve(&typical()).unwrap(), cfg);
}

#[test]
fn accepted_but_unused_keys() {
    let json = r#"{ "train_batch_size": 8, "steps_per_print": 100, "wall_clock_breakdown": false,
                    "tensorboard": { "enabled": true }, "seed": 42, "prescale_gradients": false }"#;
    let (doc, warnings) = parse(json);
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    for k in ["tensorboard", "seed", "prescale_gradients"] {
        assert!(
            warnings
                .iter()
                .any(|w| w.contains(k) && w.contains("accepted, not used by zero")),
            "{warnings:?}"
        );
    }
    assert!(!warnings.iter().any(|w| w.contains("steps_per_print")));
    assert_eq!(doc.accepted_unused.len(), 5);
    // Kept, so that printing the document shows them.
    let (again, _) = parse(&serde_json::to_string(&doc).unwrap());
    assert_eq!(again, doc);
}

#[test]
fn integers_accept_integral_floats() {
    let (doc, _) = parse(r#"{ "zero_optimization": { "reduce_bucket_size": 2e8, "stage": 2.0 } }"#);
    let z = doc.zero_optimization.unwrap();
    assert_eq!(z.reduce_bucket_size, Some(Auto::Value(200_000_000)));
    assert_eq!(z.stage, Some(2));
}

#[test]
fn type_errors_name_the_key() {
    let cases = [
        (
            r#"{ "zero_optimization": { "stage": "three" } }"#,
            "zero_optimization.stage",
            r#"expected an integer 0..=3, got "three""#,
        ),
        (
            r#"{ "zero_optimization": { "reduce_bucket_size": 2.5 } }"#,
            "zero_optimization.reduce_bucket_size",
            "got 2.5",
        ),
        (
            r#"{ "zero_optimization": { "allgather_bucket_size": -5 } }"#,
            "zero_optimization.allgather_bucket_size",
            "got -5",
        ),
        (
            r#"{ "train_batch_size": true }"#,
            "train_batch_size",
            "got true",
        ),
        (
            r#"{ "train_micro_batch_size_per_gpu": 2.5 }"#,
            "train_micro_batch_size_per_gpu",
            r#"a positive integer or "auto", got 2.5"#,
        ),
        (
            r#"{ "zero_optimization": { "overlap_comm": "true" } }"#,
            "zero_optimization.overlap_comm",
            "expected true or false",
        ),
        (
            r#"{ "fp16": { "enabled": 1 } }"#,
            "fp16.enabled",
            "expected true or false",
        ),
        (
            r#"{ "optimizer": { "params": { "betas": [0.9] } } }"#,
            "optimizer.params.betas",
            "an array of two numbers",
        ),
        (
            r#"{ "optimizer": { "params": { "lr": "0.1" } } }"#,
            "optimizer.params.lr",
            "expected a number",
        ),
        (
            r#"{ "zero_optimization": { "offload_optimizer": { "device": 1 } } }"#,
            "zero_optimization.offload_optimizer.device",
            "\"cpu\"",
        ),
        (
            r#"{ "zero_optimization": { "offload_param": { "buffer_size": 1.5 } } }"#,
            "zero_optimization.offload_param.buffer_size",
            "got 1.5",
        ),
        (
            r#"{ "aio": { "queue_depth": "deep" } }"#,
            "aio.queue_depth",
            "integer",
        ),
        (
            r#"{ "zero_optimization": 1 }"#,
            "zero_optimization",
            "expected an object",
        ),
        (
            r#"{ "scheduler": { "params": { "warmup_num_steps": 1e2, "total_num_steps": 10.5 } } }"#,
            "scheduler.params.total_num_steps",
            "got 10.5",
        ),
    ];
    for (json, key, words) in cases {
        let text = parse_err(json);
        assert!(text.contains(&format!("`{key}`")), "{json}: {text}");
        assert!(text.contains(words), "{json}: `{text}` lacks `{words}`");
    }
}

#[test]
fn json_syntax_errors_give_line_and_column() {
    let err = DeepSpeedConfig::from_json_str("{\n  \"stage\": 1,\n}").unwrap_err();
    let Error::Config { key, msg } = &err else {
        panic!("{err}")
    };
    assert_eq!(key, "<document>");
    assert!(msg.contains("line 3"), "{msg}");
    assert!(msg.contains("column"), "{msg}");
    assert!(parse_err("[1, 2]").contains("<document>"));
}

#[test]
fn null_counts_as_absent() {
    let (doc, warnings) = parse(r#"{ "zero_optimization": { "stage": 3, "overlap_comm": null } }"#);
    assert!(warnings.is_empty());
    assert_eq!(doc.zero_optimization.unwrap().overlap_comm, None);
}

// ---------------------------------------------------------------------------
// "auto"
// ---------------------------------------------------------------------------

#[test]
fn each_auto_key_without_a_trainer_value_is_an_error() {
    let cases = [
        (r#""gradient_clipping": "auto""#, "gradient_clipping"),
        (r#""fp16": { "enabled": "auto" }"#, "fp16.enabled"),
        (r#""bf16": { "enabled": "auto" }"#, "bf16.enabled"),
        (
            r#""optimizer": { "type": "AdamW", "params": { "lr": "auto" } }"#,
            "optimizer.params.lr",
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "betas": "auto" } }"#,
            "optimizer.params.betas",
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "eps": "auto" } }"#,
            "optimizer.params.eps",
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "weight_decay": "auto" } }"#,
            "optimizer.params.weight_decay",
        ),
        (
            r#""scheduler": { "type": "WarmupLR", "params": { "warmup_min_lr": "auto" } }"#,
            "scheduler.params.warmup_min_lr",
        ),
        (
            r#""scheduler": { "type": "WarmupLR", "params": { "warmup_max_lr": "auto" } }"#,
            "scheduler.params.warmup_max_lr",
        ),
        (
            r#""scheduler": { "type": "WarmupLR", "params": { "warmup_num_steps": "auto" } }"#,
            "scheduler.params.warmup_num_steps",
        ),
        (
            r#""scheduler": { "type": "WarmupDecayLR", "params": { "total_num_steps": "auto" } }"#,
            "scheduler.params.total_num_steps",
        ),
        (
            r#""zero_optimization": { "reduce_bucket_size": "auto" }"#,
            "zero_optimization.reduce_bucket_size",
        ),
        (
            r#""zero_optimization": { "stage3_prefetch_bucket_size": "auto" }"#,
            "zero_optimization.stage3_prefetch_bucket_size",
        ),
        (
            r#""zero_optimization": { "stage3_param_persistence_threshold": "auto" }"#,
            "zero_optimization.stage3_param_persistence_threshold",
        ),
    ];
    for (fragment, key) in cases {
        let json = format!(r#"{{ "train_micro_batch_size_per_gpu": 1, {fragment} }}"#);
        assert_resolve_err(&json, &world(1), key, &["\"auto\"", "no value"]);
    }
    // The batch keys: "auto" without a value is derived when it can be...
    let json = r#"{ "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": "auto" }"#;
    let cfg = resolve(json, &world(2));
    assert_eq!(
        (
            cfg.train_batch_size,
            cfg.micro_batch_size,
            cfg.gradient_accumulation_steps
        ),
        (4, 2, 1)
    );
    // ... and an error naming the key when it cannot.
    assert_resolve_err(
        r#"{ "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto" }"#,
        &world(2),
        "train_micro_batch_size_per_gpu",
        &["\"auto\"", "no value"],
    );
    assert_resolve_err(
        r#"{ "train_batch_size": "auto" }"#,
        &world(2),
        "train_batch_size",
        &["\"auto\"", "no value"],
    );
}

#[test]
fn auto_values_fill_only_auto_keys() {
    let json = r#"{ "train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0,
                    "optimizer": { "type": "AdamW", "params": { "lr": 0.25 } } }"#;
    let cfg = resolve(json, &typical());
    assert_eq!(cfg.micro_batch_size, 3);
    assert_eq!(cfg.gradient_clipping, 0.0);
    assert_eq!(cfg.optimizer.lr, 0.25);
    // sub_group_size and the gather flag: "auto" means the default.
    let json = r#"{ "train_batch_size": 1, "zero_optimization": { "stage": 3,
                    "sub_group_size": "auto", "stage3_gather_16bit_weights_on_model_save": "auto" } }"#;
    let z = resolve(json, &world(1)).zero;
    assert_eq!(z.sub_group_size, 1_000_000_000);
    assert!(!z.gather_16bit_weights_on_model_save);
}

// ---------------------------------------------------------------------------
// Batch sizes
// ---------------------------------------------------------------------------

fn batch(json: &str, world_size: usize) -> (usize, usize, usize) {
    let cfg = resolve(json, &world(world_size));
    (
        cfg.train_batch_size,
        cfg.micro_batch_size,
        cfg.gradient_accumulation_steps,
    )
}

#[test]
fn batch_sizes_are_derived() {
    let t = r#""train_batch_size": 48"#;
    let m = r#""train_micro_batch_size_per_gpu": 4"#;
    let g = r#""gradient_accumulation_steps": 3"#;
    assert_eq!(batch(&format!("{{ {t}, {m}, {g} }}"), 4), (48, 4, 3));
    assert_eq!(batch(&format!("{{ {t}, {m} }}"), 4), (48, 4, 3));
    assert_eq!(batch(&format!("{{ {t}, {g} }}"), 4), (48, 4, 3));
    assert_eq!(batch(&format!("{{ {m}, {g} }}"), 4), (48, 4, 3));
    assert_eq!(batch(&format!("{{ {t} }}"), 4), (48, 12, 1));
    assert_eq!(batch(&format!("{{ {m} }}"), 4), (16, 4, 1));
    // The trainer's values fill "auto".
    let json = r#"{ "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                    "gradient_accumulation_steps": "auto" }"#;
    let auto = AutoValues {
        world_size: 2,
        train_batch_size: Some(32),
        micro_batch_size: Some(8),
        gradient_accumulation_steps: Some(2),
        ..AutoValues::default()
    };
    let cfg = resolve(json, &auto);
    assert_eq!(
        (
            cfg.train_batch_size,
            cfg.micro_batch_size,
            cfg.gradient_accumulation_steps
        ),
        (32, 8, 2)
    );
}

#[test]
fn inconsistent_batch_sizes_are_errors() {
    let json = r#"{ "train_batch_size": 50, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 3 }"#;
    assert_resolve_err(
        json,
        &world(4),
        "train_batch_size",
        &[
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "50",
            "4",
            "3",
        ],
    );
    // Not divisible: no micro batch size gives train 10 on 4 ranks.
    assert_resolve_err(
        r#"{ "train_batch_size": 10 }"#,
        &world(4),
        "train_micro_batch_size_per_gpu",
        &["train_batch_size", "gradient_accumulation_steps", "10"],
    );
    assert_resolve_err(
        r#"{ "train_batch_size": 10, "train_micro_batch_size_per_gpu": 3 }"#,
        &world(2),
        "gradient_accumulation_steps",
        &[
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "10",
            "3",
        ],
    );
    // Too small for the world size.
    assert_resolve_err(
        r#"{ "train_batch_size": 2 }"#,
        &world(4),
        "train_micro_batch_size_per_gpu",
        &["world_size 4"],
    );
    assert_resolve_err(
        r#"{ "train_micro_batch_size_per_gpu": 0 }"#,
        &world(1),
        "train_micro_batch_size_per_gpu",
        &[">= 1"],
    );
}

#[test]
fn missing_batch_sizes_are_an_error() {
    for json in ["{}", r#"{ "gradient_accumulation_steps": 2 }"#] {
        let text = resolve_err(json, &world(2)).to_string();
        assert!(
            text.contains("train_batch_size") && text.contains("train_micro_batch_size_per_gpu"),
            "{text}"
        );
    }
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

#[test]
fn validation_rules_name_the_key() {
    // (fragment added to a valid config, key, words in the message)
    let cases: &[(&str, &str, &[&str])] = &[
        (
            r#""zero_optimization": { "stage": 4 }"#,
            "zero_optimization.stage",
            &["0..=3", "4"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "betas": [1.0, 0.999] } }"#,
            "optimizer.params.betas",
            &["[0, 1)"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "betas": [0.9, -0.1] } }"#,
            "optimizer.params.betas",
            &["[0, 1)"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "eps": 0 } }"#,
            "optimizer.params.eps",
            &["> 0"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "lr": -1e-3 } }"#,
            "optimizer.params.lr",
            &[">= 0"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "weight_decay": -0.1 } }"#,
            "optimizer.params.weight_decay",
            &[">= 0"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "bias_correction": false } }"#,
            "optimizer.params.bias_correction",
            &["true"],
        ),
        (
            r#""optimizer": { "type": "Adam", "params": { "adam_w_mode": false } }"#,
            "optimizer.params.adam_w_mode",
            &["decoupled weight decay"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "amsgrad": true } }"#,
            "optimizer.params.amsgrad",
            &["false"],
        ),
        (
            r#""optimizer": { "type": "AdamW", "params": { "max_grad_norm": 1.0 } }"#,
            "optimizer.params.max_grad_norm",
            &["gradient_clipping"],
        ),
        (
            r#""optimizer": { "type": "SGD" }"#,
            "optimizer.type",
            &["\"SGD\"", "\"AdamW\"", "\"Adam\""],
        ),
        (
            r#""optimizer": {}"#,
            "optimizer.type",
            &["missing", "\"AdamW\""],
        ),
        (
            r#""gradient_clipping": -1.0"#,
            "gradient_clipping",
            &[">= 0"],
        ),
        (
            r#""zero_optimization": { "reduce_bucket_size": 0 }"#,
            "zero_optimization.reduce_bucket_size",
            &[">= 1"],
        ),
        (
            r#""zero_optimization": { "allgather_bucket_size": 0 }"#,
            "zero_optimization.allgather_bucket_size",
            &[">= 1"],
        ),
        (
            r#""zero_optimization": { "sub_group_size": 0 }"#,
            "zero_optimization.sub_group_size",
            &[">= 1"],
        ),
        (
            r#""fp16": { "hysteresis": 0 }"#,
            "fp16.hysteresis",
            &[">= 1"],
        ),
        (
            r#""fp16": { "loss_scale_window": 0 }"#,
            "fp16.loss_scale_window",
            &[">= 1"],
        ),
        (
            r#""fp16": { "min_loss_scale": 0 }"#,
            "fp16.min_loss_scale",
            &["> 0"],
        ),
        (
            r#""fp16": { "initial_scale_power": 65 }"#,
            "fp16.initial_scale_power",
            &["0..=64", "65"],
        ),
        (
            r#""fp16": { "loss_scale": -1 }"#,
            "fp16.loss_scale",
            &[">= 0"],
        ),
        (
            r#""fp16": { "enabled": true }, "bf16": { "enabled": true }"#,
            "fp16.enabled",
            &["bf16.enabled"],
        ),
        (
            r#""scheduler": { "type": "WarmupDecayLR" }"#,
            "scheduler.params.total_num_steps",
            &["required", "WarmupDecayLR"],
        ),
        (
            r#""scheduler": { "type": "WarmupCosineLR", "params": { "warmup_num_steps": 10 } }"#,
            "scheduler.params.total_num_steps",
            &["required", "WarmupCosineLR"],
        ),
        (
            r#""scheduler": { "type": "WarmupDecayLR",
                "params": { "warmup_num_steps": 100, "total_num_steps": 50 } }"#,
            "scheduler.params.total_num_steps",
            &["warmup_num_steps", "100", "50"],
        ),
        (
            r#""scheduler": { "type": "WarmupCosineLR",
                "params": { "warmup_num_steps": 100, "total_num_steps": 99 } }"#,
            "scheduler.params.total_num_steps",
            &["warmup_num_steps", "100", "99"],
        ),
        (
            r#""scheduler": { "type": "WarmupLR", "params": { "warmup_num_steps": 0 } }"#,
            "scheduler.params.warmup_num_steps",
            &[">= 1"],
        ),
        (
            r#""scheduler": { "type": "WarmupLR", "params": { "warmup_max_lr": -1 } }"#,
            "scheduler.params.warmup_max_lr",
            &[">= 0"],
        ),
        (
            r#""scheduler": { "type": "WarmupLR", "params": { "warmup_type": "exp" } }"#,
            "scheduler.params.warmup_type",
            &["\"exp\"", "\"log\"", "\"linear\""],
        ),
        (
            r#""scheduler": { "type": "OneCycle" }"#,
            "scheduler.type",
            &[
                "\"OneCycle\"",
                "\"WarmupLR\"",
                "\"WarmupDecayLR\"",
                "\"WarmupCosineLR\"",
            ],
        ),
        (
            r#""scheduler": { "type": "WarmupLR", "params": { "cos_min_ratio": 0.1 } }"#,
            "scheduler.params.cos_min_ratio",
            &["WarmupLR"],
        ),
        (
            r#""scheduler": { "type": "WarmupCosineLR",
                "params": { "total_num_steps": 2000, "cos_min_ratio": 1.5 } }"#,
            "scheduler.params.cos_min_ratio",
            &["[0, 1]"],
        ),
        (
            r#""zero_optimization": { "stage": 2, "offload_param": { "device": "cpu" } }"#,
            "zero_optimization.offload_param",
            &["stage 3"],
        ),
        (
            r#""zero_optimization": { "offload_optimizer": { "device": "cpu" } }"#,
            "zero_optimization.offload_optimizer",
            &["stage 1, 2 or 3"],
        ),
        (
            r#""zero_optimization": { "stage": 2, "offload_optimizer": { "device": "nvme" } }"#,
            "zero_optimization.offload_optimizer.nvme_path",
            &["nvme"],
        ),
        (
            r#""zero_optimization": { "stage": 3, "offload_param": { "device": "nvme" } }"#,
            "zero_optimization.offload_param.nvme_path",
            &["nvme"],
        ),
        (
            r#""zero_optimization": { "stage": 2, "offload_optimizer": { "device": "gpu" } }"#,
            "zero_optimization.offload_optimizer.device",
            &["\"gpu\"", "\"none\"", "\"cpu\"", "\"nvme\""],
        ),
        (
            r#""zero_optimization": { "stage": 3, "offload_param": { "device": "disk" } }"#,
            "zero_optimization.offload_param.device",
            &["\"disk\"", "\"cpu\""],
        ),
        (
            r#""zero_optimization": { "stage": 2, "offload_optimizer": { "device": "cpu", "ratio": 0.5 } }"#,
            "zero_optimization.offload_optimizer.ratio",
            &["stage 3"],
        ),
        (
            r#""zero_optimization": { "stage": 3, "offload_optimizer": { "device": "cpu", "ratio": 1.5 } }"#,
            "zero_optimization.offload_optimizer.ratio",
            &["[0, 1]"],
        ),
        (
            r#""zero_optimization": { "stage": 2, "offload_optimizer": { "buffer_count": 0 } }"#,
            "zero_optimization.offload_optimizer.buffer_count",
            &[">= 1"],
        ),
        (r#""aio": { "block_size": 0 }"#, "aio.block_size", &[">= 1"]),
        (
            r#""aio": { "queue_depth": 0 }"#,
            "aio.queue_depth",
            &[">= 1"],
        ),
        (
            r#""aio": { "intra_op_parallelism": 0 }"#,
            "aio.intra_op_parallelism",
            &[">= 1"],
        ),
        (
            r#""communication_data_type": "int8""#,
            "communication_data_type",
            &["\"int8\"", "\"fp32\"", "\"fp16\"", "\"bf16\""],
        ),
        (
            r#""data_types": { "grad_accum_dtype": "fp8" }"#,
            "data_types.grad_accum_dtype",
            &["\"fp8\"", "\"fp32\""],
        ),
    ];
    for (fragment, key, words) in cases {
        let json = format!(r#"{{ "train_batch_size": 8, {fragment} }}"#);
        assert_resolve_err(&json, &world(2), key, words);
    }
}

#[test]
fn non_finite_values_are_errors() {
    // JSON has no infinities; they can come from the trainer or from code.
    let json = r#"{ "train_batch_size": 8, "gradient_clipping": "auto",
                    "optimizer": { "type": "AdamW", "params": { "lr": "auto" } } }"#;
    let auto = AutoValues {
        lr: Some(f64::NAN),
        gradient_clipping: Some(1.0),
        ..world(2)
    };
    assert_resolve_err(json, &auto, "optimizer.params.lr", &["finite"]);
    let auto = AutoValues {
        lr: Some(1.0),
        gradient_clipping: Some(f64::INFINITY),
        ..world(2)
    };
    assert_resolve_err(json, &auto, "gradient_clipping", &["finite"]);
}

#[test]
fn world_size_zero_is_an_error() {
    assert_resolve_err(
        r#"{ "train_batch_size": 8 }"#,
        &world(0),
        "world_size",
        &["0"],
    );
}

#[test]
fn validation_accepts_the_edges() {
    let json = r#"{ "train_batch_size": 1,
        "gradient_clipping": 0,
        "optimizer": { "type": "AdamW", "params": { "lr": 0, "betas": [0, 0.9999], "weight_decay": 0 } },
        "fp16": { "enabled": true, "hysteresis": 1, "loss_scale_window": 1, "initial_scale_power": 64 },
        "zero_optimization": { "stage": 3, "stage3_prefetch_bucket_size": 0, "sub_group_size": 1,
                               "offload_param": { "device": "none" },
                               "offload_optimizer": { "device": "cpu", "ratio": 0.0 } } }"#;
    let cfg = resolve(json, &world(1));
    assert_eq!(cfg.gradient_clipping, 0.0);
    assert_eq!(cfg.zero.prefetch_bucket_size, 0);
    assert_eq!(cfg.zero.offload_optimizer.ratio, 0.0);
}

// ---------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------

#[test]
fn document_round_trips_through_json() {
    for json in [STAGE0, STAGE1, STAGE2_OFFLOAD, STAGE3_OFFLOAD, FULL] {
        let (doc, _) = parse(json);
        let text = serde_json::to_string_pretty(&doc).unwrap();
        let (again, warnings) = parse(&text);
        if json == FULL {
            assert_only_unused_aio_modes(&warnings);
        } else {
            assert!(warnings.is_empty(), "{warnings:?}");
        }
        assert_eq!(again, doc, "{text}");
        // serde's Deserialize reads the same way.
        let via_serde: DeepSpeedConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(via_serde, doc);
        let via_serde: DeepSpeedConfig = serde_json::from_str(json).unwrap();
        assert_eq!(via_serde, doc);
    }
    // "auto" stays "auto".
    let (doc, _) = parse(STAGE3_OFFLOAD);
    let value = serde_json::to_value(&doc).unwrap();
    assert_eq!(value["zero_optimization"]["reduce_bucket_size"], "auto");
    assert_eq!(
        value["zero_optimization"]["sub_group_size"],
        1_000_000_000u64
    );
    assert_eq!(DeepSpeedConfig::default(), parse("{}").0);
}

#[test]
fn serde_deserialize_reports_the_key() {
    let err =
        serde_json::from_str::<DeepSpeedConfig>(r#"{ "zero_optimization": { "stage": "x" } }"#)
            .unwrap_err();
    assert!(err.to_string().contains("zero_optimization.stage"), "{err}");
}

#[test]
fn resolved_config_prints_and_reads_back() {
    for cfg in [
        resolve(FULL, &world(4)),
        resolve(STAGE3_OFFLOAD, &typical()),
        ResolvedConfig::simple(2, 8, 1),
    ] {
        let text = cfg.to_json_pretty();
        assert!(text.contains("\"reduce_bucket_size\""), "{text}");
        let back: ResolvedConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(back, cfg);
    }
    let text = ResolvedConfig::simple(0, 1, 1).to_json_pretty();
    assert!(
        text.contains(r#""communication_data_type": "f32""#),
        "{text}"
    );
    assert!(text.contains(r#""precision": "fp32""#), "{text}");
}

#[test]
fn simple_matches_the_defaults() {
    for stage in 0..=3u8 {
        let json = format!(
            r#"{{ "train_micro_batch_size_per_gpu": 3, "zero_optimization": {{ "stage": {stage} }} }}"#
        );
        assert_eq!(
            resolve(&json, &world(2)),
            ResolvedConfig::simple(stage, 2, 3)
        );
    }
}
