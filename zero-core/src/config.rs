//! DeepSpeed-compatible configuration, with documented defaults and one
//! place of validation.
//!
//! A user's existing `ds_config.json` works as it is. Configuration comes in
//! two layers:
//!
//! - [`DeepSpeedConfig`]: the document as written. Every field is optional,
//!   numeric and boolean fields that a trainer fills may be `"auto"`
//!   ([`Auto`]), and enum-like values stay strings. It round-trips to JSON.
//!   [`DeepSpeedConfig::from_json_str`] checks types (every error names the
//!   key path) and refuses keys it does not know inside a section (as
//!   DeepSpeed's config models do) and top-level keys one typo away from a
//!   key it reads, so a typo such as `stage3_prefetch_bucket_sise` or
//!   `zero_optimizaton` never passes silently; zero's own top-level key
//!   `"strict": false` makes them warnings. Other unknown top-level keys
//!   (DeepSpeed ignores them) are warnings.
//! - [`ResolvedConfig`]: every value concrete. [`DeepSpeedConfig::resolve`]
//!   fills `"auto"` from [`AutoValues`] (what the trainer knows), applies the
//!   defaults, and validates ranges and combinations. It is the only place
//!   where values are validated.
//!
//! ```
//! use zero_core::config::{AutoValues, DeepSpeedConfig, OffloadDevice};
//!
//! let typo = r#"{ "zero_optimization": { "stage": 3, "stage3_prefetch_bucket_sise": 5e7 } }"#;
//! let err = DeepSpeedConfig::from_json_str(typo).unwrap_err().to_string();
//! assert!(err.starts_with("config key `zero_optimization.stage3_prefetch_bucket_sise`: \
//!                          unknown key in section `zero_optimization`; \
//!                          did you mean `stage3_prefetch_bucket_size`?"), "{err}");
//!
//! let json = r#"{
//!     "strict": false,
//!     "train_micro_batch_size_per_gpu": "auto",
//!     "gradient_accumulation_steps": 2,
//!     "bf16": { "enabled": true },
//!     "zero_optimization": {
//!         "stage": 3,
//!         "offload_optimizer": { "device": "cpu", "pin_memory": true },
//!         "reduce_bucket_size": 2e8,
//!         "stage3_prefetch_bucket_sise": 5e7
//!     }
//! }"#;
//! let (doc, warnings) = DeepSpeedConfig::from_json_str(json)?;
//! assert_eq!(
//!     warnings[0],
//!     "unknown key zero_optimization.stage3_prefetch_bucket_sise (ignored); \
//!      did you mean `stage3_prefetch_bucket_size`?"
//! );
//! let auto = AutoValues { world_size: 4, micro_batch_size: Some(8), ..Default::default() };
//! let cfg = doc.resolve(&auto)?;
//! assert_eq!(cfg.train_batch_size, 64);
//! assert_eq!(cfg.zero.reduce_bucket_size, 200_000_000);
//! assert_eq!(cfg.zero.offload_optimizer.device, OffloadDevice::Cpu);
//! assert!(cfg.zero.overlap_comm); // DeepSpeed's default for stage 3
//! println!("{}", cfg.to_json_pretty());
//! # Ok::<(), zero_core::Error>(())
//! ```
//!
//! # Where zero differs from DeepSpeed
//!
//! - Without an `optimizer` block DeepSpeed has no optimizer of its own (the
//!   user passes a torch one); zero then uses `torch.optim.AdamW`'s
//!   defaults. Inside an `optimizer` block, missing parameters take
//!   DeepSpeed's `FusedAdam` defaults. Only AdamW (decoupled weight decay,
//!   bias correction, no AMSGrad) is implemented.
//! - `communication_data_type` defaults to fp32: DeepSpeed communicates in
//!   the parameter dtype, zero reduces gradients in fp32 so that the
//!   reduction is exact and reproducible.
//! - For the three batch keys an `"auto"` that the trainer did not fill counts
//!   as absent and is derived from the other two, as the HF integration does.
//! - Schedules whose warm-up is longer than the whole run, scheduler
//!   parameters that the chosen scheduler does not take, and unknown
//!   `warmup_type` strings are errors (DeepSpeed warns or raises a
//!   `TypeError` at start-up).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::optim::{AdamWParams, LossScaleConfig, LrSchedule, WarmupType};
use crate::{DType, Error, Result};

// ---------------------------------------------------------------------------
// Defaults (DeepSpeed's code defaults unless stated otherwise).
// ---------------------------------------------------------------------------

const DEFAULT_GRADIENT_CLIPPING: f64 = 1.0;
const DEFAULT_LR: f64 = 1e-3;
const DEFAULT_BETAS: (f64, f64) = (0.9, 0.999);
const DEFAULT_EPS: f64 = 1e-8;
/// `FusedAdam`/`DeepSpeedCPUAdam` default, used inside an `optimizer` block.
const DEFAULT_WEIGHT_DECAY_DEEPSPEED: f64 = 0.0;
/// `torch.optim.AdamW` default, used when there is no `optimizer` block.
const DEFAULT_WEIGHT_DECAY_TORCH: f64 = 0.01;

const DEFAULT_LOSS_SCALE: f64 = 0.0;
const DEFAULT_INITIAL_SCALE_POWER: u64 = 16;
const DEFAULT_LOSS_SCALE_WINDOW: u64 = 1000;
const DEFAULT_HYSTERESIS: u64 = 2;
const DEFAULT_MIN_LOSS_SCALE: f64 = 1.0;

const DEFAULT_WARMUP_MIN_LR: f64 = 0.0;
const DEFAULT_WARMUP_MAX_LR: f64 = 0.001;
const DEFAULT_WARMUP_NUM_STEPS: u64 = 1000;
const DEFAULT_WARMUP_MIN_RATIO: f64 = 0.0;
const DEFAULT_COS_MIN_RATIO: f64 = 0.0001;

const DEFAULT_REDUCE_BUCKET_SIZE: usize = 500_000_000;
const DEFAULT_ALLGATHER_BUCKET_SIZE: usize = 500_000_000;
const DEFAULT_PREFETCH_BUCKET_SIZE: usize = 50_000_000;
const DEFAULT_PARAM_PERSISTENCE_THRESHOLD: usize = 100_000;
const DEFAULT_MAX_LIVE_PARAMETERS: usize = 1_000_000_000;
const DEFAULT_MAX_REUSE_DISTANCE: usize = 1_000_000_000;
const DEFAULT_SUB_GROUP_SIZE: usize = 1_000_000_000;

const DEFAULT_OPTIMIZER_BUFFER_COUNT: usize = 4;
const DEFAULT_PARAM_BUFFER_COUNT: usize = 5;
const DEFAULT_PARAM_BUFFER_SIZE: usize = 100_000_000;
const DEFAULT_PARAM_MAX_IN_CPU: usize = 1_000_000_000;
const DEFAULT_OFFLOAD_RATIO: f64 = 1.0;

const DEFAULT_AIO_BLOCK_SIZE: usize = 1_048_576;
const DEFAULT_AIO_QUEUE_DEPTH: usize = 8;
const DEFAULT_AIO_THREAD_COUNT: usize = 1;

/// Top-level keys that zero accepts and ignores without a word.
const SILENT_TOP_LEVEL_KEYS: &[&str] = &["steps_per_print", "wall_clock_breakdown"];
/// Top-level DeepSpeed keys that zero accepts and ignores with a warning.
const UNUSED_TOP_LEVEL_KEYS: &[&str] = &[
    "prescale_gradients",
    "gradient_predivide_factor",
    "zero_allow_untested_optimizer",
    "dump_state",
    "memory_breakdown",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "activation_checkpointing",
    "comms_logger",
    "seed",
];

// ---------------------------------------------------------------------------
// Auto
// ---------------------------------------------------------------------------

/// A value that may be `"auto"`: filled from the trainer by
/// [`DeepSpeedConfig::resolve`] (see [`AutoValues`]).
///
/// Serializes as the string `"auto"` or as the value itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Auto<T> {
    /// `"auto"`: the trainer fills the value.
    Auto,
    /// A value written in the config.
    Value(T),
}

impl<T> Auto<T> {
    /// Whether this is `"auto"`.
    pub fn is_auto(&self) -> bool {
        matches!(self, Auto::Auto)
    }

    /// The written value, or `None` for `"auto"`.
    pub fn value(&self) -> Option<&T> {
        match self {
            Auto::Auto => None,
            Auto::Value(v) => Some(v),
        }
    }
}

impl<T: Serialize> Serialize for Auto<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Auto::Auto => s.serialize_str("auto"),
            Auto::Value(v) => v.serialize(s),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Auto<T> {
    /// `"auto"`, or a `T`; an integer `T` also accepts a JSON float with an
    /// integral value (`2e8`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        if v.as_str() == Some("auto") {
            return Ok(Auto::Auto);
        }
        match serde_json::from_value::<T>(v.clone()) {
            Ok(t) => Ok(Auto::Value(t)),
            Err(e) => match leaf_u64(&v) {
                Some(n) if !v.is_u64() => serde_json::from_value::<T>(Value::from(n))
                    .map(Auto::Value)
                    .map_err(serde::de::Error::custom),
                _ => Err(serde::de::Error::custom(e)),
            },
        }
    }
}

// ---------------------------------------------------------------------------
// The document as written
// ---------------------------------------------------------------------------

/// A DeepSpeed JSON config as written: every key optional, `"auto"` kept.
///
/// Parse it with [`DeepSpeedConfig::from_json_str`] (which also reports
/// unknown keys) and turn it into concrete values with
/// [`DeepSpeedConfig::resolve`]. Field names are DeepSpeed's keys; the
/// defaults that apply when a key is absent are listed on
/// [`ResolvedConfig`] and its parts.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeepSpeedConfig {
    /// `train_batch_size`: samples per optimizer step over all ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_batch_size: Option<Auto<u64>>,
    /// `train_micro_batch_size_per_gpu`: samples per rank per forward/backward.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_micro_batch_size_per_gpu: Option<Auto<u64>>,
    /// `gradient_accumulation_steps`: micro-batches per optimizer step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<Auto<u64>>,
    /// `gradient_clipping`: maximum global gradient norm, 0 = off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient_clipping: Option<Auto<f64>>,
    /// `fp16`: fp16 mixed precision and loss scaling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp16: Option<Fp16Block>,
    /// `bf16` (also read from DeepSpeed's older spelling `bfloat16`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16: Option<Bf16Block>,
    /// `optimizer`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerBlock>,
    /// `scheduler`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<SchedulerBlock>,
    /// `zero_optimization`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_optimization: Option<ZeroOptimizationBlock>,
    /// `aio`: asynchronous I/O settings for NVMe offload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aio: Option<AioBlock>,
    /// `communication_data_type`: `"fp32"`, `"fp16"` or `"bf16"` (also
    /// `"float32"`, `"float16"`, `"bfloat16"`), as written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub communication_data_type: Option<String>,
    /// `data_types`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_types: Option<DataTypesBlock>,
    /// `strict` (zero's own key, default true): unknown keys inside a
    /// section, and top-level keys one typo away from a key zero reads,
    /// are errors; `false` makes them warnings. (DeepSpeed's config
    /// models refuse unknown keys inside their sections too.)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
    /// Top-level DeepSpeed keys that zero accepts but does not use
    /// (`steps_per_print`, `wall_clock_breakdown`, `tensorboard`, ...),
    /// kept as written so that printing the config shows them.
    #[serde(flatten)]
    pub accepted_unused: BTreeMap<String, Value>,
    /// The warnings of [`DeepSpeedConfig::from_json_str`], carried into
    /// [`ResolvedConfig::warnings`] by [`DeepSpeedConfig::resolve`].
    #[serde(skip)]
    pub warnings: ConfigWarnings,
}

