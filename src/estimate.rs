//! The memory estimator: what a configuration will hold per rank on the
//! device, in host memory and on NVMe, before anything is allocated
//! (`zero estimate` on the command line).
//!
//! # One source of truth
//!
//! The estimate is not a formula beside the engine: it replays, against a
//! [`MemoryTracker`], every allocation the engine's
//! [`EngineBuilder::build`](crate::EngineBuilder::build) and its steps
//! account, with the same sizes:
//!
//! - units laid out by the same [`PartitionPlan`] (padding, shards),
//!   trainable segment then frozen segment: frozen tensors
//!   (`TensorSpec::frozen`, LoRA's base weights: [`Model::llama_lora`])
//!   have parameter bytes only — the whole segment at stages 0–2 and with
//!   `frozen_params` `resident` (the estimate's reading of `auto`), the
//!   rank's shard on the device (`shard`) or in host memory (`offload`),
//!   plus the buffers their stage-3 all-gathers use;
//! - per unit, the parameters (full, or the stage-3 shard), the stage 0/1
//!   gradient buffer, the gradient-accumulation buffer `A` (absent when
//!   `A = P`, no accumulation and no optimizer offload at stages 0/1), the
//!   fp32 master and moments (full at stage 0, else the shard);
//! - the gradient buckets: `min(reduce_bucket_size, model).max(largest
//!   unit)` elements of `communication_data_type`, two when reductions
//!   overlap backward (stage 0 always, stage 1 never, stages 2/3 with
//!   `overlap_comm`);
//! - stages 2/3: the pooled full-unit gradient buffers the trainer writes
//!   into (one per unit size in flight);
//! - stage 3: the gathered units, by running the engine's own gather
//!   schedule (`src/schedule.rs`: prefetch, reuse
//!   (`stage3_max_reuse_distance`), live cap (`stage3_max_live_parameters`)
//!   and persistence (`stage3_param_persistence_threshold`)) over the
//!   model's gather order and executing its launches and frees against the
//!   tracker, with the engine's pool of freed buffers per size;
//! - optimizer offload: the tiles of `sub_group_size` elements, the host
//!   pool (`buffer_count` tile buffers with nvme, one per tile with cpu,
//!   plus the staging buffer, each rounded to whole pages) and the swap
//!   file (header and regions rounded to `aio.block_size`);
//! - parameter offload: the host homes or swap file, the staging buffers
//!   (`buffer_count` × `buffer_size`, capped at the largest shard) and the
//!   `max_in_cpu` host cache.
//!
//! The engine computes some of these sizes inline; this module repeats
//! those rules, and `tests/estimate.rs` builds real engines and holds the
//! estimate against their trackers, so a divergence fails a test.
//!
//! # Peaks
//!
//! The tracker keeps current and peak bytes per tier and category and the
//! peak of each tier's sum. The estimate replays two optimizer steps
//! (micro-batches of the model's gather order, gradient hand-offs and
//! activations, then [`Engine::step`](crate::Engine::step)) and reports
//! the peaks the tracker would report: the first micro-batch records the
//! stage-3 gather order, and from the second on prefetch and reuse follow
//! it, so two steps reach the steady state.
//!
//! # Activations
//!
//! Activations are those of the Llama model of `examples/llama` (f32
//! compute): per block the cache of its forward pass, kept for backward
//! (`x`, both norms' outputs and inverse RMS, `q`, `k`, `v`, the attention
//! probabilities and output, the residual, the SwiGLU `h1`, `h3`, `a`, and
//! the block output), or with activation checkpointing only the block
//! input plus one recomputed cache during backward; and the trainer's
//! working memory: the f32 copy of the gathered unit it computes with,
//! and in backward a block's f32 gradients. A model given as unit sizes
//! ([`Model::from_unit_sizes`]) has no activation estimate.
//!
//! ```
//! use zero::core::config::{Precision, ResolvedConfig};
//! use zero::core::memory::{Category, Tier};
//! use zero::estimate::{estimate, Model, Workload};
//!
//! // 7e9 parameters in 32 units, bf16, stage 3 on 8 ranks.
//! let model = Model::from_unit_sizes(&[7_000_000_000 / 32; 32])?;
//! let mut cfg = ResolvedConfig::simple(3, 8, 1);
//! cfg.precision = Precision::Bf16;
//! let e = estimate(&model, &cfg, &Workload::default())?;
//! // ZeRO's 16Ψ/N with an fp32 gradient shard: 18Ψ/N.
//! let states = e.model_states(Tier::Device) as f64;
//! assert!((states / (18.0 * 7e9 / 8.0) - 1.0).abs() < 0.01);
//! assert!(e.tier_peak(Tier::Device) > e.peak(Tier::Device, Category::Master));
//! println!("{e}");
//! # Ok::<(), zero::Error>(())
//! ```

use std::collections::HashMap;
use std::fmt;

use zero_core::config::{CheckFor, FrozenParams, OffloadDevice, Precision, ResolvedConfig};
use zero_core::cuda::arena::{ArenaPlan, BufferRequest};
use zero_core::memory::{Allocation, Category, MemoryReport, MemoryTracker, Tier};
use zero_core::partition::{PartitionPlan, TensorSpec, UnitSpec};
use zero_core::DType;

use crate::schedule::{Action, Actions, Stage3Knobs, Stage3Schedule};
use crate::{Error, Result};

/// The page size host pools round every buffer to (`zero_offload::host::PAGE_SIZE`).
const PAGE: usize = zero_offload::host::PAGE_SIZE;

/// The dimensions of a Llama-architecture model, as in `examples/llama`:
/// units `model.embed_tokens` (`vocab × hidden`), one per block
/// (`model.layers.{i}`: q, k, v, o projections, SwiGLU gate, up and down,
/// two RMSNorm weights) and `lm_head` (final norm and an untied head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaDims {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width (`hidden_size`, `dim` in the example).
    pub hidden: usize,
    /// SwiGLU inner width (`intermediate_size`).
    pub intermediate: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); `heads` for plain
    /// multi-head attention.
    pub kv_heads: usize,
}

impl LlamaDims {
    /// Llama-2 7B: vocab 32000, hidden 4096, intermediate 11008, 32 layers,
    /// 32 heads (6.74e9 parameters).
    pub const LLAMA2_7B: LlamaDims = LlamaDims {
        vocab: 32000,
        hidden: 4096,
        intermediate: 11008,
        layers: 32,
        heads: 32,
        kv_heads: 32,
    };

    /// The intermediate width Llama derives from `hidden`: two thirds of
    /// `4 × hidden`, rounded up to a multiple of 256 (4096 → 11008).
    pub fn default_intermediate(hidden: usize) -> usize {
        (8 * hidden / 3).div_ceil(256) * 256
    }

