//! The reference optimizer math: AdamW, learning-rate schedules, gradient
//! norm and clipping, and the dynamic loss scaler.
//!
//! (Types first; the functions are being filled in.)

use serde::{Deserialize, Serialize};

/// AdamW hyper-parameters (DeepSpeed `optimizer.params`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWParams {
    /// Peak learning rate (`lr`); a schedule may scale it per step.
    pub lr: f64,
    /// `betas[0]`.
    pub beta1: f64,
    /// `betas[1]`.
    pub beta2: f64,
    /// `eps`.
    pub eps: f64,
    /// Decoupled weight decay (`weight_decay`).
    pub weight_decay: f64,
}

/// How the learning rate rises during warm-up (DeepSpeed `warmup_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WarmupType {
    /// `"log"`: DeepSpeed's default.
    Log,
    /// `"linear"`.
    Linear,
}

/// A learning-rate schedule (DeepSpeed `scheduler`), or a constant rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LrSchedule {
    /// No scheduler: the optimizer's `lr` at every step.
    Constant {
        /// The rate.
        lr: f64,
    },
    /// `WarmupLR`: warm up from `min_lr` to `max_lr`, then stay.
    WarmupLr {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr`.
        max_lr: f64,
        /// `warmup_num_steps`.
        warmup_steps: u64,
        /// `warmup_type`.
        warmup_type: WarmupType,
    },
    /// `WarmupDecayLR`: WarmupLR, then linear decay to 0 at `total_steps`.
    WarmupDecayLr {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr`.
        max_lr: f64,
        /// `warmup_num_steps`.
        warmup_steps: u64,
        /// `total_num_steps`.
        total_steps: u64,
        /// `warmup_type`.
        warmup_type: WarmupType,
    },
    /// `WarmupCosineLR`: ratios of the optimizer's `lr`.
    WarmupCosineLr {
        /// The optimizer's `lr` (the ratios multiply it).
        base_lr: f64,
        /// `total_num_steps`.
        total_steps: u64,
        /// `warmup_min_ratio`.
        warmup_min_ratio: f64,
        /// `warmup_num_steps`.
        warmup_steps: u64,
        /// `cos_min_ratio`.
        cos_min_ratio: f64,
        /// `warmup_type`.
        warmup_type: WarmupType,
    },
}

/// fp16 loss scaling (DeepSpeed `fp16` block).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LossScaleConfig {
    /// `loss_scale` > 0: a fixed scale.
    Static {
        /// The scale.
        scale: f32,
    },
    /// `loss_scale` = 0: dynamic scaling.
    Dynamic {
        /// `2^initial_scale_power` is the first scale.
        initial_scale_power: u32,
        /// `loss_scale_window`: good steps before the scale doubles.
        window: u64,
        /// `hysteresis`: overflows tolerated before the scale halves.
        hysteresis: u32,
        /// `consecutive_hysteresis`: refill hysteresis on every good step.
        consecutive_hysteresis: bool,
        /// `min_loss_scale`.
        min_scale: f32,
    },
}