/// The `fp16` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Fp16Block {
    /// `enabled`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<Auto<bool>>,
    /// `loss_scale`: 0 for dynamic loss scaling, > 0 for a fixed scale.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// `initial_scale_power`: the first dynamic scale is `2^initial_scale_power`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initial_scale_power: Option<u64>,
    /// `loss_scale_window`: good steps before the scale doubles.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale_window: Option<u64>,
    /// `hysteresis`: overflows tolerated before the scale halves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hysteresis: Option<u64>,
    /// `consecutive_hysteresis`: refill hysteresis on every good step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consecutive_hysteresis: Option<bool>,
    /// `min_loss_scale`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_loss_scale: Option<f64>,
}

/// The `bf16` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Bf16Block {
    /// `enabled`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<Auto<bool>>,
}

/// The `optimizer` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OptimizerBlock {
    /// `type`: `"AdamW"` or `"Adam"` (case-insensitive, as in DeepSpeed).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub optimizer_type: Option<String>,
    /// `params`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub params: Option<OptimizerParamsBlock>,
}

/// The `optimizer.params` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OptimizerParamsBlock {
    /// `lr`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<Auto<f64>>,
    /// `betas`: `[beta1, beta2]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub betas: Option<Auto<(f64, f64)>>,
    /// `eps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<Auto<f64>>,
    /// `weight_decay` (decoupled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<Auto<f64>>,
    /// `bias_correction`: must be true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias_correction: Option<bool>,
    /// `adam_w_mode`: DeepSpeed's default is true; false (L2 regularisation
    /// instead of decoupled weight decay) is rejected for `"Adam"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adam_w_mode: Option<bool>,
    /// `amsgrad`: must be false.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub amsgrad: Option<bool>,
    /// `max_grad_norm`: rejected, as by DeepSpeed; use `gradient_clipping`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_grad_norm: Option<f64>,
}

/// The `scheduler` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SchedulerBlock {
    /// `type`: `"WarmupLR"`, `"WarmupDecayLR"` or `"WarmupCosineLR"`.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub scheduler_type: Option<String>,
    /// `params`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub params: Option<SchedulerParamsBlock>,
}

/// The `scheduler.params` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SchedulerParamsBlock {
    /// `warmup_min_lr` (WarmupLR, WarmupDecayLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_min_lr: Option<Auto<f64>>,
    /// `warmup_max_lr` (WarmupLR, WarmupDecayLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_max_lr: Option<Auto<f64>>,
    /// `warmup_num_steps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_num_steps: Option<Auto<u64>>,
    /// `warmup_type`: `"log"` or `"linear"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_type: Option<String>,
    /// `total_num_steps` (WarmupDecayLR, WarmupCosineLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_num_steps: Option<Auto<u64>>,
    /// `warmup_min_ratio` (WarmupCosineLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_min_ratio: Option<f64>,
    /// `cos_min_ratio` (WarmupCosineLR).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cos_min_ratio: Option<f64>,
}

/// The `zero_optimization` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ZeroOptimizationBlock {
    /// `stage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<u64>,
    /// `contiguous_gradients`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contiguous_gradients: Option<bool>,
    /// `overlap_comm`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap_comm: Option<bool>,
    /// `reduce_scatter`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduce_scatter: Option<bool>,
    /// `reduce_bucket_size` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduce_bucket_size: Option<Auto<u64>>,
    /// `allgather_partitions`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allgather_partitions: Option<bool>,
    /// `allgather_bucket_size` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allgather_bucket_size: Option<u64>,
    /// `stage3_prefetch_bucket_size` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage3_prefetch_bucket_size: Option<Auto<u64>>,
    /// `stage3_param_persistence_threshold` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage3_param_persistence_threshold: Option<Auto<u64>>,
    /// `stage3_max_live_parameters` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage3_max_live_parameters: Option<u64>,
    /// `stage3_max_reuse_distance` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage3_max_reuse_distance: Option<u64>,
    /// `stage3_gather_16bit_weights_on_model_save` (also read from the
    /// deprecated `stage3_gather_fp16_weights_on_model_save`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage3_gather_16bit_weights_on_model_save: Option<Auto<bool>>,
    /// `sub_group_size` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sub_group_size: Option<Auto<u64>>,
    /// `round_robin_gradients`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round_robin_gradients: Option<bool>,
    /// `offload_optimizer`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload_optimizer: Option<OffloadOptimizerBlock>,
    /// `offload_param`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload_param: Option<OffloadParamBlock>,
    /// `frozen_params` (zero's own key): where stage 3 keeps frozen
    /// tensors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frozen_params: Option<String>,
}

/// The `zero_optimization.offload_optimizer` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OffloadOptimizerBlock {
    /// `device`: `"none"`, `"cpu"` or `"nvme"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// `nvme_path`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_path: Option<PathBuf>,
    /// `pin_memory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin_memory: Option<bool>,
    /// `buffer_count`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer_count: Option<u64>,
    /// `pipeline_read`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_read: Option<bool>,
    /// `pipeline_write`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_write: Option<bool>,
    /// `fast_init`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fast_init: Option<bool>,
    /// `ratio`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// `swap_gradients` (zero's own key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swap_gradients: Option<bool>,
}

/// The `zero_optimization.offload_param` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OffloadParamBlock {
    /// `device`: `"none"`, `"cpu"` or `"nvme"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// `nvme_path`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_path: Option<PathBuf>,
    /// `pin_memory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin_memory: Option<bool>,
    /// `buffer_count`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer_count: Option<u64>,
    /// `buffer_size` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer_size: Option<u64>,
    /// `max_in_cpu` (elements).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_cpu: Option<u64>,
}

/// The `aio` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AioBlock {
    /// `block_size` (bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u64>,
    /// `queue_depth`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<u64>,
    /// `thread_count` (DeepSpeed's older name of `intra_op_parallelism`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thread_count: Option<u64>,
    /// `intra_op_parallelism`: takes precedence over `thread_count`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intra_op_parallelism: Option<u64>,
    /// `single_submit`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub single_submit: Option<bool>,
    /// `overlap_events`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap_events: Option<bool>,
    /// `use_gds`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_gds: Option<bool>,
}

/// The `data_types` block.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DataTypesBlock {
    /// `grad_accum_dtype`: `"fp32"`, `"fp16"` or `"bf16"`, as written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_accum_dtype: Option<String>,
}

// ---------------------------------------------------------------------------
// What the trainer knows
// ---------------------------------------------------------------------------

/// What the trainer knows, to fill the keys that are `"auto"`.
///
/// A value here is used only where the config says `"auto"`; a value written
/// in the config wins. A key that is `"auto"` with no value here is an error
/// naming the key, except for the three batch keys, which are then derived
/// from each other (`train = micro * GA * world_size`).
#[derive(Debug, Clone, Default)]
pub struct AutoValues {
    /// Number of data-parallel ranks (required, at least 1).
    pub world_size: usize,
    /// For `train_batch_size`.
    pub train_batch_size: Option<usize>,
    /// For `train_micro_batch_size_per_gpu`.
    pub micro_batch_size: Option<usize>,
    /// For `gradient_accumulation_steps`.
    pub gradient_accumulation_steps: Option<usize>,
    /// For `gradient_clipping`.
    pub gradient_clipping: Option<f64>,
    /// For `fp16.enabled`.
    pub fp16: Option<bool>,
    /// For `bf16.enabled`.
    pub bf16: Option<bool>,
    /// For `optimizer.params.lr`.
    pub lr: Option<f64>,
    /// For `optimizer.params.betas`.
    pub betas: Option<(f64, f64)>,
    /// For `optimizer.params.eps`.
    pub eps: Option<f64>,
    /// For `optimizer.params.weight_decay`.
    pub weight_decay: Option<f64>,
    /// For `scheduler.params.warmup_min_lr`.
    pub warmup_min_lr: Option<f64>,
    /// For `scheduler.params.warmup_max_lr`.
    pub warmup_max_lr: Option<f64>,
    /// For `scheduler.params.warmup_num_steps`.
    pub warmup_num_steps: Option<u64>,
    /// For `scheduler.params.total_num_steps`.
    pub total_num_steps: Option<u64>,
    /// The model's hidden size `h`, which fills the size keys as the HF
    /// integration does: `reduce_bucket_size = h*h`,
    /// `stage3_prefetch_bucket_size = floor(0.9*h*h)`,
    /// `stage3_param_persistence_threshold = 10*h`.
    pub hidden_size: Option<usize>,
}

// ---------------------------------------------------------------------------
// The resolved configuration
// ---------------------------------------------------------------------------

/// Numeric precision of parameters and gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 everywhere (neither `fp16.enabled` nor `bf16.enabled`).
    Fp32,
    /// bf16 parameters and gradients, fp32 master weights (`bf16.enabled`).
    Bf16,
    /// fp16 parameters and gradients with loss scaling, fp32 master weights
    /// (`fp16.enabled`).
    Fp16,
}

impl Precision {
    /// The dtype of parameters and gradients on the device.
    pub fn param_dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }
}

/// Where stage 3 keeps the frozen tensors (`TensorSpec::frozen`):
/// `zero_optimization.frozen_params`, zero's own key (DeepSpeed always
/// shards them). Stages 0–2 hold every parameter on every rank anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FrozenParams {
    /// `"auto"` (default): `resident` when the memory plan with resident
    /// frozen segments fits the device budget, else `offload` with
    /// `offload_param`, else `shard` (the engine decides in `build`, all
    /// ranks together, and reports the choice in `Engine::frozen_params`).
    #[default]
    Auto,
    /// `"resident"`: every rank holds every unit's frozen segment, filled
    /// once from the registration, in the unit's own gathered buffer (kept
    /// between gathers): never all-gathered or copied.
    Resident,
    /// `"shard"`: each rank holds its shard of the frozen segments on the
    /// device, all-gathered with the unit every time (DeepSpeed's way).
    Shard,
    /// `"offload"`: as `shard`, with the shards in host memory (needs
    /// `offload_param.device` `"cpu"`).
    Offload,
}

impl FrozenParams {
    const ALLOWED: &'static str = r#"a string ("auto", "resident", "shard" or "offload")"#;

    fn parse(s: &str) -> Option<FrozenParams> {
        match s {
            "auto" => Some(FrozenParams::Auto),
            "resident" => Some(FrozenParams::Resident),
            "shard" => Some(FrozenParams::Shard),
            "offload" => Some(FrozenParams::Offload),
            _ => None,
        }
    }
}

impl std::fmt::Display for FrozenParams {
    /// The config spelling.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FrozenParams::Auto => "auto",
            FrozenParams::Resident => "resident",
            FrozenParams::Shard => "shard",
            FrozenParams::Offload => "offload",
        })
    }
}

/// Where offloaded state lives (DeepSpeed `device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    /// `"none"`: no offload (default).
    #[default]
    None,
    /// `"cpu"`: host memory.
    Cpu,
    /// `"nvme"`: files under `nvme_path`.
    Nvme,
}

impl std::fmt::Display for OffloadDevice {
    /// The config spelling: `none`, `cpu` or `nvme`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OffloadDevice::None => "none",
            OffloadDevice::Cpu => "cpu",
            OffloadDevice::Nvme => "nvme",
        })
    }
}

impl OffloadDevice {
    const ALLOWED: &'static str = r#""none", "cpu" or "nvme""#;

    fn parse(s: &str) -> Option<OffloadDevice> {
        match s {
            "none" => Some(OffloadDevice::None),
            "cpu" => Some(OffloadDevice::Cpu),
            "nvme" => Some(OffloadDevice::Nvme),
            _ => None,
        }
    }
}