    /// Checks the dims as the example does; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, msg: String| Err(config(format!("model.{key}"), msg));
        for (key, v) in [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
        ] {
            if v == 0 {
                return bad(key, "must be positive".into());
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return bad(
                "heads",
                format!("{} heads do not divide hidden {}", self.heads, self.hidden),
            );
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(
                "kv_heads",
                format!(
                    "{} kv heads do not divide {} heads",
                    self.kv_heads, self.heads
                ),
            );
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(
                "heads",
                format!("the head dim {} must be even for RoPE", self.head_dim()),
            );
        }
        Ok(())
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// `(d_in, d_out)` of projection `module` (by PEFT's names,
    /// [`LORA_TARGETS`]) in one block; `None` for another name. The LoRA
    /// adapters of the estimator and of `zero_llama::lora` take their
    /// shapes from here.
    pub fn projection_dims(&self, module: &str) -> Option<(usize, usize)> {
        let (d, h) = (self.hidden, self.intermediate);
        let (qd, kd) = (
            self.heads * self.head_dim(),
            self.kv_heads * self.head_dim(),
        );
        Some(match module {
            "q_proj" => (d, qd),
            "k_proj" | "v_proj" => (d, kd),
            "o_proj" => (qd, d),
            "gate_proj" | "up_proj" => (d, h),
            "down_proj" => (h, d),
            _ => return None,
        })
    }

    /// Parameters of one block.
    pub fn block_numel(&self) -> usize {
        let (d, h) = (self.hidden, self.intermediate);
        let (qd, kd) = (
            self.heads * self.head_dim(),
            self.kv_heads * self.head_dim(),
        );
        2 * qd * d + 2 * kd * d + 3 * h * d + 2 * d
    }

    /// All parameters (Ψ).
    pub fn numel(&self) -> usize {
        2 * self.vocab * self.hidden + self.hidden + self.layers * self.block_numel()
    }

    /// Bytes of one block's forward cache (f32) for `micro` sequences of
    /// `seq` tokens: what `examples/llama/src/train.rs` (`cache_bytes`) keeps
    /// per block between forward and backward.
    pub fn block_cache_bytes(&self, micro: usize, seq: usize) -> u64 {
        let (d, h) = (self.hidden, self.intermediate);
        let (qd, kd) = (
            self.heads * self.head_dim(),
            self.kv_heads * self.head_dim(),
        );
        let rows = (micro * seq) as u64;
        let per_row = (5 * d + 2 + 2 * qd + 2 * kd + 3 * h) as u64;
        let probs = (micro * self.heads * seq * seq) as u64;
        4 * (rows * per_row + probs)
    }

    /// Bytes of one block's input (f32): what activation checkpointing
    /// keeps per block.
    pub fn block_input_bytes(&self, micro: usize, seq: usize) -> u64 {
        4 * (micro * seq * self.hidden) as u64
    }
}

/// The pinned host slots a device trainer's LoRA dropout masks go up
/// through, each one block's masks (`zero_llama::device::MASK_SLOTS` is
/// this number; the estimate counts them).
pub const LORA_MASK_SLOTS: usize = 2;

/// The projections of a Llama/Qwen2 block that LoRA can target, with
/// PEFT's module names.
pub const LORA_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// LoRA adapters on a Llama model (PEFT's `LoraConfig`: `r` and
/// `target_modules`): each targeted projection `W: in → out` of every
/// block gets a trainable `A` (`r × in`) and `B` (`out × r`); every base
/// weight (embedding, blocks, head) is frozen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lora {
    /// The adapters' rank `r`.
    pub rank: usize,
    /// The targeted modules, by PEFT's names ([`LORA_TARGETS`]).
    pub targets: Vec<String>,
}

impl Lora {
    /// Checks the rank and the target names; the error names the key
    /// (`lora.rank`, `lora.targets`) and the unknown module.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(config("lora.rank".into(), "must be positive".into()));
        }
        if self.targets.is_empty() {
            return Err(config(
                "lora.targets".into(),
                "no target module given".into(),
            ));
        }
        if let Some(t) = self
            .targets
            .iter()
            .find(|t| !LORA_TARGETS.contains(&t.as_str()))
        {
            return Err(config(
                "lora.targets".into(),
                format!(
                    "`{t}` is not a projection of a Llama/Qwen2 block (one of {})",
                    LORA_TARGETS.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// The adapter elements of one block of `dims`: `r × (in + out)` per
    /// targeted projection.
    ///
    /// # Panics
    /// On a target not in [`LORA_TARGETS`] ([`Lora::validate`] refuses it).
    pub fn block_numel(&self, dims: &LlamaDims) -> usize {
        self.targets
            .iter()
            .map(|t| {
                let (i, o) = dims
                    .projection_dims(t)
                    .expect("the targets are validated against LORA_TARGETS");
                self.rank * (i + o)
            })
            .sum()
    }
}

/// The order in which a trainer uses the units in one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Script {
    /// Forward over the units in order, backward in reverse, each gathered
    /// both times; no activations.
    Generic,
    /// `examples/llama/src/train.rs`.
    Llama(LlamaDims),
}

/// A model, as the estimator sees it: its units and the order a trainer
/// uses them in.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    units: Vec<UnitSpec>,
    script: Script,
    /// [`Model::llama_lora`]'s adapters, and whether they drop out
    /// ([`Model::lora_dropout`]): what their activations add.
    lora: Option<(Lora, bool)>,
}

impl Model {
    /// A model of units of `sizes` elements (`unit.0`, `unit.1`, …), used
    /// forward in order and backward in reverse. Its activations are not
    /// estimated.
    ///
    /// # Errors
    /// If there is no unit or a unit has no element.
    pub fn from_unit_sizes(sizes: &[usize]) -> Result<Model> {
        if sizes.is_empty() {
            return Err(config("model.units".into(), "no unit given".into()));
        }
        if let Some(i) = sizes.iter().position(|&s| s == 0) {
            return Err(config(
                "model.units".into(),
                format!("unit {i} has 0 elements"),
            ));
        }
        let units = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| flat_unit(format!("unit.{i}"), n))
            .collect();
        Ok(Model {
            units,
            script: Script::Generic,
            lora: None,
        })
    }

    /// A model of the units a trainer registers (frozen tensors
    /// included), used forward in order and backward in reverse as
    /// [`Model::from_unit_sizes`]; units with only frozen tensors take no
    /// gradient. Its activations are not estimated.
    ///
    /// # Errors
    /// If there is no unit.
    pub fn from_units(units: Vec<UnitSpec>) -> Result<Model> {
        if units.is_empty() {
            return Err(config("model.units".into(), "no unit given".into()));
        }
        Ok(Model {
            units,
            script: Script::Generic,
            lora: None,
        })
    }

    /// `params` elements split into `units` units as equal as possible (the
    /// first ones one element larger), as [`Model::from_unit_sizes`].
    ///
    /// # Errors
    /// If `units` is 0 or larger than `params`.
    pub fn from_param_count(params: usize, units: usize) -> Result<Model> {
        if units == 0 || units > params {
            return Err(config(
                "model.units".into(),
                format!("cannot split {params} parameters into {units} units"),
            ));
        }
        let sizes: Vec<usize> = (0..units)
            .map(|i| params / units + usize::from(i < params % units))
            .collect();
        Model::from_unit_sizes(&sizes)
    }

    /// The Llama model of `examples/llama` with these dims: the units of
    /// `SftModel::register` and the gather order and activations of
    /// `SftModel::train_micro_batch`.
    ///
    /// # Errors
    /// If the dims are inconsistent ([`LlamaDims::validate`]).
    pub fn llama(dims: LlamaDims) -> Result<Model> {
        dims.validate()?;
        let mut units = vec![flat_unit(
            "model.embed_tokens".into(),
            dims.vocab * dims.hidden,
        )];
        for i in 0..dims.layers {
            units.push(flat_unit(format!("model.layers.{i}"), dims.block_numel()));
        }
        units.push(flat_unit(
            "lm_head".into(),
            dims.hidden + dims.vocab * dims.hidden,
        ));
        Ok(Model {
            units,
            script: Script::Llama(dims),
            lora: None,
        })
    }

    /// The Llama model of [`Model::llama`] with LoRA adapters: each block
    /// unit holds its base weights frozen (one tensor) and its adapters
    /// trainable (one tensor of [`Lora::block_numel`] elements); the
    /// embedding and the head are frozen units. A unit's frozen tensors
    /// have parameters only (no gradient, master or moments).
    ///
    /// # Errors
    /// Inconsistent dims or an invalid [`Lora`] (the error names the key).
    pub fn llama_lora(dims: LlamaDims, lora: &Lora) -> Result<Model> {
        lora.validate()?;
        let mut m = Model::llama(dims)?;
        let adapters = lora.block_numel(&dims);
        for u in &mut m.units {
            for t in &mut u.tensors {
                t.trainable = false;
            }
            if u.name.starts_with("model.layers.") {
                u.tensors.push(TensorSpec::new("lora", &[adapters]));
            }
        }
        m.lora = Some((lora.clone(), false));
        Ok(m)
    }

    /// With [`Model::llama_lora`]'s adapters: whether they train with
    /// dropout (`lora_dropout > 0`), whose masks the trainer keeps from a
    /// block's forward to its backward (the CPU trainer an f32 per input
    /// element of each adapter, the device trainer one bit:
    /// [`estimate_device`]). No effect on another model.
    pub fn lora_dropout(mut self, dropout: bool) -> Self {
        if let Some((_, d)) = &mut self.lora {
            *d = dropout;
        }
        self
    }

    /// The bytes a block's adapters keep for its backward on `micro`
    /// sequences of `seq` tokens: each adapter's `drop(x) Aᵀ` (`rows × r`
    /// f32) and, with dropout, its mask (`rows × in` f32, or bits on a
    /// device).
    fn lora_cache_bytes(&self, micro: usize, seq: usize, device: bool) -> u64 {
        let (Some((lora, dropout)), Script::Llama(d)) = (&self.lora, &self.script) else {
            return 0;
        };
        let rows = micro * seq;
        let (h, i) = (d.hidden, d.intermediate);
        let qd = d.heads * d.head_dim();
        lora.targets
            .iter()
            .map(|t| {
                let d_in = match t.as_str() {
                    "o_proj" => qd,
                    "down_proj" => i,
                    _ => h,
                };
                let n = rows * d_in;
                let mask = match (dropout, device) {
                    (false, _) => 0,
                    (true, false) => 4 * n,
                    (true, true) => 4 * n.div_ceil(32),
                };
                (4 * rows * lora.rank + mask) as u64
            })
            .sum()
    }

    /// The pinned host slots a device trainer's LoRA dropout masks go up
    /// through ([`LORA_MASK_SLOTS`]), each one block's
    /// masks for `micro` sequences of `seq` tokens: per adapter 1 bit per
    /// input element, in whole 32-bit words. 0 without LoRA dropout.
    fn lora_mask_slots_bytes(&self, micro: usize, seq: usize) -> u64 {
        let (Some((lora, true)), Script::Llama(d)) = (&self.lora, &self.script) else {
            return 0;
        };
        let words: usize = lora
            .targets
            .iter()
            .map(|t| {
                let (d_in, _) = d
                    .projection_dims(t)
                    .expect("the targets are validated against LORA_TARGETS");
                (micro * seq * d_in).div_ceil(32)
            })
            .sum();
        LORA_MASK_SLOTS as u64 * 4 * words as u64
    }

    /// The number of trainable parameters.
    pub fn trainable_numel(&self) -> usize {
        self.units
            .iter()
            .flat_map(|u| &u.tensors)
            .filter(|t| t.trainable)
            .map(TensorSpec::numel)
            .sum()
    }

    /// The units, in registration order (one flat tensor each: only sizes
    /// matter to the plan).
    pub fn units(&self) -> &[UnitSpec] {
        &self.units
    }

    /// The number of parameters (Ψ).
    pub fn numel(&self) -> usize {
        self.units.iter().map(UnitSpec::numel).sum()
    }

    /// The Llama dims, for a model built with [`Model::llama`].
    pub fn llama_dims(&self) -> Option<&LlamaDims> {
        match &self.script {
            Script::Llama(d) => Some(d),
            Script::Generic => None,
        }
    }
}

