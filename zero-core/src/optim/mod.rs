//! The reference optimizer math: AdamW, learning-rate schedules, gradient
//! norm and clipping, and the dynamic loss scaler.
//!
//! Everything here is the *definition* that faster versions (the SIMD CPU
//! AdamW, the CUDA kernel, the multi-threaded norm) must reproduce bit for
//! bit, so the order of operations and the use of fused multiply-add are part
//! of each contract and are written out below.
//!
//! # AdamW
//!
//! [`AdamWStep::new`] computes the per-step constants once, in f64, and rounds
//! each to f32 once (`step` counts from 1, `lr` is the scheduled rate):
//!
//! ```text
//! bias1          = 1 - beta1^step            (f64, powi)
//! bias2          = 1 - beta2^step
//! step_size      = lr / bias1
//! inv_sqrt_bias2 = 1 / sqrt(bias2)
//! decay          = 1 - lr * weight_decay
//! beta1, beta2, one_minus_beta1 = 1 - beta1, one_minus_beta2 = 1 - beta2, eps
//! ```
//!
//! [`adamw_element`] then updates one element entirely in f32, where
//! `fma(a, b, c)` is `a.mul_add(b, c)` (one rounding):
//!
//! ```text
//! g  = grad * grad_scale
//! m' = fma(beta1, m, one_minus_beta1 * g)
//! v' = fma(beta2, v, (one_minus_beta2 * g) * g)
//! d  = fma(sqrt(v'), inv_sqrt_bias2, eps)
//! p' = fma(-step_size, m' / d, p * decay)
//! ```
//!
//! This is torch's `AdamW` (decoupled weight decay, bias correction folded
//! into the step size and the denominator) up to f32 rounding.
//! [`adamw_reference`] applies it over slices with gradients and moments of
//! any [`Element`] type and an optional low-precision copy of the result.
//!
//! # Gradient norm
//!
//! [`sum_squares`] has a fixed summation order: chunks of [`NORM_CHUNK`]
//! elements; within a chunk [`NORM_LANES`] f64 lanes, lane `j` taking the
//! chunk-relative indices `i ≡ j (mod 16)` in increasing order; the lanes
//! combined by the pairwise tree `16 → 8 → 4 → 2 → 1` (adjacent pairs); the
//! chunk sums added in chunk order, starting from `0.0`. Chunks may thus be
//! computed in parallel ([`sum_squares_chunk`]) and added in order.
//! [`clip_coefficient`] is DeepSpeed's `max_norm / (norm + 1e-6)`, capped at 1.
//!
//! # Learning-rate schedules
//!
//! [`LrSchedule::lr_at`] replicates DeepSpeed's `WarmupLR`, `WarmupDecayLR`
//! and `WarmupCosineLR` (`deepspeed/runtime/lr_schedules.py`) in the same
//! f64 operation order, for the scheduler's `last_batch_iteration` = the
//! number of optimizer steps already taken.
//!
//! # Loss scaling
//!
//! [`LossScaler`] is DeepSpeed's `DynamicLossScaler.update_scale` (or a
//! static scale): hysteresis, consecutive hysteresis, doubling after a window
//! of good steps counted from the last overflow, a floor at `min_scale`.

use serde::{Deserialize, Serialize};

use crate::{Element, Error, Result};

mod cpu;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use cpu::{AdamWSlices, CpuAdamW, Isa, DEFAULT_TILE};

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
    /// `WarmupDecayLR`: WarmupLR, then linear decay to `min_lr` at
    /// `total_steps` (DeepSpeed interpolates `min_lr + (max_lr - min_lr) * gamma`).
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

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