/// A complete, validated configuration: what the engine runs with.
///
/// Built by [`DeepSpeedConfig::resolve`] (or [`ResolvedConfig::simple`] for
/// tests and examples) and printed at start with
/// [`ResolvedConfig::to_json_pretty`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResolvedConfig {
    /// Number of data-parallel ranks (from [`AutoValues::world_size`]).
    pub world_size: usize,
    /// `train_batch_size` = `micro_batch_size * gradient_accumulation_steps
    /// * world_size`.
    pub train_batch_size: usize,
    /// `train_micro_batch_size_per_gpu`.
    pub micro_batch_size: usize,
    /// `gradient_accumulation_steps`.
    pub gradient_accumulation_steps: usize,
    /// `gradient_clipping`: maximum global gradient norm; 0.0 = off. Default
    /// 1.0 (DeepSpeed's default since deepspeedai/DeepSpeed#8068; earlier
    /// releases defaulted to 0.0).
    pub gradient_clipping: f64,
    /// From `fp16.enabled` / `bf16.enabled` (default both false: fp32);
    /// both enabled is an error.
    pub precision: Precision,
    /// Loss scaling, `Some` only for [`Precision::Fp16`]. From the `fp16`
    /// block: `loss_scale` (default 0 = dynamic), `initial_scale_power`
    /// (16), `loss_scale_window` (1000), `hysteresis` (2),
    /// `consecutive_hysteresis` (false), `min_loss_scale` (1).
    pub loss_scale: Option<LossScaleConfig>,
    /// `optimizer.params`. Inside an `optimizer` block, missing parameters
    /// take DeepSpeed's `FusedAdam` defaults: `lr` 1e-3, `betas`
    /// (0.9, 0.999), `eps` 1e-8, `weight_decay` 0. DeepSpeed has no default
    /// optimizer; without an `optimizer` block zero uses
    /// `torch.optim.AdamW`'s defaults (the same, but `weight_decay` 0.01).
    pub optimizer: AdamWParams,
    /// `scheduler`; [`LrSchedule::Constant`] at the optimizer's `lr` when
    /// absent. WarmupLR defaults: `warmup_min_lr` 0, `warmup_max_lr` 0.001,
    /// `warmup_num_steps` 1000, `warmup_type` log; WarmupDecayLR adds a
    /// required `total_num_steps`; WarmupCosineLR: `warmup_min_ratio` 0,
    /// `cos_min_ratio` 0.0001, `warmup_num_steps` 1000, `warmup_type` log,
    /// `total_num_steps` required, base rate the optimizer's `lr`.
    pub scheduler: LrSchedule,
    /// `zero_optimization` and `aio`.
    pub zero: ZeroConfig,
    /// `communication_data_type`: dtype in which gradients are reduced.
    /// Default f32, unlike DeepSpeed (which communicates in the parameter
    /// dtype): an fp32 reduction is exact enough to be reproducible across
    /// stages and offload modes.
    #[serde(with = "dtype_serde")]
    pub communication_data_type: DType,
    /// `data_types.grad_accum_dtype`: dtype in which gradients accumulate
    /// over micro-batches. Default f32 (DeepSpeed's default depends on the
    /// precision mode; zero always accumulates in fp32 unless told).
    #[serde(with = "dtype_serde")]
    pub grad_accum_dtype: DType,
    /// The warnings of parsing the document it was resolved from (unknown
    /// keys with `"strict": false`, keys zero does not use, deprecated
    /// aliases). The engine gives each once, in its log
    /// (`Engine::warnings`, printed by rank 0), so a trainer need not
    /// print them. Not part of the config: not serialized, not compared.
    #[serde(skip)]
    pub warnings: ConfigWarnings,
}

/// Warnings that travel with a config without being part of it: they
/// serialize to nothing and every two compare equal, so a config read
/// back from a checkpoint equals the one it was written from.
#[derive(Debug, Clone, Default)]
pub struct ConfigWarnings(pub Vec<String>);

impl PartialEq for ConfigWarnings {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::ops::Deref for ConfigWarnings {
    type Target = [String];
    fn deref(&self) -> &[String] {
        &self.0
    }
}

/// ZeRO settings (DeepSpeed `zero_optimization`, plus `aio`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ZeroConfig {
    /// `stage`: 0..=3. Default 0.
    pub stage: u8,
    /// `contiguous_gradients`. Default true.
    pub contiguous_gradients: bool,
    /// `overlap_comm`: reduce gradient buckets while backward continues
    /// (stages 2–3; stage 0 always does); at stages 1–2 also all-gather the
    /// updated parameters during the next forward pass (`step` starts the
    /// all-gathers, `gather` waits for each unit's) instead of inside
    /// `step`. Default false, except true for stage 3 (as DeepSpeed).
    pub overlap_comm: bool,
    /// `reduce_scatter`. Default true.
    pub reduce_scatter: bool,
    /// `reduce_bucket_size` (elements, at least 1). Default 5e8.
    pub reduce_bucket_size: usize,
    /// `allgather_partitions`. Default true.
    pub allgather_partitions: bool,
    /// `allgather_bucket_size` (elements, at least 1). Default 5e8.
    pub allgather_bucket_size: usize,
    /// `stage3_prefetch_bucket_size` (elements; 0 turns prefetch off, as in
    /// DeepSpeed). Default 5e7.
    pub prefetch_bucket_size: usize,
    /// `stage3_param_persistence_threshold` (elements). Default 1e5.
    pub param_persistence_threshold: usize,
    /// `stage3_max_live_parameters` (elements). Default 1e9.
    pub max_live_parameters: usize,
    /// `stage3_max_reuse_distance` (elements). Default 1e9.
    pub max_reuse_distance: usize,
    /// `stage3_gather_16bit_weights_on_model_save` (alias
    /// `stage3_gather_fp16_weights_on_model_save`). Default false.
    pub gather_16bit_weights_on_model_save: bool,
    /// `sub_group_size` (elements per optimizer tile, at least 1). Default 1e9.
    pub sub_group_size: usize,
    /// `round_robin_gradients`. Default false.
    pub round_robin_gradients: bool,
    /// `offload_optimizer`. Default: no offload.
    pub offload_optimizer: OffloadOptimizerConfig,
    /// `offload_param` (stage 3 only). Default: no offload.
    pub offload_param: OffloadParamConfig,
    /// `frozen_params` (zero's own key; stage 3): where frozen tensors
    /// live. Default `auto` (see [`FrozenParams`]).
    #[serde(default)]
    pub frozen_params: FrozenParams,
    /// The top-level `aio` block.
    pub aio: AioConfig,
}

impl Default for ZeroConfig {
    /// DeepSpeed's defaults: stage 0, no offload.
    fn default() -> Self {
        ZeroConfig {
            stage: 0,
            contiguous_gradients: true,
            overlap_comm: false,
            reduce_scatter: true,
            reduce_bucket_size: DEFAULT_REDUCE_BUCKET_SIZE,
            allgather_partitions: true,
            allgather_bucket_size: DEFAULT_ALLGATHER_BUCKET_SIZE,
            prefetch_bucket_size: DEFAULT_PREFETCH_BUCKET_SIZE,
            param_persistence_threshold: DEFAULT_PARAM_PERSISTENCE_THRESHOLD,
            max_live_parameters: DEFAULT_MAX_LIVE_PARAMETERS,
            max_reuse_distance: DEFAULT_MAX_REUSE_DISTANCE,
            gather_16bit_weights_on_model_save: false,
            sub_group_size: DEFAULT_SUB_GROUP_SIZE,
            round_robin_gradients: false,
            offload_optimizer: OffloadOptimizerConfig::default(),
            offload_param: OffloadParamConfig::default(),
            frozen_params: FrozenParams::Auto,
            aio: AioConfig::default(),
        }
    }
}

/// Optimizer-state offload (DeepSpeed `zero_optimization.offload_optimizer`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OffloadOptimizerConfig {
    /// `device`. Default none. Needs stage 1..=3.
    pub device: OffloadDevice,
    /// `nvme_path`: required when `device` is nvme. Default none.
    pub nvme_path: Option<PathBuf>,
    /// `pin_memory`: page-locked host buffers. Default false.
    pub pin_memory: bool,
    /// `buffer_count` (at least 1). Default 4.
    pub buffer_count: usize,
    /// `pipeline_read`: read the next tiles while computing this one
    /// (nvme). Default true, unlike DeepSpeed (false): with false each
    /// tile is read only when the update needs it.
    pub pipeline_read: bool,
    /// `pipeline_write`: write the last tile while computing this one
    /// (nvme). Default true, unlike DeepSpeed (false): with false the step
    /// waits for each tile's write before the next tile.
    pub pipeline_write: bool,
    /// `fast_init`. Default false.
    pub fast_init: bool,
    /// `ratio`: fraction of optimizer state offloaded, in [0, 1]; below 1
    /// only with stage 3. Default 1.0.
    pub ratio: f64,
    /// `swap_gradients` (zero's own key; needs `device` nvme): the rank's
    /// accumulated gradient shard goes to the swap file unit by unit as
    /// its buckets are reduced (its norm term taken on the way, as
    /// DeepSpeed's ZeRO-Infinity does), and the step streams unit by
    /// unit: host memory holds no whole-shard gradient or parameter
    /// buffer, so it does not grow with the model. A failed swap write
    /// then loses the state (resume from the last checkpoint) instead of
    /// keeping the failed tiles in host memory. Default false.
    pub swap_gradients: bool,
}

impl Default for OffloadOptimizerConfig {
    /// DeepSpeed's defaults (no offload), except `pipeline_read` and
    /// `pipeline_write`: true (overlapped), where DeepSpeed has false.
    fn default() -> Self {
        OffloadOptimizerConfig {
            device: OffloadDevice::None,
            nvme_path: None,
            pin_memory: false,
            buffer_count: DEFAULT_OPTIMIZER_BUFFER_COUNT,
            pipeline_read: true,
            pipeline_write: true,
            fast_init: false,
            ratio: DEFAULT_OFFLOAD_RATIO,
            swap_gradients: false,
        }
    }
}

/// Parameter offload, stage 3 only (DeepSpeed `zero_optimization.offload_param`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OffloadParamConfig {
    /// `device`. Default none.
    pub device: OffloadDevice,
    /// `nvme_path`: required when `device` is nvme. Default none.
    pub nvme_path: Option<PathBuf>,
    /// `pin_memory`: page-locked host buffers. Default false.
    pub pin_memory: bool,
    /// `buffer_count` (at least 1). Default 5.
    pub buffer_count: usize,
    /// `buffer_size` (elements, at least 1). Default 1e8.
    pub buffer_size: usize,
    /// `max_in_cpu` (elements kept in host memory with nvme). Default 1e9.
    pub max_in_cpu: usize,
}

impl Default for OffloadParamConfig {
    /// DeepSpeed's defaults: no offload.
    fn default() -> Self {
        OffloadParamConfig {
            device: OffloadDevice::None,
            nvme_path: None,
            pin_memory: false,
            buffer_count: DEFAULT_PARAM_BUFFER_COUNT,
            buffer_size: DEFAULT_PARAM_BUFFER_SIZE,
            max_in_cpu: DEFAULT_PARAM_MAX_IN_CPU,
        }
    }
}

/// Asynchronous I/O for NVMe offload (DeepSpeed `aio`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AioConfig {
    /// `block_size` (bytes, at least 1). Default 1048576.
    pub block_size: usize,
    /// `queue_depth` (at least 1). Default 8.
    pub queue_depth: usize,
    /// `intra_op_parallelism`, or its older name `thread_count` (at least 1).
    /// Default 1.
    pub thread_count: usize,
    /// `single_submit`. Default false. zero's I/O threads have no such
    /// submission mode: `true` is accepted with a warning.
    pub single_submit: bool,
    /// `overlap_events`. Default true. zero's I/O threads always overlap
    /// requests (within `queue_depth`): `false` is accepted with a warning.
    pub overlap_events: bool,
    /// `use_gds`: GPUDirect Storage. Default false. zero moves swap data
    /// through host memory: `true` is accepted with a warning.
    pub use_gds: bool,
}