fn flat_unit(name: String, numel: usize) -> UnitSpec {
    UnitSpec::new(name, vec![TensorSpec::new("flat", &[numel])])
}

/// What one micro-batch processes, besides the config: the micro-batch
/// size is the config's `micro_batch_size` and the world size its
/// `world_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Workload {
    /// Tokens per sequence (0: no activations).
    pub seq_len: usize,
    /// Keep only block inputs in forward and recompute in backward.
    pub activation_checkpointing: bool,
}

/// The per-rank memory plan of one configuration: the peaks the rank's
/// [`MemoryTracker`] would report over training. Every rank of a plan
/// holds the same sizes (shards are equal), so one estimate stands for
/// each rank.
#[derive(Debug, Clone)]
pub struct Estimate {
    /// Ranks.
    pub world_size: usize,
    /// ZeRO stage.
    pub stage: u8,
    /// `offload_optimizer.device`.
    pub offload_optimizer: OffloadDevice,
    /// `offload_param.device`.
    pub offload_param: OffloadDevice,
    /// Parameters (Ψ), trainable and frozen.
    pub numel: usize,
    /// Trainable parameters (all of Ψ without frozen tensors).
    pub trainable_numel: usize,
    /// Trainable parameters including the padding of the partition plan.
    pub padded_numel: usize,
    /// Model states per tier once the engine is built, in [`Tier::ALL`]
    /// order: ZeRO's figure (16Ψ, 4Ψ+12Ψ/N, …, plus padding and the
    /// gradient-accumulation buffer where the engine keeps one).
    built_states: [u64; 3],
    /// The device-tier buffers the engine allocates when it is built, by
    /// name, and their bytes in all.
    device_buffers: Vec<BufferRequest>,
    built_device: u64,
    /// The tracker after two optimizer steps: `peak` fields are the
    /// estimate.
    report: MemoryReport,
}

impl Estimate {
    /// The peak bytes of (`tier`, `category`).
    pub fn peak(&self, tier: Tier, category: Category) -> u64 {
        self.report.get(tier, category).map_or(0, |r| r.peak)
    }

    /// The peak of the tier's sum over categories: what must fit.
    pub fn tier_peak(&self, tier: Tier) -> u64 {
        self.report.tier(tier).map_or(0, |t| t.peak)
    }

    /// The peak of the tier's model states (params, grads, master,
    /// moments), transient gradient buffers of stages 2/3 included, as
    /// [`MemoryTracker::model_states_peak`].
    pub fn model_states_peak(&self, tier: Tier) -> u64 {
        self.report.tier(tier).map_or(0, |t| t.model_states_peak)
    }

    /// The tier's model states right after the engine is built: ZeRO's
    /// figure, without the stage-2/3 gradient buffers of the backward pass.
    pub fn model_states(&self, tier: Tier) -> u64 {
        self.built_states[tier_index(tier)]
    }