impl AdamWParams {
    /// torch's `AdamW` defaults: `lr` 1e-3, betas (0.9, 0.999), `eps` 1e-8,
    /// `weight_decay` 0.01.
    pub fn torch_default() -> Self {
        AdamWParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Per-step constants, computed once per step in f64 and rounded to f32.
///
/// See [`AdamWStep::new`] for how each is derived and [`adamw_element`] for
/// how they are used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Multiplies every raw gradient element before use.
    pub grad_scale: f32,
    /// `beta1`.
    pub beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta1`, computed in f64.
    pub one_minus_beta1: f32,
    /// `1 - beta2`, computed in f64.
    pub one_minus_beta2: f32,
    /// `eps`.
    pub eps: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `1 / sqrt(1 - beta2^step)`.
    pub inv_sqrt_bias2: f32,
    /// `1 - lr * weight_decay`: the decoupled weight-decay factor.
    pub decay: f32,
}

impl AdamWStep {
    /// The constants of update number `step`.
    ///
    /// `step` counts from 1 (the first update; 0 is treated as 1, so the
    /// constants stay finite). `lr` is the scheduled rate for this step
    /// ([`LrSchedule::lr_at`]). `grad_scale` multiplies every raw gradient
    /// element: the engine folds `1/loss_scale`, the clip coefficient and
    /// `1/(ranks * accumulation steps)` into it.
    ///
    /// In f64: `bias1 = 1 - beta1.powi(step)`, `bias2 = 1 - beta2.powi(step)`
    /// (the exponent saturates at `i32::MAX`), `step_size = lr / bias1`,
    /// `inv_sqrt_bias2 = 1 / sqrt(bias2)`, `decay = 1 - lr * weight_decay`,
    /// `one_minus_beta{1,2} = 1 - beta{1,2}`; each is then rounded to f32
    /// once, as are `beta1`, `beta2` and `eps`.
    pub fn new(p: &AdamWParams, lr: f64, step: u64, grad_scale: f32) -> Self {
        let n = step.clamp(1, i32::MAX as u64) as i32;
        let bias1 = 1.0 - p.beta1.powi(n);
        let bias2 = 1.0 - p.beta2.powi(n);
        AdamWStep {
            grad_scale,
            beta1: p.beta1 as f32,
            beta2: p.beta2 as f32,
            one_minus_beta1: (1.0 - p.beta1) as f32,
            one_minus_beta2: (1.0 - p.beta2) as f32,
            eps: p.eps as f32,
            step_size: (lr / bias1) as f32,
            inv_sqrt_bias2: (1.0 / bias2.sqrt()) as f32,
            decay: (1.0 - lr * p.weight_decay) as f32,
        }
    }
}

/// Reference AdamW update of one element, all in f32.
///
/// With `fma(a, b, c) = a.mul_add(b, c)` (one rounding):
///
/// ```text
/// g  = grad * grad_scale
/// m' = fma(beta1, m, one_minus_beta1 * g)
/// v' = fma(beta2, v, (one_minus_beta2 * g) * g)
/// d  = fma(sqrt(v'), inv_sqrt_bias2, eps)
/// p' = fma(-step_size, m' / d, p * decay)
/// ```
///
/// Returns `(p', m', v')`. Every faster implementation must give the same
/// bits.
#[inline]
pub fn adamw_element(k: &AdamWStep, p: f32, grad: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let g = grad * k.grad_scale;
    let m1 = k.beta1.mul_add(m, k.one_minus_beta1 * g);
    let v1 = k.beta2.mul_add(v, (k.one_minus_beta2 * g) * g);
    let d = v1.sqrt().mul_add(k.inv_sqrt_bias2, k.eps);
    let p1 = (-k.step_size).mul_add(m1 / d, p * k.decay);
    (p1, m1, v1)
}

/// The length check of [`adamw_reference`] and of the fast kernels:
/// [`Error::InvalidSize`] (op `"adamw"`) naming every length, with `what`
/// (e.g. `"part 2: "`) in front.
pub(crate) fn check_adamw_lengths(
    what: &str,
    n: usize,
    grad: usize,
    m: usize,
    v: usize,
    low: Option<usize>,
) -> Result<()> {
    if grad == n && m == n && v == n && low.is_none_or(|l| l == n) {
        return Ok(());
    }
    let low_msg = low.map_or(String::new(), |l| format!(", low {l}"));
    Err(Error::InvalidSize {
        op: "adamw",
        msg: format!("{what}slice lengths differ: master {n}, grad {grad}, m {m}, v {v}{low_msg}"),
    })
}

/// Reference AdamW over slices: [`adamw_element`] on every index.
///
/// - `master`: the fp32 master parameters, updated in place.
/// - `grad`: gradients of any [`Element`] type, widened with `to_f32`.
/// - `m`, `v`: the moments, of any [`Element`] type `M` (f32 normally; bf16
///   is DeepSpeed's bf16 optimizer state): widened with `to_f32`, updated,
///   and narrowed back with `from_f32` (round to nearest even).
/// - `low`: if given, receives the low-precision copy `P::from_f32(p')`.
///
/// Every slice must have `master.len()` elements; otherwise this returns
/// [`Error::InvalidSize`] (op `"adamw"`) naming the lengths, and changes
/// nothing.
pub fn adamw_reference<G: Element, M: Element, P: Element>(
    k: &AdamWStep,
    master: &mut [f32],
    grad: &[G],
    m: &mut [M],
    v: &mut [M],
    low: Option<&mut [P]>,
) -> Result<()> {
    check_adamw_lengths(
        "",
        master.len(),
        grad.len(),
        m.len(),
        v.len(),
        low.as_ref().map(|l| l.len()),
    )?;
    let n = master.len();
    let mut low = low;
    for i in 0..n {
        let (p1, m1, v1) =
            adamw_element(k, master[i], grad[i].to_f32(), m[i].to_f32(), v[i].to_f32());
        master[i] = p1;
        m[i] = M::from_f32(m1);
        v[i] = M::from_f32(v1);
        if let Some(low) = low.as_deref_mut() {
            low[i] = P::from_f32(p1);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Gradient norm and clipping
// ---------------------------------------------------------------------------

/// Number of f64 accumulators per chunk in [`sum_squares`].
pub const NORM_LANES: usize = 16;

/// Elements per chunk in [`sum_squares`]; chunks are the unit of parallelism.
pub const NORM_CHUNK: usize = 1 << 16;

/// Sum of squares of one chunk, in [`sum_squares`]'s order.
///
/// Lane `j` (`0..NORM_LANES`) accumulates `x[i]^2` (squared in f64, which is
/// exact for every [`Element`]) for `i ≡ j (mod 16)`, in increasing `i`,
/// starting from `0.0`; the lanes are then combined by summing adjacent pairs
/// level by level (`16 → 8 → 4 → 2 → 1`), i.e.
/// `(((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)))+(...)`.
///
/// Meant for slices of at most [`NORM_CHUNK`] elements; a longer slice is
/// treated as one chunk (which is not what [`sum_squares`] does).
pub fn sum_squares_chunk<G: Element>(x: &[G]) -> f64 {
    let mut lanes = [0.0f64; NORM_LANES];
    for (i, e) in x.iter().enumerate() {
        let y = f64::from(e.to_f32());
        lanes[i % NORM_LANES] += y * y;
    }
    combine_lanes(lanes)
}

/// The pairwise tree `16 → 8 → 4 → 2 → 1` of [`sum_squares_chunk`].
pub(crate) fn combine_lanes(mut lanes: [f64; NORM_LANES]) -> f64 {
    let mut width = NORM_LANES;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            lanes[j] = lanes[2 * j] + lanes[2 * j + 1];
        }
    }
    lanes[0]
}

/// Sum of squares of `x` in f64, in a fixed order.
///
/// The slice is cut into chunks of [`NORM_CHUNK`] elements (the last may be
/// shorter); each chunk is reduced by [`sum_squares_chunk`] (16 lanes, lane
/// `j` taking chunk-relative indices `i ≡ j (mod 16)` in increasing `i`, then
/// the pairwise tree `16 → 8 → 4 → 2 → 1`); the chunk results are added in
/// chunk order starting from `0.0`. An empty slice gives `0.0`.
///
/// A NaN or infinite element gives a non-finite result (squares are never
/// negative, so infinities cannot cancel): overflow detection relies on it.
pub fn sum_squares<G: Element>(x: &[G]) -> f64 {
    x.chunks(NORM_CHUNK)
        .fold(0.0, |acc, chunk| acc + sum_squares_chunk(chunk))
}

/// DeepSpeed's gradient-clipping coefficient for `gradient_clipping`
/// `max_norm`: `max_norm / (total_norm + 1e-6)`, capped at `1.0`.
///
/// `total_norm` is the global L2 norm of the unscaled gradients. Returns
/// `1.0` when clipping is off (`max_norm` is 0, negative or NaN, as in
/// DeepSpeed's `clip_grad > 0` test) or `total_norm` is not finite (the step
/// is then skipped as an overflow anyway).
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    // `max_norm > 0` is false for NaN, too: clipping is then off.
    let clipping = max_norm > 0.0;
    if !clipping || !total_norm.is_finite() {
        return 1.0;
    }
    let coef = max_norm / (total_norm + 1e-6);
    if coef < 1.0 {
        coef
    } else {
        1.0
    }
}

// ---------------------------------------------------------------------------
// Learning-rate schedules
// ---------------------------------------------------------------------------

/// DeepSpeed's warm-up fraction at iteration `it` of a warm-up of `w >= 2`
/// steps (valid for `it < w`): `(1/ln w) * ln(it + 1)` or `it / w`.
fn warmup_gamma(warmup_type: WarmupType, it: u64, w: u64) -> f64 {
    match warmup_type {
        WarmupType::Log => {
            let inverse_log_warm_up = 1.0 / (w as f64).ln();
            inverse_log_warm_up * ((it + 1) as f64).ln()
        }
        WarmupType::Linear => it as f64 / w as f64,
    }
}

impl LrSchedule {
    /// The learning rate of the update that follows `step` completed
    /// optimizer steps (`0` for the first update).
    ///
    /// `step` is DeepSpeed's `last_batch_iteration`: its schedulers use
    /// iteration 0 for the first update and are stepped after every applied
    /// optimizer step (not after a step skipped for overflow). The formulas
    /// and their f64 operation order are DeepSpeed's, with
    /// `w = max(2, warmup_steps)` (so 0 and 1 behave as 2):
    ///
    /// - `Constant`: `lr`.
    /// - `WarmupLr`: `min_lr + (max_lr - min_lr) * gamma`, where
    ///   `gamma = (1 / ln w) * ln(step + 1)` (log) or `step / w` (linear)
    ///   while `step < w`, and `1.0` after.
    /// - `WarmupDecayLr`: the same warm-up; for `step >= w`,
    ///   `gamma = max(0, (total - step) / max(1, total - w))`, so the rate
    ///   falls linearly to `min_lr` at `total_steps` and stays there.
    /// - `WarmupCosineLr`: `base_lr * ratio`; while `step < w`,
    ///   `ratio = warmup_min_ratio + gamma * (1 - warmup_min_ratio)`; after,
    ///   with `progress = min(1, (step - w + 1) / max(1, total - w))`,
    ///   `ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi *
    ///   progress)) / 2)`, which stays at `cos_min_ratio` past the end.
    pub fn lr_at(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
            } => {
                let w = warmup_steps.max(2);
                let gamma = if step < w {
                    warmup_gamma(warmup_type, step, w)
                } else {
                    1.0
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            LrSchedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                total_steps,
                warmup_type,
            } => {
                let w = warmup_steps.max(2);
                let gamma = if step < w {
                    warmup_gamma(warmup_type, step, w)
                } else {
                    let remaining = (i128::from(total_steps) - i128::from(step)) as f64;
                    let span = (i128::from(total_steps) - i128::from(w)).max(1) as f64;
                    (remaining / span).max(0.0)
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            LrSchedule::WarmupCosineLr {
                base_lr,
                total_steps,
                warmup_min_ratio,
                warmup_steps,
                cos_min_ratio,
                warmup_type,
            } => {
                let w = warmup_steps.max(2);
                let ratio = if step < w {
                    let gamma = warmup_gamma(warmup_type, step, w);
                    warmup_min_ratio + gamma * (1.0 - warmup_min_ratio)
                } else {
                    let real_last_step = (step - w + 1) as f64;
                    let real_total_steps = (i128::from(total_steps) - i128::from(w)).max(1) as f64;
                    let progress = (real_last_step / real_total_steps).min(1.0);
                    let cosine = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
                    (cos_min_ratio + (1.0 - cos_min_ratio) * cosine).max(0.0)
                };
                base_lr * ratio
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Loss scaling
// ---------------------------------------------------------------------------

/// The largest power of two an f32 holds; doubling stops there.
const MAX_SCALE: f32 = 1.701_411_8e38; // 2^127

/// fp16 loss scaler: static, or DeepSpeed's `DynamicLossScaler`.
///
/// Its whole state serializes, so a checkpoint resumes it exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The scale the next backward pass multiplies the loss by.
    cur_scale: f32,
    /// Number of [`LossScaler::update`] calls so far.
    cur_iter: u64,
    /// `cur_iter` of the last overflow; -1 before the first.
    last_overflow_iter: i64,
    /// Overflows still tolerated before the scale halves.
    cur_hysteresis: u32,
    /// The configuration this scaler follows.
    config: LossScaleConfig,
}

impl LossScaler {
    /// A fresh scaler: the static scale, or `2^initial_scale_power` with the
    /// full hysteresis.
    ///
    /// An `initial_scale_power` above 127 (past the f32 range) starts at
    /// `2^127`.
    pub fn new(cfg: LossScaleConfig) -> Self {
        let (cur_scale, cur_hysteresis) = match cfg {
            LossScaleConfig::Static { scale } => (scale, 0),
            LossScaleConfig::Dynamic {
                initial_scale_power,
                hysteresis,
                ..
            } => (2f32.powi(initial_scale_power.min(127) as i32), hysteresis),
        };
        LossScaler {
            cur_scale,
            cur_iter: 0,
            last_overflow_iter: -1,
            cur_hysteresis,
            config: cfg,
        }
    }

    /// The current loss scale.
    pub fn scale(&self) -> f32 {
        self.cur_scale
    }

    /// The number of [`LossScaler::update`] calls so far.
    pub fn iteration(&self) -> u64 {
        self.cur_iter
    }

    /// The iteration of the last overflow, `None` before the first.
    pub fn last_overflow_iteration(&self) -> Option<u64> {
        u64::try_from(self.last_overflow_iter).ok()
    }

    /// Overflows still tolerated before the scale halves (dynamic only; 0
    /// for a static scaler).
    pub fn hysteresis(&self) -> u32 {
        self.cur_hysteresis
    }

    /// The configuration this scaler follows.
    pub fn config(&self) -> &LossScaleConfig {
        &self.config
    }

    /// Records the outcome of one step's overflow check (agreed by all ranks)
    /// and returns whether the step must be skipped, which is `overflow`.
    ///
    /// Static: the scale never changes. Dynamic: DeepSpeed's
    /// `DynamicLossScaler.update_scale`, with `hysteresis` `h` and window
    /// `W`:
    ///
    /// - on overflow: if `h == 1` or the remaining hysteresis is 1, the scale
    ///   becomes `max(scale / 2, min_scale)`; otherwise the remaining
    ///   hysteresis drops by one and the scale stays. The iteration is
    ///   recorded as the last overflow.
    /// - on a good step: with `consecutive_hysteresis` the remaining
    ///   hysteresis is refilled to `h`. Then, with
    ///   `stable = iter - last_overflow - 1` (the last overflow being -1
    ///   before the first), if `stable` is positive and a multiple of `W`,
    ///   the scale doubles (and, without `consecutive_hysteresis`, the
    ///   hysteresis is refilled).
    /// - the iteration counter then advances.
    ///
    /// Where DeepSpeed raises at `min_scale` (`raise_error_at_min_scale`),
    /// this keeps the scale at `min_scale`. A hysteresis of 0 acts as 1, a
    /// window of 0 as 1, and doubling stops at `2^127`.
    pub fn update(&mut self, overflow: bool) -> bool {
        if let LossScaleConfig::Dynamic {
            window,
            hysteresis,
            consecutive_hysteresis,
            min_scale,
            ..
        } = self.config
        {
            if overflow {
                if hysteresis <= 1 || self.cur_hysteresis <= 1 {
                    self.cur_scale = (self.cur_scale / 2.0).max(min_scale);
                } else {
                    self.cur_hysteresis -= 1;
                }
                self.last_overflow_iter = self.cur_iter as i64;
            } else {
                if consecutive_hysteresis {
                    self.cur_hysteresis = hysteresis;
                }
                let stable = self.cur_iter as i64 - self.last_overflow_iter - 1;
                if stable > 0 && (stable as u64).is_multiple_of(window.max(1)) {
                    if !consecutive_hysteresis {
                        self.cur_hysteresis = hysteresis;
                    }
                    self.cur_scale = (self.cur_scale * 2.0).min(MAX_SCALE);
                }
            }
        }
        self.cur_iter += 1;
        overflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_zero_is_step_one() {
        let p = AdamWParams::torch_default();
        assert_eq!(
            AdamWStep::new(&p, 1e-3, 0, 1.0),
            AdamWStep::new(&p, 1e-3, 1, 1.0)
        );
        let k = AdamWStep::new(&p, 1e-3, u64::MAX, 1.0);
        assert_eq!(k.step_size, 1e-3);
        assert_eq!(k.inv_sqrt_bias2, 1.0);
    }

    #[test]
    fn chunk_tree_of_sixteen_ones_is_sixteen() {
        assert_eq!(sum_squares_chunk(&[1.0f32; 16]), 16.0);
        assert_eq!(sum_squares_chunk::<f32>(&[]), 0.0);
        assert_eq!(sum_squares(&[3.0f32, 4.0]), 25.0);
    }

    #[test]
    fn clip_coefficient_edges() {
        assert_eq!(clip_coefficient(10.0, 0.0), 1.0);
        assert_eq!(clip_coefficient(f64::NAN, 1.0), 1.0);
        assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 1.0);
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(2.0, 1.0), 1.0 / (2.0 + 1e-6));
    }

    #[test]
    fn scale_doubling_saturates() {
        let mut s = LossScaler::new(LossScaleConfig::Dynamic {
            initial_scale_power: 200,
            window: 1,
            hysteresis: 0,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        });
        assert_eq!(s.scale(), MAX_SCALE);
        for _ in 0..4 {
            s.update(false);
        }
        assert_eq!(s.scale(), MAX_SCALE);
        assert_eq!(MAX_SCALE, 2f32.powi(127));
    }
}