impl Default for AioConfig {
    /// DeepSpeed's defaults.
    fn default() -> Self {
        AioConfig {
            block_size: DEFAULT_AIO_BLOCK_SIZE,
            queue_depth: DEFAULT_AIO_QUEUE_DEPTH,
            thread_count: DEFAULT_AIO_THREAD_COUNT,
            single_submit: false,
            overlap_events: true,
            use_gds: false,
        }
    }
}

/// Where [`ResolvedConfig::check_runnable`] is asked from: the engine needs
/// the swap directories, the estimator does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckFor {
    /// Building an engine: everything, `nvme_path` included.
    Engine,
    /// Estimating memory: everything but the swap directories.
    Estimate,
}

fn config_error(key: String, msg: String) -> Error {
    Error::Config { key, msg }
}

impl ResolvedConfig {
    /// The one place where a config is checked against what the engine can
    /// run on `plan`'s units (configs built in code skip the JSON parser's
    /// checks; the engine and `zero::estimate` both call this, so they
    /// refuse the same configs): the stage, parameter offload only at
    /// stage 3, whole optimizer offload (`ratio` 1.0), the `nvme_path` of
    /// each nvme tier (for the engine), `offload_param.buffer_size` holding
    /// the largest unit shard with nvme, and with device `cpu`
    /// `offload_param.max_in_cpu` holding every shard of the rank. Errors
    /// name the key.
    pub fn check_runnable(
        &self,
        plan: &crate::partition::PartitionPlan,
        what: CheckFor,
    ) -> Result<()> {
        const OO: &str = "zero_optimization.offload_optimizer";
        const OP: &str = "zero_optimization.offload_param";
        let z = &self.zero;
        if z.stage > 3 {
            return Err(config_error(
                "zero_optimization.stage".into(),
                format!("{} is not a ZeRO stage (0..=3)", z.stage),
            ));
        }
        let need_path = |block: &str, path: &Option<PathBuf>| {
            if what == CheckFor::Engine && path.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                return Err(config_error(
                    format!("{block}.nvme_path"),
                    "required when device is \"nvme\": a directory on the NVMe drive".into(),
                ));
            }
            Ok(())
        };
        let op = &z.offload_param;
        if z.stage == 3
            && z.frozen_params == FrozenParams::Offload
            && op.device != OffloadDevice::Cpu
        {
            return Err(config_error(
                "zero_optimization.frozen_params".into(),
                format!(
                    "\"offload\" keeps the frozen shards where offload_param puts parameters, \
                     and needs offload_param.device \"cpu\" (it is \"{}\"); use \"shard\" or \
                     \"resident\" otherwise",
                    op.device
                ),
            ));
        }
        if op.device != OffloadDevice::None {
            if z.stage != 3 {
                return Err(config_error(
                    format!("{OP}.device"),
                    format!(
                        "parameter offload (\"{}\") needs ZeRO stage 3, but zero_optimization.stage is {}",
                        op.device, z.stage
                    ),
                ));
            }
            if op.device == OffloadDevice::Nvme {
                need_path(OP, &op.nvme_path)?;
            }
        }
        let oo = &z.offload_optimizer;
        if oo.device != OffloadDevice::None {
            if oo.ratio < 1.0 {
                return Err(config_error(
                    format!("{OO}.ratio"),
                    format!(
                        "{}: partial optimizer offload is not implemented; use 1.0",
                        oo.ratio
                    ),
                ));
            }
            if oo.device == OffloadDevice::Nvme {
                need_path(OO, &oo.nvme_path)?;
            }
        }
        if oo.swap_gradients && (oo.device != OffloadDevice::Nvme || z.stage == 0) {
            return Err(config_error(
                format!("{OO}.swap_gradients"),
                format!(
                    "swapping gradients needs {OO}.device \"nvme\" at stage 1, 2 or 3 (device \"{}\", stage {})",
                    oo.device, z.stage
                ),
            ));
        }
        if z.stage != 3 {
            return Ok(());
        }
        let largest = plan.units().iter().map(|u| u.shard_len).max().unwrap_or(0);
        match op.device {
            OffloadDevice::Nvme if op.buffer_size < largest => Err(config_error(
                format!("{OP}.buffer_size"),
                format!(
                    "{} elements cannot hold the largest unit shard ({largest} elements); \
                     raise it to at least {largest}",
                    op.buffer_size
                ),
            )),
            // `max_in_cpu` bounds the host cache of the nvme tier only (as
            // in DeepSpeed): with "cpu" every shard lives in host memory
            // whatever it says.
            _ => Ok(()),
        }
    }

    /// A config with every default: fp32, no optimizer or scheduler block
    /// (AdamW with `torch.optim.AdamW`'s defaults, constant rate), gradient
    /// accumulation 1, the given ZeRO stage (with `overlap_comm` on for
    /// stage 3, as DeepSpeed), no offload. For tests and examples; `stage`
    /// should be 0..=3 and is not validated here.
    pub fn simple(stage: u8, world_size: usize, micro_batch_size: usize) -> ResolvedConfig {
        let optimizer = AdamWParams {
            lr: DEFAULT_LR,
            beta1: DEFAULT_BETAS.0,
            beta2: DEFAULT_BETAS.1,
            eps: DEFAULT_EPS,
            weight_decay: DEFAULT_WEIGHT_DECAY_TORCH,
        };
        ResolvedConfig {
            world_size,
            train_batch_size: micro_batch_size * world_size,
            micro_batch_size,
            gradient_accumulation_steps: 1,
            gradient_clipping: DEFAULT_GRADIENT_CLIPPING,
            precision: Precision::Fp32,
            loss_scale: None,
            optimizer,
            scheduler: LrSchedule::Constant { lr: optimizer.lr },
            zero: ZeroConfig {
                stage,
                overlap_comm: stage == 3,
                ..ZeroConfig::default()
            },
            communication_data_type: DType::F32,
            grad_accum_dtype: DType::F32,
            warnings: ConfigWarnings::default(),
        }
    }

    /// The configuration as indented JSON, for printing at start.
    pub fn to_json_pretty(&self) -> String {
        // Serializing plain structs into a String cannot fail; fall back to
        // Debug rather than panic should that ever change.
        serde_json::to_string_pretty(self).unwrap_or_else(|_| format!("{self:#?}"))
    }
}

/// `DType` as `"f32"`/`"bf16"`/`"f16"` (DType itself has no serde impls).
mod dtype_serde {
    use crate::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------
// Parsing: JSON value -> document, with key paths and unknown-key warnings
// ---------------------------------------------------------------------------

fn config_err(key: impl Into<String>, msg: impl Into<String>) -> Error {
    Error::Config {
        key: key.into(),
        msg: msg.into(),
    }
}

/// A non-negative integer, also written as a float with an integral value
/// (`2e8`).
fn leaf_u64(v: &Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let f = v.as_f64()?;
    // 2^64 is exactly representable; every integral f64 below it fits.
    (f.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&f)).then_some(f as u64)
}

fn leaf_f64(v: &Value) -> Option<f64> {
    v.as_f64()
}

fn leaf_bool(v: &Value) -> Option<bool> {
    v.as_bool()
}

fn leaf_betas(v: &Value) -> Option<(f64, f64)> {
    match v.as_array()?.as_slice() {
        [a, b] => Some((a.as_f64()?, b.as_f64()?)),
        _ => None,
    }
}

/// Levenshtein distance, for "did you mean" on unknown keys.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// One JSON object of the document, read key by key. Every key that is asked
/// for counts as known; [`Section::finish`] warns about the others.
struct Section<'v> {
    path: String,
    map: &'v Map<String, Value>,
    asked: Vec<&'static str>,
    /// Unknown keys are errors (the top-level `strict`, default true);
    /// nested sections inherit it.
    strict: bool,
}

impl<'v> Section<'v> {
    fn new(path: String, map: &'v Map<String, Value>) -> Self {
        Section {
            path,
            map,
            asked: Vec::new(),
            strict: true,
        }
    }

    fn key(&self, k: &str) -> String {
        if self.path.is_empty() {
            k.to_string()
        } else {
            format!("{}.{k}", self.path)
        }
    }

    /// The value of `k`; `null` counts as absent.
    fn get(&mut self, k: &'static str) -> Option<&'v Value> {
        self.asked.push(k);
        self.map.get(k).filter(|v| !v.is_null())
    }

    fn type_err(&self, k: &str, expected: &str, got: &Value) -> Error {
        config_err(self.key(k), format!("expected {expected}, got {got}"))
    }

    fn leaf<T>(
        &mut self,
        k: &'static str,
        expected: &str,
        parse: fn(&Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => parse(v)
                .map(Some)
                .ok_or_else(|| self.type_err(k, expected, v)),
        }
    }

    fn auto<T>(
        &mut self,
        k: &'static str,
        expected: &str,
        parse: fn(&Value) -> Option<T>,
    ) -> Result<Option<Auto<T>>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) if v.as_str() == Some("auto") => Ok(Some(Auto::Auto)),
            Some(v) => parse(v)
                .map(|t| Some(Auto::Value(t)))
                .ok_or_else(|| self.type_err(k, &format!(r#"{expected} or "auto""#), v)),
        }
    }

    fn uint(&mut self, k: &'static str, expected: &str) -> Result<Option<u64>> {
        self.leaf(k, expected, leaf_u64)
    }

    fn number(&mut self, k: &'static str) -> Result<Option<f64>> {
        self.leaf(k, "a number", leaf_f64)
    }

    fn boolean(&mut self, k: &'static str) -> Result<Option<bool>> {
        self.leaf(k, "true or false", leaf_bool)
    }

    fn string(&mut self, k: &'static str, expected: &str) -> Result<Option<String>> {
        self.leaf(k, expected, |v| v.as_str().map(str::to_string))
    }

    fn auto_uint(&mut self, k: &'static str, expected: &str) -> Result<Option<Auto<u64>>> {
        self.auto(k, expected, leaf_u64)
    }

    fn auto_number(&mut self, k: &'static str) -> Result<Option<Auto<f64>>> {
        self.auto(k, "a number", leaf_f64)
    }

    fn auto_bool(&mut self, k: &'static str) -> Result<Option<Auto<bool>>> {
        self.auto(k, "true or false", leaf_bool)
    }

    /// A nested block, parsed by `B`.
    fn block<B: Block>(&mut self, k: &'static str, w: &mut Vec<String>) -> Result<Option<B>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Object(map)) => {
                let mut inner = Section::new(self.key(k), map);
                inner.strict = self.strict;
                B::parse(inner, w).map(Some)
            }
            Some(v) => Err(self.type_err(k, "an object", v)),
        }
    }

    /// A DeepSpeed key that zero accepts and does not use: warns when present.
    fn unused(&mut self, k: &'static str, w: &mut Vec<String>) -> Option<&'v Value> {
        let v = self.get(k);
        if v.is_some() {
            w.push(format!("key {}: accepted, not used by zero", self.key(k)));
        }
        v
    }

    /// Every key that was not asked for: inside a section an error (a
    /// warning with `"strict": false`); at the top level, where DeepSpeed
    /// ignores keys it does not know, a warning, unless the key is one
    /// typo away from a key zero reads (then an error, or a warning with
    /// `"strict": false`).
    fn finish(self, w: &mut Vec<String>) -> Result<()> {
        for k in self.map.keys() {
            if self.asked.contains(&k.as_str()) {
                continue;
            }
            let near = self
                .asked
                .iter()
                .map(|known| (edit_distance(k, known), *known))
                .filter(|&(d, known)| d <= 3.max(known.len() / 5))
                .min();
            let hint = match (alias_of(&self.path, k), near) {
                (Some(known), _) => {
                    format!(
                        "; DeepSpeed also reads `{known}` under this name, zero only as `{known}`"
                    )
                }
                (None, Some((_, known))) => format!("; did you mean `{known}`?"),
                (None, None) => String::new(),
            };
            let typo = near.filter(|&(d, known)| d <= if known.len() >= 8 { 2 } else { 1 });
            if !self.strict {
                w.push(format!("unknown key {} (ignored){hint}", self.key(k)));
            } else if !self.path.is_empty() {
                return Err(config_err(
                    self.key(k),
                    format!(
                        "unknown key in section `{}`{hint} (DeepSpeed's config models refuse \
                         unknown keys too; {NOT_STRICT})",
                        self.path
                    ),
                ));
            } else if let Some((_, known)) = typo {
                return Err(config_err(
                    k.as_str(),
                    format!(
                        "unknown top-level key, one typo away from `{known}`: did you mean \
                         `{known}`? ({NOT_STRICT})"
                    ),
                ));
            } else {
                w.push(format!("unknown key {} (ignored){hint}", self.key(k)));
            }
        }
        Ok(())
    }
}