    /// The device memory of rank `rank` as an arena plan
    /// ([`ArenaPlan`]): every buffer the engine allocates on the device
    /// when it is built, by name, and one more for what a step adds at its
    /// peak (gathered units, the gradient buffers of the backward pass).
    /// Its total is [`Estimate::tier_peak`] of the device tier plus, with
    /// optimizer offload, the gradient homes (and the `swap_gradients`
    /// window) that feed the host AdamW: host memory on the CPU backend,
    /// which this estimate accounts, but device memory on a GPU, where
    /// they are read through host views; and with parameter offload
    /// without optimizer offload, the two device slots AdamW writes the
    /// updated shards into on a GPU. [`ArenaPlan::check_capacity`]
    /// says, when it does not fit, which buffers are the largest and how
    /// many bytes are missing. The trainer's activations are not in it
    /// ([`device_plan_with`](Estimate::device_plan_with) adds them).
    pub fn device_plan(&self, rank: usize) -> Result<ArenaPlan> {
        self.device_plan_with(rank, 0)
    }

    /// [`device_plan`](Estimate::device_plan) with `workspace` bytes more
    /// for what the trainer allocates in a step (its activations and
    /// workspaces; 0: none).
    pub fn device_plan_with(&self, rank: usize, workspace: u64) -> Result<ArenaPlan> {
        let step = self
            .tier_peak(Tier::Device)
            .saturating_sub(self.built_device);
        let mut all = self.device_buffers.clone();
        if step > 0 {
            all.push(BufferRequest::new(
                "a step's gathered units and gradient buffers (peak)",
                Category::GatheredParams,
                step,
            ));
        }
        if workspace > 0 {
            all.push(BufferRequest::new(
                "the trainer's activations and workspaces (peak)",
                Category::Activations,
                workspace,
            ));
        }
        Ok(ArenaPlan::new(rank, all)?)
    }

    /// The simulated tracker's report (peaks are the estimate).
    pub fn report(&self) -> &MemoryReport {
        &self.report
    }

    /// Whether anything is accounted in `tier`.
    fn uses(&self, tier: Tier) -> bool {
        self.tier_peak(tier) > 0
    }
}

fn tier_index(tier: Tier) -> usize {
    Tier::ALL
        .iter()
        .position(|&t| t == tier)
        .expect("a tier of Tier::ALL")
}

impl fmt::Display for Estimate {
    /// The per-rank table of [`Table`], for this configuration alone.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = setup_label(self.stage, self.offload_optimizer, self.offload_param);
        write_table(f, &[(label, Ok(self))])
    }
}

/// An error naming a config key.
fn config(key: String, msg: String) -> Error {
    Error::Core(zero_core::Error::Config { key, msg })
}

/// Estimates the per-rank memory of training `model` with `cfg` (its
/// `world_size` ranks, `micro_batch_size` sequences per micro-batch) on
/// sequences of `work.seq_len` tokens.
///
/// # Errors
/// A config the engine would refuse (stage, offload settings; the error
/// names the key), or a model the partition plan rejects.
pub fn estimate(model: &Model, cfg: &ResolvedConfig, work: &Workload) -> Result<Estimate> {
    estimate_on(model, cfg, work, false)
}

/// [`estimate`] for an engine on a device backend (a GPU, or the CPU
/// backend staging as one): it adds the pinned host buffers such a
/// backend's transfers go through: with the offloaded optimizer the
/// copies of the gradient homes and of the parameters, with parameter
/// offload alone the two parameter-step slots (device and host), at
/// stage 3 the ring of shard uploads (`offload_param.buffer_count` of the
/// largest shard that goes up: a trainable one with parameter offload, a
/// frozen one with `frozen_params` `offload`; a resident frozen base does
/// not size it),
/// and with `swap_gradients` the window's host copy; LoRA's dropout masks
/// count one bit per element (the device trainer's), and the device
/// trainer's two pinned slots they go up through each hold a block's.
///
/// # Errors
/// As [`estimate`].
pub fn estimate_device(model: &Model, cfg: &ResolvedConfig, work: &Workload) -> Result<Estimate> {
    estimate_on(model, cfg, work, true)
}

fn estimate_on(
    model: &Model,
    cfg: &ResolvedConfig,
    work: &Workload,
    device: bool,
) -> Result<Estimate> {
    let plan = PartitionPlan::new(&model.units, cfg.world_size)?;
    cfg.check_runnable(&plan, CheckFor::Estimate)?;
    let mut sim = Sim::build(cfg, plan, device);
    let built_states = Tier::ALL.map(|t| sim.tracker.model_states(t));
    let built_device = sim.tracker.tier_current(Tier::Device);
    // The device trainer's pinned slots for LoRA's dropout masks, from its
    // first micro-batch on.
    let masks = model.lora_mask_slots_bytes(cfg.micro_batch_size, work.seq_len);
    if device && masks > 0 {
        let slots = sim
            .tracker
            .allocate(Tier::Host, Category::CommBuffers, masks);
        sim.allocs.push(slots);
    }
    let events = script(model, &sim.plan, cfg.micro_batch_size, work, device);
    let ga = cfg.gradient_accumulation_steps.max(1);
    for k in 0..2 * ga {
        sim.micro_batch(&events, (k + 1) % ga == 0);
    }
    Ok(Estimate {
        world_size: cfg.world_size,
        stage: cfg.zero.stage,
        offload_optimizer: cfg.zero.offload_optimizer.device,
        offload_param: cfg.zero.offload_param.device,
        numel: sim.plan.numel(),
        trainable_numel: sim.plan.trainable_numel(),
        padded_numel: sim.plan.padded_numel(),
        built_states,
        device_buffers: std::mem::take(&mut sim.named),
        built_device,
        report: sim.tracker.report(),
    })
}

/// What a trainer does in one micro-batch, as the tracker sees it.
#[derive(Debug, Clone, Copy)]
enum Event {
    Gather(usize),
    Release(usize),
    /// `grad_buffer(unit)`.
    TakeGrad(usize),
    /// `grad_ready(unit)`.
    GiveGrad(usize),
    /// Activations grow (or shrink) by this many bytes.
    Act(i64),
}

/// The events of one micro-batch of `model`.
fn script(
    model: &Model,
    plan: &PartitionPlan,
    micro: usize,
    work: &Workload,
    device: bool,
) -> Vec<Event> {
    use Event::*;
    let n = model.units.len();
    let mut ev = Vec::new();
    match model.script {
        Script::Generic => {
            for i in 0..n {
                ev.extend([Gather(i), Release(i)]);
            }
            for i in (0..n).rev() {
                ev.extend([Gather(i), TakeGrad(i), Release(i), GiveGrad(i)]);
            }
        }
        Script::Llama(d) => {
            // Units: 0 embedding, 1..=layers blocks, layers + 1 head.
            let (seq, ckpt) = (work.seq_len, work.activation_checkpointing);
            let cache = (d.block_cache_bytes(micro, seq)
                + model.lora_cache_bytes(micro, seq, device)) as i64;
            let input = d.block_input_bytes(micro, seq) as i64;
            let head = d.layers + 1;
            // The trainer's working memory, counted with the activations:
            // the f32 copy of a gathered unit (its tensors, both segments)
            // and a block's f32 gradients (its trainable tensors).
            let copy = |u: usize| {
                let l = &plan.units()[u];
                let n = if l.frozen_numel > 0 {
                    l.frozen_offset() + l.frozen_numel
                } else {
                    l.numel
                };
                4 * n as i64
            };
            let grads = |u: usize| 4 * plan.units()[u].numel as i64;
            ev.extend([Gather(0), Act(copy(0)), Act(-copy(0)), Release(0)]);
            for b in 1..=d.layers {
                ev.extend([
                    Gather(b),
                    Act(copy(b)),
                    Release(b),
                    Act(if ckpt { input } else { cache }),
                    Act(-copy(b)),
                ]);
            }
            // (The estimator's Llama has an untied LM head in its last unit.)
            ev.extend([
                Gather(head),
                Act(copy(head)),
                Release(head),
                Act(-copy(head)),
                TakeGrad(head),
                GiveGrad(head),
            ]);
            for b in (1..=d.layers).rev() {
                ev.extend([Gather(b), Act(copy(b))]);
                if ckpt {
                    ev.extend([Act(cache), Act(-input)]);
                }
                ev.extend([
                    Act(grads(b)),
                    Act(-cache),
                    Release(b),
                    TakeGrad(b),
                    GiveGrad(b),
                    Act(-grads(b) - copy(b)),
                ]);
            }
            ev.extend([TakeGrad(0), GiveGrad(0)]);
        }
    }
    ev
}