/// How to keep unknown keys as warnings.
const NOT_STRICT: &str = r#"set "strict": false at the top level to ignore it with a warning"#;

/// DeepSpeed's `zero_optimization` fields that it also reads under their
/// field names (pydantic `populate_by_name`): the key zero reads for `k` in
/// section `path`, if `k` is one.
fn alias_of(path: &str, k: &str) -> Option<&'static str> {
    const ALIASES: &[(&str, &str)] = &[
        ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
        (
            "param_persistence_threshold",
            "stage3_param_persistence_threshold",
        ),
        ("max_live_parameters", "stage3_max_live_parameters"),
        ("max_reuse_distance", "stage3_max_reuse_distance"),
        (
            "gather_16bit_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
        ),
    ];
    if path != "zero_optimization" {
        return None;
    }
    ALIASES
        .iter()
        .find(|(a, _)| *a == k)
        .map(|(_, known)| *known)
}

/// A block of the document that can be read from a [`Section`].
trait Block: Sized {
    fn parse(s: Section<'_>, w: &mut Vec<String>) -> Result<Self>;
}

const POSITIVE_INT: &str = "a positive integer";
const NON_NEGATIVE_INT: &str = "a non-negative integer";

impl Block for DeepSpeedConfig {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        // First: the sections below inherit it.
        let strict = s.boolean("strict")?;
        s.strict = strict.unwrap_or(true);
        let bf16 = match s.block::<Bf16Block>("bf16", w)? {
            Some(b) => {
                if s.get("bfloat16").is_some() {
                    w.push("key bfloat16 ignored: bf16 is also given".to_string());
                }
                Some(b)
            }
            None => s.block("bfloat16", w)?,
        };
        let mut cfg = DeepSpeedConfig {
            train_batch_size: s.auto_uint("train_batch_size", POSITIVE_INT)?,
            train_micro_batch_size_per_gpu: s
                .auto_uint("train_micro_batch_size_per_gpu", POSITIVE_INT)?,
            gradient_accumulation_steps: s
                .auto_uint("gradient_accumulation_steps", POSITIVE_INT)?,
            gradient_clipping: s.auto_number("gradient_clipping")?,
            fp16: s.block("fp16", w)?,
            bf16,
            optimizer: s.block("optimizer", w)?,
            scheduler: s.block("scheduler", w)?,
            zero_optimization: s.block("zero_optimization", w)?,
            aio: s.block("aio", w)?,
            communication_data_type: s.string(
                "communication_data_type",
                r#"a dtype string ("fp32", "fp16" or "bf16")"#,
            )?,
            data_types: s.block("data_types", w)?,
            strict,
            accepted_unused: BTreeMap::new(),
            warnings: ConfigWarnings::default(),
        };
        for &k in SILENT_TOP_LEVEL_KEYS {
            if let Some(v) = s.get(k) {
                cfg.accepted_unused.insert(k.to_string(), v.clone());
            }
        }
        for &k in UNUSED_TOP_LEVEL_KEYS {
            if let Some(v) = s.unused(k, w) {
                cfg.accepted_unused.insert(k.to_string(), v.clone());
            }
        }
        s.finish(w)?;
        Ok(cfg)
    }
}

impl Block for Fp16Block {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = Fp16Block {
            enabled: s.auto_bool("enabled")?,
            loss_scale: s.number("loss_scale")?,
            initial_scale_power: s.uint("initial_scale_power", NON_NEGATIVE_INT)?,
            loss_scale_window: s.uint("loss_scale_window", POSITIVE_INT)?,
            hysteresis: s.uint("hysteresis", POSITIVE_INT)?,
            consecutive_hysteresis: s.boolean("consecutive_hysteresis")?,
            min_loss_scale: s.number("min_loss_scale")?,
        };
        s.unused("auto_cast", w);
        s.unused("fp16_master_weights_and_grads", w);
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for Bf16Block {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = Bf16Block {
            enabled: s.auto_bool("enabled")?,
        };
        s.unused("immediate_grad_update", w);
        s.unused("check_grad_overflow", w);
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for OptimizerBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = OptimizerBlock {
            optimizer_type: s.string("type", r#"a string ("AdamW" or "Adam")"#)?,
            params: s.block("params", w)?,
        };
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for OptimizerParamsBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = OptimizerParamsBlock {
            lr: s.auto_number("lr")?,
            betas: s.auto("betas", "an array of two numbers", leaf_betas)?,
            eps: s.auto_number("eps")?,
            weight_decay: s.auto_number("weight_decay")?,
            bias_correction: s.boolean("bias_correction")?,
            adam_w_mode: s.boolean("adam_w_mode")?,
            amsgrad: s.boolean("amsgrad")?,
            max_grad_norm: s.number("max_grad_norm")?,
        };
        s.unused("torch_adam", w);
        s.unused("set_grad_none", w);
        s.unused("fp32_optimizer_states", w);
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for SchedulerBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = SchedulerBlock {
            scheduler_type: s.string(
                "type",
                r#"a string ("WarmupLR", "WarmupDecayLR" or "WarmupCosineLR")"#,
            )?,
            params: s.block("params", w)?,
        };
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for SchedulerParamsBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = SchedulerParamsBlock {
            warmup_min_lr: s.auto_number("warmup_min_lr")?,
            warmup_max_lr: s.auto_number("warmup_max_lr")?,
            warmup_num_steps: s.auto_uint("warmup_num_steps", POSITIVE_INT)?,
            warmup_type: s.string("warmup_type", r#"a string ("log" or "linear")"#)?,
            total_num_steps: s.auto_uint("total_num_steps", POSITIVE_INT)?,
            warmup_min_ratio: s.number("warmup_min_ratio")?,
            cos_min_ratio: s.number("cos_min_ratio")?,
        };
        s.unused("last_batch_iteration", w);
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for ZeroOptimizationBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        const GATHER: &str = "stage3_gather_16bit_weights_on_model_save";
        const GATHER_OLD: &str = "stage3_gather_fp16_weights_on_model_save";
        let gather = s.auto_bool(GATHER)?;
        let gather_old = s.auto_bool(GATHER_OLD)?;
        let gather = match (gather, gather_old) {
            (Some(new), Some(old)) if new != old => {
                return Err(config_err(
                    s.key(GATHER),
                    format!("conflicts with its deprecated alias `{GATHER_OLD}`; give one"),
                ))
            }
            (Some(new), _) => Some(new),
            (None, Some(old)) => {
                w.push(format!(
                    "key {}: deprecated alias of {GATHER}",
                    s.key(GATHER_OLD)
                ));
                Some(old)
            }
            (None, None) => None,
        };
        let b = ZeroOptimizationBlock {
            stage: s.uint("stage", "an integer 0..=3")?,
            contiguous_gradients: s.boolean("contiguous_gradients")?,
            overlap_comm: s.boolean("overlap_comm")?,
            reduce_scatter: s.boolean("reduce_scatter")?,
            reduce_bucket_size: s.auto_uint("reduce_bucket_size", POSITIVE_INT)?,
            allgather_partitions: s.boolean("allgather_partitions")?,
            allgather_bucket_size: s.uint("allgather_bucket_size", POSITIVE_INT)?,
            stage3_prefetch_bucket_size: s
                .auto_uint("stage3_prefetch_bucket_size", NON_NEGATIVE_INT)?,
            stage3_param_persistence_threshold: s
                .auto_uint("stage3_param_persistence_threshold", NON_NEGATIVE_INT)?,
            stage3_max_live_parameters: s.uint("stage3_max_live_parameters", NON_NEGATIVE_INT)?,
            stage3_max_reuse_distance: s.uint("stage3_max_reuse_distance", NON_NEGATIVE_INT)?,
            stage3_gather_16bit_weights_on_model_save: gather,
            sub_group_size: s.auto_uint("sub_group_size", POSITIVE_INT)?,
            round_robin_gradients: s.boolean("round_robin_gradients")?,
            offload_optimizer: s.block("offload_optimizer", w)?,
            offload_param: s.block("offload_param", w)?,
            frozen_params: s.string("frozen_params", FrozenParams::ALLOWED)?,
        };
        // DeepSpeed's other `zero_optimization` fields (and deprecated
        // ones it still reads): accepted, with a warning.
        for k in [
            "ignore_unused_parameters",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
            "memory_efficient_linear",
            "use_multi_rank_bucket_allreduce",
            "legacy_stage1",
            "cpu_offload",
            "cpu_offload_param",
            "cpu_offload_use_pin_memory",
            "zero_hpz_partition_size",
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
            "zeropp_loco_param",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "stage3_module_granularity_threshold",
            "module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "use_all_reduce_for_fetch_params",
        ] {
            s.unused(k, w);
        }
        s.finish(w)?;
        Ok(b)
    }
}

const DEVICE_STRING: &str = r#"a string ("none", "cpu" or "nvme")"#;

impl Block for OffloadOptimizerBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = OffloadOptimizerBlock {
            device: s.string("device", DEVICE_STRING)?,
            nvme_path: s.string("nvme_path", "a path string")?.map(PathBuf::from),
            pin_memory: s.boolean("pin_memory")?,
            buffer_count: s.uint("buffer_count", POSITIVE_INT)?,
            pipeline_read: s.boolean("pipeline_read")?,
            pipeline_write: s.boolean("pipeline_write")?,
            fast_init: s.boolean("fast_init")?,
            ratio: s.number("ratio")?,
            swap_gradients: s.boolean("swap_gradients")?,
        };
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for OffloadParamBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = OffloadParamBlock {
            device: s.string("device", DEVICE_STRING)?,
            nvme_path: s.string("nvme_path", "a path string")?.map(PathBuf::from),
            pin_memory: s.boolean("pin_memory")?,
            buffer_count: s.uint("buffer_count", POSITIVE_INT)?,
            buffer_size: s.uint("buffer_size", POSITIVE_INT)?,
            max_in_cpu: s.uint("max_in_cpu", NON_NEGATIVE_INT)?,
        };
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for AioBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = AioBlock {
            block_size: s.uint("block_size", POSITIVE_INT)?,
            queue_depth: s.uint("queue_depth", POSITIVE_INT)?,
            thread_count: s.uint("thread_count", POSITIVE_INT)?,
            intra_op_parallelism: s.uint("intra_op_parallelism", POSITIVE_INT)?,
            single_submit: s.boolean("single_submit")?,
            overlap_events: s.boolean("overlap_events")?,
            use_gds: s.boolean("use_gds")?,
        };
        // Settings of DeepSpeed's libaio engine that zero's I/O threads
        // have no counterpart of: accepted, and a value other than what
        // zero does is said.
        for (key, set, what) in [
            (
                "single_submit",
                b.single_submit == Some(true),
                "zero's I/O threads issue every transfer as a call of its own (no batch to submit)",
            ),
            (
                "overlap_events",
                b.overlap_events == Some(false),
                "zero's I/O threads always overlap transfers, up to queue_depth",
            ),
            (
                "use_gds",
                b.use_gds == Some(true),
                "zero moves swap data through host memory (no GPUDirect Storage)",
            ),
        ] {
            if set {
                w.push(format!("key {}: accepted, not used: {what}", s.key(key)));
            }
        }
        s.unused("io_backend", w);
        s.finish(w)?;
        Ok(b)
    }
}