/// The engine's accounting of one rank, replayed (see the module docs).
struct Sim {
    plan: PartitionPlan,
    tracker: MemoryTracker,
    /// Bytes per parameter element.
    psize: u64,
    stage: u8,
    /// Everything allocated for the engine's life.
    allocs: Vec<Allocation>,
    /// The device-tier buffers of the build, by name.
    named: Vec<BufferRequest>,
    /// Stages 2/3: free pooled gradient buffers per length.
    grad_pool: HashMap<usize, usize>,
    /// Stage 3: the engine's gather schedule …
    s3: Stage3Schedule,
    /// … the actions of its last call …
    s3_actions: Actions,
    /// … and the free gathered buffers per length (the parameter
    /// gatherer's pool, `src/engine/gatherer.rs`).
    gathered_pool: HashMap<usize, usize>,
    /// Stage 3 with `frozen_params` `shard` or `offload`: frozen segments
    /// are all-gathered into a pooled buffer of their own, read there,
    /// and back in the pool when the unit is freed …
    frozen_gathers: bool,
    /// … the units holding one (in flight or gathered), and its length.
    frozen_inflight: HashMap<usize, usize>,
}

fn pdt_of(p: Precision) -> DType {
    p.param_dtype()
}

fn page(bytes: usize) -> u64 {
    bytes.div_ceil(PAGE) as u64 * PAGE as u64
}

/// The pinned host buffers (and device slots) a device backend's
/// transfers go through, as `EngineBuilder::build` allocates them when
/// the backend is a device (`src/engine/mod.rs`): the reducer's staged
/// gradient homes and `OffloadStage`'s parameter copies (optimizer
/// offload without parameter offload or `swap_gradients`),
/// `ParamStepStage`'s two slots (parameter offload alone), the stage-3
/// upload ring (`ParamGatherer::stage_uploads`) and the `swap_gradients`
/// window's host copy (`GradReducer::stage_window`).
fn device_staging(
    cfg: &ResolvedConfig,
    plan: &PartitionPlan,
    frozen: FrozenParams,
    track: &mut impl FnMut(Tier, Category, u64),
) {
    let stage = cfg.zero.stage;
    let psize = pdt_of(cfg.precision).size_in_bytes() as u64;
    let asize = cfg.grad_accum_dtype.size_in_bytes() as u64;
    let offloading = cfg.zero.offload_optimizer.device != OffloadDevice::None;
    let param_offloading = stage == 3 && cfg.zero.offload_param.device != OffloadDevice::None;
    let swap_grads = cfg.zero.offload_optimizer.swap_gradients;
    let units = plan.units();
    if swap_grads {
        let largest = units.iter().map(|u| u.shard_len).max().unwrap_or(0);
        track(Tier::Host, Category::Grads, largest.max(1) as u64 * asize);
    }
    let ring =
        crate::plan::upload_ring(cfg, plan, param_offloading, frozen == FrozenParams::Offload);
    if let (3, Some((count, len))) = (stage, ring) {
        track(Tier::Host, Category::Params, (count * len) as u64 * psize);
    }
    if offloading && !param_offloading && !swap_grads {
        for u in units {
            let home = if stage == 0 {
                u.padded_numel
            } else {
                u.shard_len
            };
            track(Tier::Host, Category::Grads, home as u64 * asize);
        }
        for u in units {
            let params = if stage == 3 {
                u.shard_len
            } else {
                u.param_len()
            };
            track(Tier::Host, Category::Params, params as u64 * psize);
        }
    }
    if param_offloading && !offloading {
        let largest = units.iter().map(|u| u.shard_len).max().unwrap_or(0).max(1) as u64;
        for _ in 0..2 {
            track(Tier::Device, Category::Params, largest * psize);
            track(Tier::Host, Category::CommBuffers, largest * psize);
        }
    }
}

/// The length of a swap file of regions `regions` (name, bytes):
/// `zero_offload::SwapFile::create`'s layout (header and each region
/// rounded up to whole blocks).
fn swap_file_len(block: u64, regions: &[(String, u64)]) -> u64 {
    // Magic, version, length, run id, rank, block size, file length,
    // region count; per region a u16 name length, the name, offset and
    // length; the CRC32.
    let fixed = 8 + 4 + 4 + 8 + 8 + 8 + 8 + 4;
    let header = fixed + regions.iter().map(|(n, _)| 2 + n.len() + 16).sum::<usize>() + 4;
    let block = block.max(1);
    let mut len = (header as u64).div_ceil(block) * block;
    for (_, bytes) in regions {
        len += bytes.div_ceil(block) * block;
    }
    len
}

impl Sim {
    /// `EngineBuilder::build`: every allocation it accounts.
    fn build(cfg: &ResolvedConfig, plan: PartitionPlan, device: bool) -> Sim {
        let tracker = MemoryTracker::new(0);
        let stage = cfg.zero.stage;
        let pdt = pdt_of(cfg.precision);
        let psize = pdt.size_in_bytes() as u64;
        let asize = cfg.grad_accum_dtype.size_in_bytes() as u64;
        let csize = cfg.communication_data_type.size_in_bytes() as u64;
        let offloading = cfg.zero.offload_optimizer.device != OffloadDevice::None;
        let alias = stage <= 1
            && cfg.grad_accum_dtype == pdt
            && cfg.gradient_accumulation_steps == 1
            && !offloading;
        let param_offloading = stage == 3 && cfg.zero.offload_param.device != OffloadDevice::None;
        let swap_grads = cfg.zero.offload_optimizer.swap_gradients;
        // `auto` is estimated as `resident` (the engine decides against the
        // machine's memory when it builds).
        let frozen = match cfg.zero.frozen_params {
            FrozenParams::Auto => FrozenParams::Resident,
            p => p,
        };
        let mut allocs = Vec::new();
        let mut track = |tier, cat, bytes: u64| allocs.push(tracker.allocate(tier, cat, bytes));
        // The device-tier buffers of the build, by name (for the engine's
        // check against the device's free memory).
        let mut named = Vec::new();
        let mut state_lens = Vec::new();
        for u in plan.units() {
            let mut device = |what: &str, cat, bytes: u64| {
                named.push(BufferRequest::new(
                    format!("{what} `{}`", u.name),
                    cat,
                    bytes,
                ));
            };
            let (full, shard) = (u.padded_numel as u64, u.shard_len as u64);
            let state_len = if stage == 0 { full } else { shard };
            // Stages 0–2 hold both segments; stage 3 its trainable shard
            // and, resident on every rank, the frozen segment.
            let p_len = if stage == 3 {
                shard
            } else {
                u.param_len() as u64
            };
            state_lens.push(state_len as usize);
            if stage == 3 && u.frozen_padded > 0 {
                let fs = u.frozen_shard_len() as u64 * psize;
                match frozen {
                    FrozenParams::Shard => {
                        track(Tier::Device, Category::Params, fs);
                        device("frozen shard", Category::Params, fs);
                    }
                    FrozenParams::Offload => track(Tier::Host, Category::Params, fs),
                    // Resident: the unit's own gathered buffer, kept.
                    _ => {
                        let frozen = u.frozen_padded as u64 * psize;
                        track(Tier::Device, Category::Params, frozen);
                        device("frozen params", Category::Params, frozen);
                        track(Tier::Device, Category::GatheredParams, full * psize);
                        device("gathered", Category::GatheredParams, full * psize);
                    }
                }
            }
            if !offloading {
                track(Tier::Device, Category::Master, state_len * 4);
                device("master", Category::Master, state_len * 4);
                track(Tier::Device, Category::Moments, state_len * 8);
                device("m and v", Category::Moments, state_len * 8);
            }
            if !param_offloading {
                track(Tier::Device, Category::Params, p_len * psize);
                device("params", Category::Params, p_len * psize);
            }
            if stage <= 1 {
                track(Tier::Device, Category::Grads, full * psize);
                device("grad", Category::Grads, full * psize);
            }
            if !alias && !swap_grads {
                let len = if stage == 0 { full } else { shard };
                let tier = if offloading { Tier::Host } else { Tier::Device };
                track(tier, Category::Grads, len * asize);
                // With optimizer offload on a device backend the home is
                // device memory too (the host tier on the CPU backend).
                device("grad home", Category::Grads, len * asize);
            }
        }
        if swap_grads {
            // `GradReducer`'s window (the largest shard, in A) and
            // `GradSwap`'s file and pool.
            let largest = plan.units().iter().map(|u| u.shard_len).max().unwrap_or(0);
            track(Tier::Host, Category::Grads, largest.max(1) as u64 * asize);
            // Device memory on a device backend, as the homes above.
            named.push(BufferRequest::new(
                "gradient window",
                Category::Grads,
                largest.max(1) as u64 * asize,
            ));
            let homes = crate::plan::grad_home_bytes(cfg, &plan);
            let regions: Vec<(String, u64)> = homes
                .iter()
                .enumerate()
                .filter(|(_, &b)| b > 0)
                .map(|(u, &b)| (format!("grad{u}"), b as u64))
                .collect();
            track(
                Tier::Nvme,
                Category::Grads,
                swap_file_len(cfg.zero.aio.block_size as u64, &regions),
            );
            let largest = homes.iter().copied().max().unwrap_or(0);
            let (count, size) = crate::plan::grad_swap_buffers(cfg, largest);
            track(Tier::Host, Category::CommBuffers, count as u64 * page(size));
        }
        // Buckets: the engine's.
        let (bucket_cap, count) = crate::plan::bucket_plan(cfg, &plan);
        for k in 0..count {
            track(
                Tier::Device,
                Category::CommBuffers,
                bucket_cap as u64 * csize,
            );
            named.push(BufferRequest::new(
                format!("bucket {k}"),
                Category::CommBuffers,
                bucket_cap as u64 * csize,
            ));
        }
        if offloading {
            optimizer_offload(cfg, psize as usize, &state_lens, &mut track);
        }
        if param_offloading {
            let shards: Vec<usize> = plan
                .units()
                .iter()
                .map(|u| u.shard_len * psize as usize)
                .collect();
            param_offload(cfg, &shards, &mut track);
            if !offloading {
                // On a device backend AdamW stays on the device and writes
                // two slots of the largest shard (`ParamStepStage`; their
                // host copies are pinned host memory there).
                let largest = shards.iter().copied().max().unwrap_or(0).max(1);
                named.push(BufferRequest::new(
                    "parameter step slots",
                    Category::Params,
                    2 * largest as u64,
                ));
            }
        }
        if device {
            device_staging(cfg, &plan, frozen, &mut track);
        }
        let s3 = Stage3Schedule::new(Stage3Knobs::from_config(cfg), plan.units());
        let mut sim = Sim {
            plan,
            tracker,
            named,
            psize,
            stage,
            allocs,
            grad_pool: HashMap::new(),
            s3,
            s3_actions: Actions::default(),
            gathered_pool: HashMap::new(),
            frozen_gathers: frozen != FrozenParams::Resident,
            frozen_inflight: HashMap::new(),
        };
        if stage == 3 {
            sim.stage3(Stage3Schedule::gather_persistent);
            // The units kept gathered for the engine's life
            // (`param_persistence_threshold`).
            let named: u64 = sim
                .named
                .iter()
                .filter(|b| b.category() == Category::GatheredParams)
                .map(BufferRequest::bytes)
                .sum();
            let kept = sim
                .tracker
                .current(Tier::Device, Category::GatheredParams)
                .saturating_sub(named);
            if kept > 0 {
                sim.named.push(BufferRequest::new(
                    "units kept gathered (param_persistence_threshold)",
                    Category::GatheredParams,
                    kept,
                ));
            }
        }
        sim
    }

    /// Unit `i`'s gradient buffer length (its trainable segment).
    fn padded(&self, i: usize) -> usize {
        self.plan.units()[i].padded_numel
    }

    /// Unit `i`'s gathered buffer length: both segments, or the
    /// trainable one where the frozen segment is gathered apart.
    fn gathered(&self, i: usize) -> usize {
        let u = &self.plan.units()[i];
        if self.frozen_gathers && u.frozen_padded > 0 {
            u.padded_numel
        } else {
            u.param_len()
        }
    }

    /// One micro-batch of `events`, then `Engine::step` (which runs the
    /// optimizer at a `boundary`).
    fn micro_batch(&mut self, events: &[Event], boundary: bool) {
        let mut act = self
            .tracker
            .allocate(Tier::Device, Category::Activations, 0);
        let mut live_act = 0i64;
        for &e in events {
            match e {
                Event::Gather(i) => {
                    if self.stage == 3 {
                        self.stage3(|s, out| s.gather(i, out));
                    }
                }
                Event::Release(i) => {
                    if self.stage == 3 {
                        self.stage3(|s, out| s.release(i, out));
                    }
                }
                // A unit with only frozen tensors has no gradient.
                Event::TakeGrad(i) | Event::GiveGrad(i) if self.padded(i) == 0 => {}
                Event::TakeGrad(i) => {
                    if self.stage >= 2 {
                        let len = self.padded(i);
                        match self.grad_pool.get_mut(&len).filter(|c| **c > 0) {
                            Some(c) => *c -= 1,
                            None => {
                                let bytes = len as u64 * self.psize;
                                let a = self.tracker.allocate(Tier::Device, Category::Grads, bytes);
                                self.allocs.push(a);
                            }
                        }
                    }
                }
                Event::GiveGrad(i) => {
                    if self.stage >= 2 {
                        *self.grad_pool.entry(self.padded(i)).or_default() += 1;
                    }
                }
                Event::Act(by) => {
                    live_act += by;
                    act.resize(live_act.max(0) as u64);
                }
            }
        }
        drop(act);
        // `Engine::step`: the end of a stage-3 micro-batch; after the
        // optimizer, persistent units are refreshed in their buffers (no
        // allocation) …
        if self.stage == 3 {
            self.stage3(Stage3Schedule::end_micro_batch);
            if boundary {
                self.stage3(Stage3Schedule::gather_persistent);
            }
            // … and the next micro-batch's first units are prefetched.
            // (With `overlap_comm` the engine starts these during AdamW,
            // before the refresh, which only waits: the same launches.)
            self.stage3(Stage3Schedule::prefetch_next);
        }
    }