impl Block for DataTypesBlock {
    fn parse(mut s: Section<'_>, w: &mut Vec<String>) -> Result<Self> {
        let b = DataTypesBlock {
            grad_accum_dtype: s.string(
                "grad_accum_dtype",
                r#"a dtype string ("fp32", "fp16" or "bf16")"#,
            )?,
        };
        s.unused("param_dtype", w);
        s.unused("buffer_dtype", w);
        s.finish(w)?;
        Ok(b)
    }
}

/// `Deserialize` through the same reader as [`DeepSpeedConfig::from_json_str`]
/// (same key aliases, integral floats and error texts; warnings dropped).
macro_rules! deserialize_via_block {
    ($($t:ty),* $(,)?) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let v = Value::deserialize(d)?;
                let map = v
                    .as_object()
                    .ok_or_else(|| serde::de::Error::custom("expected a JSON object"))?;
                <$t as Block>::parse(Section::new(String::new(), map), &mut Vec::new())
                    .map_err(serde::de::Error::custom)
            }
        }
    )*};
}

deserialize_via_block!(
    DeepSpeedConfig,
    Fp16Block,
    Bf16Block,
    OptimizerBlock,
    OptimizerParamsBlock,
    SchedulerBlock,
    SchedulerParamsBlock,
    ZeroOptimizationBlock,
    OffloadOptimizerBlock,
    OffloadParamBlock,
    AioBlock,
    DataTypesBlock,
);

// ---------------------------------------------------------------------------
// Resolution: defaults, "auto" and validation
// ---------------------------------------------------------------------------

/// Fills an optional, possibly-"auto" value: `None` if absent, the trainer's
/// value for "auto" (error naming `key` if it has none).
fn fill<T: Copy>(key: &str, v: Option<Auto<T>>, auto: Option<T>) -> Result<Option<T>> {
    match v {
        None => Ok(None),
        Some(Auto::Value(t)) => Ok(Some(t)),
        Some(Auto::Auto) => auto.map(Some).ok_or_else(|| no_auto_value(key)),
    }
}

fn no_auto_value(key: &str) -> Error {
    config_err(key, r#"is "auto" and the trainer gave no value"#)
}

fn to_usize(key: &str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| {
        config_err(
            key,
            format!(
                "{v} does not fit this platform's usize (max {})",
                usize::MAX
            ),
        )
    })
}

fn check_finite_at_least(key: &str, v: f64, min: f64) -> Result<f64> {
    if v.is_finite() && v >= min {
        Ok(v)
    } else {
        Err(config_err(
            key,
            format!("expected a finite number >= {min}, got {v}"),
        ))
    }
}

fn check_min_u64(key: &str, v: u64, min: u64) -> Result<u64> {
    if v >= min {
        Ok(v)
    } else {
        Err(config_err(
            key,
            format!("expected an integer >= {min}, got {v}"),
        ))
    }
}

fn parse_dtype(key: &str, s: &str) -> Result<DType> {
    match s.to_ascii_lowercase().as_str() {
        "fp32" | "float32" => Ok(DType::F32),
        "fp16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err(config_err(
            key,
            format!(
                r#"unknown dtype "{s}"; allowed: "fp32", "fp16", "bf16" (or "float32", "float16", "bfloat16")"#
            ),
        )),
    }
}