    /// One call of the stage-3 schedule, executed against the tracker as
    /// the engine's parameter gatherer executes it against buffers: a
    /// launch takes a freed buffer of the unit's size or allocates one, a
    /// free returns it; refreshes, waits and swap reads ahead allocate
    /// nothing.
    fn stage3(&mut self, decide: impl FnOnce(&mut Stage3Schedule, &mut Actions)) {
        let mut actions = std::mem::take(&mut self.s3_actions);
        actions.clear();
        decide(&mut self.s3, &mut actions);
        for &action in &actions.list {
            match action {
                Action::Launch(i) if self.keeps_buffer(i) => {}
                Action::Launch(i) => {
                    self.take_gathered(self.gathered(i));
                    self.launch_frozen(i);
                }
                // A refresh keeps the gathered frozen segment (it never
                // changes); the wait hands it to the unit's guards where it
                // landed, until the free.
                Action::Refresh(_) | Action::Wait(_) => {}
                Action::Free(i) if self.keeps_buffer(i) => {}
                Action::Free(i) => {
                    *self.gathered_pool.entry(self.gathered(i)).or_default() += 1;
                    if let Some(len) = self.frozen_inflight.remove(&i) {
                        *self.gathered_pool.entry(len).or_default() += 1;
                    }
                }
                Action::ReadAhead(_) => {}
            }
        }
        self.s3_actions = actions;
    }

    /// Whether unit `i` keeps its own gathered buffer (resident frozen
    /// tensors), allocated at build.
    fn keeps_buffer(&self, i: usize) -> bool {
        !self.frozen_gathers && self.plan.units()[i].frozen_padded > 0
    }

    /// A pooled gathered buffer of `len` elements, or a new one.
    fn take_gathered(&mut self, len: usize) {
        match self.gathered_pool.get_mut(&len).filter(|c| **c > 0) {
            Some(c) => *c -= 1,
            None => {
                let bytes = len as u64 * self.psize;
                let a = self
                    .tracker
                    .allocate(Tier::Device, Category::GatheredParams, bytes);
                self.allocs.push(a);
            }
        }
    }

    /// The all-gather of unit `i`'s frozen shards, if they are sharded.
    fn launch_frozen(&mut self, i: usize) {
        let len = self.plan.units()[i].frozen_padded;
        if self.frozen_gathers && len > 0 && !self.frozen_inflight.contains_key(&i) {
            self.take_gathered(len);
            self.frozen_inflight.insert(i, len);
        }
    }
}

/// `Offload::new` (`src/engine/offload.rs`): tiles of `sub_group_size`
/// elements over the rank's flat state, `[master | m | v]` per tile.
fn optimizer_offload(
    cfg: &ResolvedConfig,
    psize: usize,
    state_lens: &[usize],
    track: &mut impl FnMut(Tier, Category, u64),
) {
    let oo = &cfg.zero.offload_optimizer;
    let total: usize = state_lens.iter().sum();
    let tiles: Vec<usize> = crate::plan::optimizer_tiles(cfg, state_lens)
        .iter()
        .map(|t| 12 * t.len())
        .collect();
    let max_tile = tiles.iter().copied().max().unwrap_or(0);
    // The staging buffer: the flat state, or one unit with the gradient
    // swap.
    let staged = if oo.swap_gradients {
        state_lens.iter().copied().max().unwrap_or(0)
    } else {
        total
    };
    let staging = (staged * psize).max(1);
    let nvme = oo.device == OffloadDevice::Nvme;
    let buffers = oo.buffer_count.max(1);
    let mut held: u64 = if nvme {
        buffers as u64 * page(max_tile.max(1))
    } else {
        tiles.iter().map(|&b| page(b)).sum()
    };
    held += page(staging);
    let state_bytes = (total * 4) as u64;
    let tier = if nvme { Tier::Nvme } else { Tier::Host };
    track(tier, Category::Master, state_bytes);
    track(tier, Category::Moments, 2 * state_bytes);
    let stored = if nvme {
        let regions: Vec<(String, u64)> = tiles
            .iter()
            .enumerate()
            .map(|(t, &b)| (format!("tile{t}"), b as u64))
            .collect();
        let file = swap_file_len(cfg.zero.aio.block_size as u64, &regions);
        track(
            Tier::Nvme,
            Category::CommBuffers,
            file.saturating_sub(3 * state_bytes),
        );
        0
    } else {
        3 * state_bytes
    };
    track(
        Tier::Host,
        Category::CommBuffers,
        held.saturating_sub(stored),
    );
}

/// `ParamOffload::new` (`src/engine/param_offload.rs`): `shards[i]` is
/// unit `i`'s shard in bytes.
fn param_offload(
    cfg: &ResolvedConfig,
    shards: &[usize],
    track: &mut impl FnMut(Tier, Category, u64),
) {
    let op = &cfg.zero.offload_param;
    let size = pdt_of(cfg.precision).size_in_bytes();
    let total: u64 = shards.iter().map(|&b| b as u64).sum();
    let buffers = op.buffer_count.max(1);
    if op.device == OffloadDevice::Nvme {
        let largest = shards.iter().copied().max().unwrap_or(0);
        let staging = op.buffer_size.saturating_mul(size).min(largest).max(1);
        let mut room = op.max_in_cpu.saturating_mul(size);
        let mut cache = 0u64;
        for &b in shards {
            if b <= room {
                room -= b;
                cache += page(b.max(1));
            }
        }
        if cache > 0 {
            track(Tier::Host, Category::Params, cache);
        }
        let regions: Vec<(String, u64)> = shards
            .iter()
            .enumerate()
            .map(|(i, &b)| (format!("unit{i}"), b.max(1) as u64))
            .collect();
        let file = swap_file_len(cfg.zero.aio.block_size as u64, &regions);
        track(Tier::Nvme, Category::Params, total);
        track(
            Tier::Nvme,
            Category::CommBuffers,
            file.saturating_sub(total),
        );
        track(
            Tier::Host,
            Category::CommBuffers,
            buffers as u64 * page(staging),
        );
    } else {
        let held: u64 = shards.iter().map(|&b| page(b.max(1))).sum();
        track(Tier::Host, Category::Params, total);
        track(
            Tier::Host,
            Category::CommBuffers,
            held.saturating_sub(total),
        );
    }
}

/// A row of the trade-off table: a stage and where optimizer state and
/// parameters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// Stage 0 (data parallel: everything replicated).
    Stage0,
    /// Stage 1 (optimizer state sharded).
    Stage1,
    /// Stage 2 (and gradients).
    Stage2,
    /// Stage 3 (and parameters).
    Stage3,
    /// Stage 3, `offload_optimizer.device = "cpu"`.
    Stage3OffloadOptimizer,
    /// Stage 3, `offload_optimizer` and `offload_param` on `"cpu"`.
    Stage3OffloadAll,
    /// Stage 3, `offload_optimizer` and `offload_param` on `"nvme"`.
    Stage3Nvme,
}

impl Setup {
    /// Every row, in table order.
    pub const ALL: [Setup; 7] = [
        Setup::Stage0,
        Setup::Stage1,
        Setup::Stage2,
        Setup::Stage3,
        Setup::Stage3OffloadOptimizer,
        Setup::Stage3OffloadAll,
        Setup::Stage3Nvme,
    ];

    /// The stage and the optimizer and parameter offload devices.
    pub fn parts(self) -> (u8, OffloadDevice, OffloadDevice) {
        use OffloadDevice::{Cpu, None, Nvme};
        match self {
            Setup::Stage0 => (0, None, None),
            Setup::Stage1 => (1, None, None),
            Setup::Stage2 => (2, None, None),
            Setup::Stage3 => (3, None, None),
            Setup::Stage3OffloadOptimizer => (3, Cpu, None),
            Setup::Stage3OffloadAll => (3, Cpu, Cpu),
            Setup::Stage3Nvme => (3, Nvme, Nvme),
        }
    }

    /// `cfg` with this row's stage and offload devices (other settings
    /// kept; `overlap_comm` turned on for stage 3, as DeepSpeed's default;
    /// `offload_optimizer.swap_gradients` only on the nvme row).
    pub fn apply(self, cfg: &ResolvedConfig) -> ResolvedConfig {
        let (stage, oo, op) = self.parts();
        let mut c = cfg.clone();
        c.zero.stage = stage;
        c.zero.overlap_comm = c.zero.overlap_comm || stage == 3;
        c.zero.offload_optimizer.device = oo;
        c.zero.offload_param.device = op;
        c.zero.offload_optimizer.swap_gradients &= oo == OffloadDevice::Nvme;
        c
    }

    /// The row's label (`"0"`, …, `"3+opt cpu"`, `"3+opt+param cpu"`,
    /// `"3+nvme"`).
    pub fn label(self) -> String {
        let (s, oo, op) = self.parts();
        setup_label(s, oo, op)
    }
}

fn setup_label(stage: u8, oo: OffloadDevice, op: OffloadDevice) -> String {
    use OffloadDevice::None;
    match (oo, op) {
        (None, None) => stage.to_string(),
        (o, None) => format!("{stage}+opt {o}"),
        (None, p) => format!("{stage}+param {p}"),
        (o, p) if o == p => {
            if o == OffloadDevice::Nvme {
                format!("{stage}+nvme")
            } else {
                format!("{stage}+opt+param {o}")
            }
        }
        (o, p) => format!("{stage}+opt {o}+param {p}"),
    }
}

/// The trade-off table: one [`Estimate`] per [`Setup`] (or the error that
/// configuration gets, e.g. an `offload_param.buffer_size` too small for
/// a shard).
#[derive(Debug)]
pub struct Table {
    /// The rows, in [`Setup::ALL`] order.
    pub rows: Vec<(Setup, Result<Estimate>)>,
}

/// Estimates every [`Setup`] of `cfg` (see [`estimate`]), like DeepSpeed's
/// `estimate_zero3_model_states_mem_needs_all_live` but for every stage
/// and with buffers and activations.
pub fn estimate_table(model: &Model, cfg: &ResolvedConfig, work: &Workload) -> Table {
    table_on(model, cfg, work, false)
}

/// [`estimate_table`] of [`estimate_device`]: for an engine on a device
/// backend.
pub fn estimate_table_device(model: &Model, cfg: &ResolvedConfig, work: &Workload) -> Table {
    table_on(model, cfg, work, true)
}

fn table_on(model: &Model, cfg: &ResolvedConfig, work: &Workload, device: bool) -> Table {
    let rows = Setup::ALL
        .iter()
        .map(|&s| (s, estimate_on(model, &s.apply(cfg), work, device)))
        .collect();
    Table { rows }
}

impl fmt::Display for Table {
    /// One line per row and tier in use: the tier's peak, ZeRO's model
    /// states at build, and each category's peak.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows: Vec<(String, std::result::Result<&Estimate, String>)> = self
            .rows
            .iter()
            .map(|(s, r)| (s.label(), r.as_ref().map_err(ToString::to_string)))
            .collect();
        write_table(f, &rows)
    }
}

/// Bytes in binary units: `512 B`, `3.0 KiB`, `12.5 MiB`, `104.36 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u >= 3 {
        format!("{v:.2} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn write_table(
    f: &mut fmt::Formatter<'_>,
    rows: &[(String, std::result::Result<&Estimate, String>)],
) -> fmt::Result {
    let mut header = vec![
        "setup".to_string(),
        "tier".into(),
        "peak".into(),
        "states".into(),
    ];
    header.extend(Category::ALL.iter().map(|c| match c {
        Category::GatheredParams => "gathered".to_string(),
        Category::CommBuffers => "comm".to_string(),
        c => c.as_str().to_string(),
    }));
    let mut lines = vec![header];
    let mut errors = Vec::new();
    for (label, r) in rows {
        match r {
            Ok(e) => {
                let mut first = true;
                for tier in Tier::ALL {
                    // The device line always shows; others where used.
                    let shown = e.uses(tier) || (tier == Tier::Device && first);
                    if !shown {
                        continue;
                    }
                    let mut line = vec![
                        if first { label.clone() } else { String::new() },
                        tier.as_str().to_string(),
                        format_bytes(e.tier_peak(tier)),
                        format_bytes(e.model_states(tier)),
                    ];
                    line.extend(Category::ALL.iter().map(|&c| match e.peak(tier, c) {
                        0 => "-".to_string(),
                        b => format_bytes(b),
                    }));
                    lines.push(line);
                    first = false;
                }
            }
            Err(msg) => errors.push(format!("{label}: not possible: {msg}")),
        }
    }
    let widths: Vec<usize> = (0..lines[0].len())
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    for (k, line) in lines.iter().enumerate() {
        if k > 0 {
            writeln!(f)?;
        }
        let mut text = String::new();
        for (i, (cell, w)) in line.iter().zip(&widths).enumerate() {
            if i < 2 {
                text.push_str(&format!("{cell:<w$}  "));
            } else {
                text.push_str(&format!("{cell:>w$}  "));
            }
        }
        f.write_str(text.trim_end())?;
    }
    for e in errors {
        write!(f, "\n{e}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_in_binary_prefixes() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(3 << 20), "3.0 MiB");
        assert_eq!(format_bytes(112 << 30), "112.00 GiB");
    }

    #[test]
    fn llama_dims_count_parameters_as_the_example() {
        let d = LlamaDims::LLAMA2_7B;
        assert_eq!(d.numel(), 6_738_415_616);
        assert_eq!(LlamaDims::default_intermediate(4096), 11008);
        let m = Model::llama(d).unwrap();
        assert_eq!(m.units().len(), 34);
        assert_eq!(m.numel(), d.numel());
        let bad = LlamaDims { kv_heads: 5, ..d };
        assert!(Model::llama(bad)
            .unwrap_err()
            .to_string()
            .contains("model.kv_heads"));
    }

    #[test]
    fn swap_header_takes_one_block() {
        let regions = [("tile0".to_string(), 10u64), ("tile1".to_string(), 1 << 20)];
        assert_eq!(swap_file_len(1 << 20, &regions), 3 << 20);
    }

    #[test]
    fn split_param_count() {
        let m = Model::from_param_count(10, 3).unwrap();
        let sizes: Vec<usize> = m.units().iter().map(UnitSpec::numel).collect();
        assert_eq!(sizes, [4, 3, 3]);
        assert!(Model::from_param_count(2, 3).is_err());
        assert!(Model::from_unit_sizes(&[]).is_err());
    }

    #[test]
    fn labels() {
        let labels: Vec<String> = Setup::ALL.iter().map(|s| s.label()).collect();
        assert_eq!(
            labels,
            ["0", "1", "2", "3", "3+opt cpu", "3+opt+param cpu", "3+nvme"]
        );
    }
}