fn parse_warmup_type(key: &str, s: Option<&str>) -> Result<WarmupType> {
    match s {
        None | Some("log") => Ok(WarmupType::Log),
        Some("linear") => Ok(WarmupType::Linear),
        Some(other) => Err(config_err(
            key,
            format!(r#"unknown warmup type "{other}"; allowed: "log", "linear""#),
        )),
    }
}

impl DeepSpeedConfig {
    /// Parses a DeepSpeed JSON config.
    ///
    /// Returns the document and warnings (also kept in
    /// [`DeepSpeedConfig::warnings`], for the engine's log): unknown
    /// top-level keys, DeepSpeed keys that zero accepts but does not use,
    /// deprecated aliases, and with `"strict": false` the unknown keys that
    /// are otherwise errors (with their full path, e.g. `unknown key
    /// zero_optimization.stage3_prefetch_bucket_sise (ignored)`). Errors
    /// name the key path: an unknown key inside a section, a top-level key
    /// one typo away from a key zero reads (both unless `"strict": false`),
    /// a value of the wrong
    /// type, a negative or non-integral number for an integer key (integral
    /// floats such as `2e8` are integers), and JSON syntax errors (key
    /// `<document>`, with line and column). Ranges are checked by
    /// [`DeepSpeedConfig::resolve`].
    pub fn from_json_str(s: &str) -> Result<(DeepSpeedConfig, Vec<String>)> {
        let value: Value = serde_json::from_str(s).map_err(|e| {
            let (line, column) = (e.line(), e.column());
            let text = e.to_string();
            let what = text
                .strip_suffix(&format!(" at line {line} column {column}"))
                .unwrap_or(&text);
            config_err(
                "<document>",
                format!("invalid JSON at line {line}, column {column}: {what}"),
            )
        })?;
        let map = value.as_object().ok_or_else(|| {
            config_err(
                "<document>",
                format!("expected a JSON object at the top level, got {value}"),
            )
        })?;
        let mut warnings = Vec::new();
        let mut cfg = DeepSpeedConfig::parse(Section::new(String::new(), map), &mut warnings)?;
        cfg.warnings = ConfigWarnings(warnings.clone());
        Ok((cfg, warnings))
    }

    /// Fills `"auto"` from `auto`, applies defaults and validates: the one
    /// place where configuration values are checked. Every error names the
    /// key path and what is allowed.
    pub fn resolve(&self, auto: &AutoValues) -> Result<ResolvedConfig> {
        if auto.world_size == 0 {
            return Err(config_err(
                "world_size",
                "the trainer gave world_size 0; expected at least 1 rank",
            ));
        }
        let (train_batch_size, micro_batch_size, gradient_accumulation_steps) =
            self.resolve_batch(auto)?;
        let gradient_clipping = check_finite_at_least(
            "gradient_clipping",
            fill(
                "gradient_clipping",
                self.gradient_clipping,
                auto.gradient_clipping,
            )?
            .unwrap_or(DEFAULT_GRADIENT_CLIPPING),
            0.0,
        )?;
        let (precision, loss_scale) = self.resolve_precision(auto)?;
        let optimizer = self.resolve_optimizer(auto)?;
        let scheduler = self.resolve_scheduler(auto, optimizer.lr)?;
        let zero = self.resolve_zero(auto)?;
        let communication_data_type = match &self.communication_data_type {
            Some(s) => parse_dtype("communication_data_type", s)?,
            None => DType::F32,
        };
        let grad_accum_dtype = match self
            .data_types
            .as_ref()
            .and_then(|d| d.grad_accum_dtype.as_deref())
        {
            Some(s) => parse_dtype("data_types.grad_accum_dtype", s)?,
            None => DType::F32,
        };
        Ok(ResolvedConfig {
            world_size: auto.world_size,
            train_batch_size,
            micro_batch_size,
            gradient_accumulation_steps,
            gradient_clipping,
            precision,
            loss_scale,
            optimizer,
            scheduler,
            zero,
            communication_data_type,
            grad_accum_dtype,
            warnings: self.warnings.clone(),
        })
    }

    /// DeepSpeed's rule `train = micro * GA * world_size`: any one may be
    /// missing and is derived; train alone gives GA 1, micro alone gives GA 1.
    fn resolve_batch(&self, auto: &AutoValues) -> Result<(usize, usize, usize)> {
        const TRAIN: &str = "train_batch_size";
        const MICRO: &str = "train_micro_batch_size_per_gpu";
        const GA: &str = "gradient_accumulation_steps";
        let world = auto.world_size;
        // An "auto" the trainer did not fill counts as absent.
        let take = |key: &str, v: Option<Auto<u64>>, a: Option<usize>| -> Result<Option<usize>> {
            let v = match v {
                None => None,
                Some(Auto::Value(n)) => Some(to_usize(key, n)?),
                Some(Auto::Auto) => a,
            };
            match v {
                Some(0) => Err(config_err(key, "expected an integer >= 1, got 0")),
                v => Ok(v),
            }
        };
        let train = take(TRAIN, self.train_batch_size, auto.train_batch_size)?;
        let micro = take(
            MICRO,
            self.train_micro_batch_size_per_gpu,
            auto.micro_batch_size,
        )?;
        let ga = take(
            GA,
            self.gradient_accumulation_steps,
            auto.gradient_accumulation_steps,
        )?;
        let rule = || {
            format!(
                "`{TRAIN}` must equal `{MICRO}` * `{GA}` * world_size: train {}, micro {}, GA {}, world_size {world}",
                show(train),
                show(micro),
                show(ga)
            )
        };
        let product = |m: usize, g: usize| {
            m.checked_mul(g)
                .and_then(|x| x.checked_mul(world))
                .ok_or_else(|| config_err(TRAIN, format!("overflows usize; {}", rule())))
        };
        // Derives `total / divisor`, which must be exact and at least 1.
        let divide = |key: &str, total: usize, divisor: usize| -> Result<usize> {
            if total.is_multiple_of(divisor) && total / divisor >= 1 {
                Ok(total / divisor)
            } else {
                Err(config_err(
                    key,
                    format!("cannot be derived as a positive integer; {}", rule()),
                ))
            }
        };
        let (t, m, g) = match (train, micro, ga) {
            (Some(t), Some(m), Some(g)) => {
                if product(m, g)? != t {
                    return Err(config_err(TRAIN, format!("inconsistent: {}", rule())));
                }
                (t, m, g)
            }
            (Some(t), Some(m), None) => (t, m, divide(GA, t, m.saturating_mul(world))?),
            (Some(t), None, Some(g)) => (t, divide(MICRO, t, g.saturating_mul(world))?, g),
            (None, Some(m), Some(g)) => (product(m, g)?, m, g),
            (Some(t), None, None) => (t, divide(MICRO, t, world)?, 1),
            (None, Some(m), None) => (product(m, 1)?, m, 1),
            (None, None, _) => {
                for (key, v) in [
                    (MICRO, self.train_micro_batch_size_per_gpu),
                    (TRAIN, self.train_batch_size),
                ] {
                    if v == Some(Auto::Auto) {
                        return Err(config_err(
                            key,
                            format!(
                                r#"is "auto" and the trainer gave no value, and it cannot be derived; {}"#,
                                rule()
                            ),
                        ));
                    }
                }
                return Err(config_err(
                    TRAIN,
                    format!(
                        "neither `{TRAIN}` nor `{MICRO}` is given; set at least one ({})",
                        rule()
                    ),
                ));
            }
        };
        Ok((t, m, g))
    }

    fn resolve_precision(&self, auto: &AutoValues) -> Result<(Precision, Option<LossScaleConfig>)> {
        let fp16 = self.fp16.clone().unwrap_or_default();
        let fp16_on = fill("fp16.enabled", fp16.enabled, auto.fp16)?.unwrap_or(false);
        let bf16_on = fill(
            "bf16.enabled",
            self.bf16.as_ref().and_then(|b| b.enabled),
            auto.bf16,
        )?
        .unwrap_or(false);
        if fp16_on && bf16_on {
            return Err(config_err(
                "fp16.enabled",
                "fp16.enabled and bf16.enabled are both true; enable at most one",
            ));
        }
        // The fp16 block is validated whenever it is present.
        let loss_scale = fp16.loss_scale.unwrap_or(DEFAULT_LOSS_SCALE);
        let loss_scale = check_finite_at_least("fp16.loss_scale", loss_scale, 0.0)?;
        if loss_scale > f64::from(f32::MAX) {
            return Err(config_err(
                "fp16.loss_scale",
                format!("expected 0 (dynamic) or a positive scale that fits f32, got {loss_scale}"),
            ));
        }
        let power = fp16
            .initial_scale_power
            .unwrap_or(DEFAULT_INITIAL_SCALE_POWER);
        if power > 64 {
            return Err(config_err(
                "fp16.initial_scale_power",
                format!("expected an integer 0..=64, got {power}"),
            ));
        }
        let window = check_min_u64(
            "fp16.loss_scale_window",
            fp16.loss_scale_window.unwrap_or(DEFAULT_LOSS_SCALE_WINDOW),
            1,
        )?;
        let hysteresis = check_min_u64(
            "fp16.hysteresis",
            fp16.hysteresis.unwrap_or(DEFAULT_HYSTERESIS),
            1,
        )?;
        let hysteresis = u32::try_from(hysteresis).map_err(|_| {
            config_err(
                "fp16.hysteresis",
                format!("expected an integer 1..={}, got {hysteresis}", u32::MAX),
            )
        })?;
        let min_scale = fp16.min_loss_scale.unwrap_or(DEFAULT_MIN_LOSS_SCALE);
        if !(min_scale.is_finite() && min_scale > 0.0 && min_scale <= f64::from(f32::MAX)) {
            return Err(config_err(
                "fp16.min_loss_scale",
                format!("expected a finite number > 0, got {min_scale}"),
            ));
        }
        let scaler = if loss_scale > 0.0 {
            LossScaleConfig::Static {
                scale: loss_scale as f32,
            }
        } else {
            LossScaleConfig::Dynamic {
                initial_scale_power: power as u32,
                window,
                hysteresis,
                consecutive_hysteresis: fp16.consecutive_hysteresis.unwrap_or(false),
                min_scale: min_scale as f32,
            }
        };
        Ok(match (fp16_on, bf16_on) {
            (true, _) => (Precision::Fp16, Some(scaler)),
            (false, true) => (Precision::Bf16, None),
            (false, false) => (Precision::Fp32, None),
        })
    }

    fn resolve_optimizer(&self, auto: &AutoValues) -> Result<AdamWParams> {
        let Some(block) = &self.optimizer else {
            return Ok(AdamWParams {
                lr: DEFAULT_LR,
                beta1: DEFAULT_BETAS.0,
                beta2: DEFAULT_BETAS.1,
                eps: DEFAULT_EPS,
                weight_decay: DEFAULT_WEIGHT_DECAY_TORCH,
            });
        };
        let p = block.params.clone().unwrap_or_default();
        const ALLOWED: &str = r#"allowed: "AdamW", "Adam" (with adam_w_mode true)"#;
        match block.optimizer_type.as_deref().map(str::to_ascii_lowercase) {
            None => return Err(config_err("optimizer.type", format!("missing; {ALLOWED}"))),
            Some(t) if t == "adamw" => {}
            Some(t) if t == "adam" => {
                if p.adam_w_mode == Some(false) {
                    return Err(config_err(
                        "optimizer.params.adam_w_mode",
                        "false (Adam with L2 regularisation) is not supported: only decoupled \
                         weight decay (AdamW) is implemented; allowed: true",
                    ));
                }
            }
            Some(_) => {
                return Err(config_err(
                    "optimizer.type",
                    format!(
                        "unknown optimizer {:?}; {ALLOWED}",
                        block.optimizer_type.as_deref().unwrap_or_default()
                    ),
                ))
            }
        }
        if p.bias_correction == Some(false) {
            return Err(config_err(
                "optimizer.params.bias_correction",
                "false is not supported: AdamW always corrects bias; allowed: true",
            ));
        }
        if p.amsgrad == Some(true) {
            return Err(config_err(
                "optimizer.params.amsgrad",
                "true is not supported (as in DeepSpeed's FusedAdam); allowed: false",
            ));
        }
        if p.max_grad_norm.is_some() {
            return Err(config_err(
                "optimizer.params.max_grad_norm",
                "not supported as an optimizer parameter (as in DeepSpeed); use the top-level \
                 `gradient_clipping`",
            ));
        }
        let lr = fill("optimizer.params.lr", p.lr, auto.lr)?.unwrap_or(DEFAULT_LR);
        let lr = check_finite_at_least("optimizer.params.lr", lr, 0.0)?;
        let (beta1, beta2) =
            fill("optimizer.params.betas", p.betas, auto.betas)?.unwrap_or(DEFAULT_BETAS);
        for (i, b) in [beta1, beta2].into_iter().enumerate() {
            if !(0.0..1.0).contains(&b) {
                return Err(config_err(
                    "optimizer.params.betas",
                    format!("betas[{i}] must be in [0, 1), got {b}"),
                ));
            }
        }
        let eps = fill("optimizer.params.eps", p.eps, auto.eps)?.unwrap_or(DEFAULT_EPS);
        if !(eps.is_finite() && eps > 0.0) {
            return Err(config_err(
                "optimizer.params.eps",
                format!("expected a finite number > 0, got {eps}"),
            ));
        }
        let weight_decay = fill(
            "optimizer.params.weight_decay",
            p.weight_decay,
            auto.weight_decay,
        )?
        .unwrap_or(DEFAULT_WEIGHT_DECAY_DEEPSPEED);
        let weight_decay =
            check_finite_at_least("optimizer.params.weight_decay", weight_decay, 0.0)?;
        Ok(AdamWParams {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        })
    }

    fn resolve_scheduler(&self, auto: &AutoValues, base_lr: f64) -> Result<LrSchedule> {
        let Some(block) = &self.scheduler else {
            return Ok(LrSchedule::Constant { lr: base_lr });
        };
        const ALLOWED: &str = r#"allowed: "WarmupLR", "WarmupDecayLR", "WarmupCosineLR""#;
        let kind = match block.scheduler_type.as_deref() {
            None => return Err(config_err("scheduler.type", format!("missing; {ALLOWED}"))),
            Some(t @ ("WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR")) => t,
            Some(other) => {
                return Err(config_err(
                    "scheduler.type",
                    format!("unknown or unsupported scheduler {other:?}; {ALLOWED}"),
                ))
            }
        };
        let p = block.params.clone().unwrap_or_default();
        let cosine = kind == "WarmupCosineLR";
        // Parameters the chosen scheduler does not take (DeepSpeed raises a
        // TypeError for them when it builds the scheduler).
        let given = [
            ("warmup_min_lr", p.warmup_min_lr.is_some(), !cosine),
            ("warmup_max_lr", p.warmup_max_lr.is_some(), !cosine),
            (
                "total_num_steps",
                p.total_num_steps.is_some(),
                kind != "WarmupLR",
            ),
            ("warmup_min_ratio", p.warmup_min_ratio.is_some(), cosine),
            ("cos_min_ratio", p.cos_min_ratio.is_some(), cosine),
        ];
        for (name, present, accepted) in given {
            if present && !accepted {
                let takes = match kind {
                    "WarmupLR" => "warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type",
                    "WarmupDecayLR" => {
                        "warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps"
                    }
                    _ => {
                        "total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type"
                    }
                };
                return Err(config_err(
                    format!("scheduler.params.{name}"),
                    format!("not a parameter of {kind}; it takes: {takes}"),
                ));
            }
        }
        let warmup_type =
            parse_warmup_type("scheduler.params.warmup_type", p.warmup_type.as_deref())?;
        let warmup_steps = fill(
            "scheduler.params.warmup_num_steps",
            p.warmup_num_steps,
            auto.warmup_num_steps,
        )?
        .unwrap_or(DEFAULT_WARMUP_NUM_STEPS);
        let warmup_steps = check_min_u64("scheduler.params.warmup_num_steps", warmup_steps, 1)?;
        let total_steps = || -> Result<u64> {
            const KEY: &str = "scheduler.params.total_num_steps";
            let total = fill(KEY, p.total_num_steps, auto.total_num_steps)?
                .ok_or_else(|| config_err(KEY, format!("required by {kind}")))?;
            if total < warmup_steps {
                return Err(config_err(
                    KEY,
                    format!(
                        "expected an integer >= scheduler.params.warmup_num_steps \
                         ({warmup_steps}), got {total}"
                    ),
                ));
            }
            Ok(total)
        };
        let lr_pair = || -> Result<(f64, f64)> {
            let min = fill(
                "scheduler.params.warmup_min_lr",
                p.warmup_min_lr,
                auto.warmup_min_lr,
            )?
            .unwrap_or(DEFAULT_WARMUP_MIN_LR);
            let max = fill(
                "scheduler.params.warmup_max_lr",
                p.warmup_max_lr,
                auto.warmup_max_lr,
            )?
            .unwrap_or(DEFAULT_WARMUP_MAX_LR);
            Ok((
                check_finite_at_least("scheduler.params.warmup_min_lr", min, 0.0)?,
                check_finite_at_least("scheduler.params.warmup_max_lr", max, 0.0)?,
            ))
        };
        let ratio = |key: &str, v: Option<f64>, default: f64| -> Result<f64> {
            let v = v.unwrap_or(default);
            if (0.0..=1.0).contains(&v) {
                Ok(v)
            } else {
                Err(config_err(
                    key,
                    format!("expected a number in [0, 1], got {v}"),
                ))
            }
        };
        Ok(match kind {
            "WarmupLR" => {
                let (min_lr, max_lr) = lr_pair()?;
                LrSchedule::WarmupLr {
                    min_lr,
                    max_lr,
                    warmup_steps,
                    warmup_type,
                }
            }
            "WarmupDecayLR" => {
                let (min_lr, max_lr) = lr_pair()?;
                LrSchedule::WarmupDecayLr {
                    min_lr,
                    max_lr,
                    warmup_steps,
                    total_steps: total_steps()?,
                    warmup_type,
                }
            }
            _ => LrSchedule::WarmupCosineLr {
                base_lr,
                total_steps: total_steps()?,
                warmup_min_ratio: ratio(
                    "scheduler.params.warmup_min_ratio",
                    p.warmup_min_ratio,
                    DEFAULT_WARMUP_MIN_RATIO,
                )?,
                warmup_steps,
                cos_min_ratio: ratio(
                    "scheduler.params.cos_min_ratio",
                    p.cos_min_ratio,
                    DEFAULT_COS_MIN_RATIO,
                )?,
                warmup_type,
            },
        })
    }

    fn resolve_zero(&self, auto: &AutoValues) -> Result<ZeroConfig> {
        const Z: &str = "zero_optimization";
        let z = self.zero_optimization.clone().unwrap_or_default();
        let stage = z.stage.unwrap_or(0);
        if stage > 3 {
            return Err(config_err(
                format!("{Z}.stage"),
                format!("expected an integer 0..=3, got {stage}"),
            ));
        }
        let stage = stage as u8;
        let key = |k: &str| format!("{Z}.{k}");
        let size = |k: &str, v: Option<u64>, default: usize, min: u64| -> Result<usize> {
            match v {
                None => Ok(default),
                Some(n) => to_usize(&key(k), check_min_u64(&key(k), n, min)?),
            }
        };
        // Keys the HF integration fills from the hidden size.
        let from_hidden = |k: &str,
                           v: Option<Auto<u64>>,
                           f: fn(u128) -> u128|
         -> Result<Option<u64>> {
            match v {
                None => Ok(None),
                Some(Auto::Value(n)) => Ok(Some(n)),
                Some(Auto::Auto) => {
                    let h = auto.hidden_size.ok_or_else(|| {
                        config_err(
                            key(k),
                            r#"is "auto" and the trainer gave no value (it is filled from AutoValues::hidden_size)"#,
                        )
                    })?;
                    u64::try_from(f(h as u128))
                        .map(Some)
                        .map_err(|_| config_err(key(k), format!("too large for hidden_size {h}")))
                }
            }
        };
        let reduce_bucket_size = size(
            "reduce_bucket_size",
            from_hidden("reduce_bucket_size", z.reduce_bucket_size, |h| h * h)?,
            DEFAULT_REDUCE_BUCKET_SIZE,
            1,
        )?;
        let prefetch_bucket_size = size(
            "stage3_prefetch_bucket_size",
            from_hidden(
                "stage3_prefetch_bucket_size",
                z.stage3_prefetch_bucket_size,
                |h| h * h * 9 / 10,
            )?,
            DEFAULT_PREFETCH_BUCKET_SIZE,
            0,
        )?;
        let param_persistence_threshold = size(
            "stage3_param_persistence_threshold",
            from_hidden(
                "stage3_param_persistence_threshold",
                z.stage3_param_persistence_threshold,
                |h| 10 * h,
            )?,
            DEFAULT_PARAM_PERSISTENCE_THRESHOLD,
            0,
        )?;
        // "auto" for these means the default: the HF integration fills no value.
        let sub_group_size = size(
            "sub_group_size",
            z.sub_group_size.and_then(|a| a.value().copied()),
            DEFAULT_SUB_GROUP_SIZE,
            1,
        )?;
        let gather_16bit_weights_on_model_save = z
            .stage3_gather_16bit_weights_on_model_save
            .and_then(|a| a.value().copied())
            .unwrap_or(false);

        let offload_optimizer = resolve_offload_optimizer(stage, z.offload_optimizer.as_ref())?;
        let offload_param = resolve_offload_param(stage, z.offload_param.as_ref())?;
        Ok(ZeroConfig {
            stage,
            contiguous_gradients: z.contiguous_gradients.unwrap_or(true),
            overlap_comm: z.overlap_comm.unwrap_or(stage == 3),
            reduce_scatter: z.reduce_scatter.unwrap_or(true),
            reduce_bucket_size,
            allgather_partitions: z.allgather_partitions.unwrap_or(true),
            allgather_bucket_size: size(
                "allgather_bucket_size",
                z.allgather_bucket_size,
                DEFAULT_ALLGATHER_BUCKET_SIZE,
                1,
            )?,
            prefetch_bucket_size,
            param_persistence_threshold,
            max_live_parameters: size(
                "stage3_max_live_parameters",
                z.stage3_max_live_parameters,
                DEFAULT_MAX_LIVE_PARAMETERS,
                0,
            )?,
            max_reuse_distance: size(
                "stage3_max_reuse_distance",
                z.stage3_max_reuse_distance,
                DEFAULT_MAX_REUSE_DISTANCE,
                0,
            )?,
            gather_16bit_weights_on_model_save,
            sub_group_size,
            round_robin_gradients: z.round_robin_gradients.unwrap_or(false),
            offload_optimizer,
            frozen_params: match z.frozen_params.as_deref() {
                None => FrozenParams::Auto,
                Some(v) => FrozenParams::parse(v).ok_or_else(|| {
                    config_err(
                        "zero_optimization.frozen_params",
                        format!("unknown value {v:?}; allowed: {}", FrozenParams::ALLOWED),
                    )
                })?,
            },
            offload_param,
            aio: resolve_aio(self.aio.as_ref())?,
        })
    }
}

fn resolve_device(key: &str, device: Option<&str>) -> Result<OffloadDevice> {
    match device {
        None => Ok(OffloadDevice::None),
        Some(s) => OffloadDevice::parse(s).ok_or_else(|| {
            config_err(
                key,
                format!(
                    "unknown offload device {s:?}; allowed: {}",
                    OffloadDevice::ALLOWED
                ),
            )
        }),
    }
}

fn resolve_count(key: &str, v: Option<u64>, default: usize) -> Result<usize> {
    match v {
        None => Ok(default),
        Some(n) => to_usize(key, check_min_u64(key, n, 1)?),
    }
}

fn check_nvme_path(prefix: &str, device: OffloadDevice, path: &Option<PathBuf>) -> Result<()> {
    let missing = path.as_ref().is_none_or(|p| p.as_os_str().is_empty());
    if device == OffloadDevice::Nvme && missing {
        return Err(config_err(
            format!("{prefix}.nvme_path"),
            "required when device is \"nvme\": a directory on the NVMe drive",
        ));
    }
    Ok(())
}

fn resolve_offload_optimizer(
    stage: u8,
    b: Option<&OffloadOptimizerBlock>,
) -> Result<OffloadOptimizerConfig> {
    const P: &str = "zero_optimization.offload_optimizer";
    let Some(b) = b else {
        return Ok(OffloadOptimizerConfig::default());
    };
    let device = resolve_device(&format!("{P}.device"), b.device.as_deref())?;
    if device != OffloadDevice::None && stage == 0 {
        return Err(config_err(
            P,
            format!(
                "device {:?} needs ZeRO stage 1, 2 or 3, but zero_optimization.stage is 0",
                b.device.as_deref().unwrap_or_default()
            ),
        ));
    }
    check_nvme_path(P, device, &b.nvme_path)?;
    let ratio = b.ratio.unwrap_or(DEFAULT_OFFLOAD_RATIO);
    if !(0.0..=1.0).contains(&ratio) {
        return Err(config_err(
            format!("{P}.ratio"),
            format!("expected a number in [0, 1], got {ratio}"),
        ));
    }
    if ratio < 1.0 && stage != 3 {
        return Err(config_err(
            format!("{P}.ratio"),
            format!("a ratio below 1 (partial offload) needs ZeRO stage 3, got stage {stage}"),
        ));
    }
    let swap_gradients = b.swap_gradients.unwrap_or(false);
    if swap_gradients && device != OffloadDevice::Nvme {
        return Err(config_err(
            format!("{P}.swap_gradients"),
            format!(
                "swapping gradients needs {P}.device \"nvme\", got {:?}",
                b.device.as_deref().unwrap_or("none")
            ),
        ));
    }
    if swap_gradients && ratio < 1.0 {
        return Err(config_err(
            format!("{P}.swap_gradients"),
            format!("swapping gradients needs the whole optimizer state offloaded ({P}.ratio 1), got ratio {ratio}"),
        ));
    }
    Ok(OffloadOptimizerConfig {
        device,
        nvme_path: b.nvme_path.clone(),
        pin_memory: b.pin_memory.unwrap_or(false),
        buffer_count: resolve_count(
            &format!("{P}.buffer_count"),
            b.buffer_count,
            DEFAULT_OPTIMIZER_BUFFER_COUNT,
        )?,
        pipeline_read: b.pipeline_read.unwrap_or(true),
        pipeline_write: b.pipeline_write.unwrap_or(true),
        fast_init: b.fast_init.unwrap_or(false),
        ratio,
        swap_gradients,
    })
}

fn resolve_offload_param(stage: u8, b: Option<&OffloadParamBlock>) -> Result<OffloadParamConfig> {
    const P: &str = "zero_optimization.offload_param";
    let Some(b) = b else {
        return Ok(OffloadParamConfig::default());
    };
    let device = resolve_device(&format!("{P}.device"), b.device.as_deref())?;
    if device != OffloadDevice::None && stage != 3 {
        return Err(config_err(
            P,
            format!(
                "parameter offload (device {:?}) needs ZeRO stage 3, but zero_optimization.stage is {stage}",
                b.device.as_deref().unwrap_or_default()
            ),
        ));
    }
    check_nvme_path(P, device, &b.nvme_path)?;
    Ok(OffloadParamConfig {
        device,
        nvme_path: b.nvme_path.clone(),
        pin_memory: b.pin_memory.unwrap_or(false),
        buffer_count: resolve_count(
            &format!("{P}.buffer_count"),
            b.buffer_count,
            DEFAULT_PARAM_BUFFER_COUNT,
        )?,
        buffer_size: resolve_count(
            &format!("{P}.buffer_size"),
            b.buffer_size,
            DEFAULT_PARAM_BUFFER_SIZE,
        )?,
        max_in_cpu: match b.max_in_cpu {
            None => DEFAULT_PARAM_MAX_IN_CPU,
            Some(n) => to_usize(&format!("{P}.max_in_cpu"), n)?,
        },
    })
}

fn resolve_aio(b: Option<&AioBlock>) -> Result<AioConfig> {
    let Some(b) = b else {
        return Ok(AioConfig::default());
    };
    // As DeepSpeed: the newer `intra_op_parallelism` wins over `thread_count`.
    let (thread_key, threads) = match (b.intra_op_parallelism, b.thread_count) {
        (Some(n), _) => ("aio.intra_op_parallelism", Some(n)),
        (None, n) => ("aio.thread_count", n),
    };
    Ok(AioConfig {
        block_size: resolve_count("aio.block_size", b.block_size, DEFAULT_AIO_BLOCK_SIZE)?,
        queue_depth: resolve_count("aio.queue_depth", b.queue_depth, DEFAULT_AIO_QUEUE_DEPTH)?,
        thread_count: resolve_count(thread_key, threads, DEFAULT_AIO_THREAD_COUNT)?,
        single_submit: b.single_submit.unwrap_or(false),
        overlap_events: b.overlap_events.unwrap_or(true),
        use_gds: b.use_gds.unwrap_or(false),
    })
}

fn show(v: Option<usize>) -> String {
    v.map_or_else(|| "?".to_string(), |n| n.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integral_floats_are_integers() {
        assert_eq!(leaf_u64(&serde_json::json!(2e8)), Some(200_000_000));
        assert_eq!(leaf_u64(&serde_json::json!(7)), Some(7));
        assert_eq!(leaf_u64(&serde_json::json!(2.5)), None);
        assert_eq!(leaf_u64(&serde_json::json!(-1)), None);
        assert_eq!(leaf_u64(&serde_json::json!(-1.0)), None);
        assert_eq!(leaf_u64(&serde_json::json!(1e30)), None);
        assert_eq!(leaf_u64(&serde_json::json!(true)), None);
        assert_eq!(leaf_u64(&serde_json::json!("3")), None);
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("stage", "stage"), 0);
        assert_eq!(edit_distance("sise", "size"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn auto_serde_round_trips() {
        let a: Auto<u64> = serde_json::from_str("\"auto\"").unwrap();
        assert_eq!(a, Auto::Auto);
        let v: Auto<u64> = serde_json::from_str("2e8").unwrap();
        assert_eq!(v, Auto::Value(200_000_000));
        assert!(serde_json::from_str::<Auto<u64>>("2.5").is_err());
        assert_eq!(
            serde_json::to_string(&Auto::<u64>::Auto).unwrap(),
            "\"auto\""
        );
        assert_eq!(serde_json::to_string(&Auto::Value(3u64)).unwrap(), "3");
        let b: Auto<(f64, f64)> = serde_json::from_str("[0.9, 0.95]").unwrap();
        assert_eq!(b, Auto::Value((0.9, 0.95)));
    }
}
