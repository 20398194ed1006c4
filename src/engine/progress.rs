//! Where an engine is in training: the micro-batch in its accumulation
//! window, the optimizer steps applied and the step boundaries passed,
//! the micro-batches ended (checked across ranks at every step), the fp16
//! loss scaler, what the last [`Engine::step`](super::Engine::step)
//! did ([`StepOutcome`]), and whether the engine trains at all (or
//! evaluates). [`GlobalNorm::unscale`] turns a step's summed squares
//! into its norm and the factor AdamW scales the gradients by.
//!
//! ```text
//!  end_micro_batch ─▶ window open:  between(lr) ─▶ last
//!                 └─▶ window full:  unscale(norm) ─▶ AdamW ─▶ applied()
//!                                   ─▶ boundary(norm, lr) ─▶ finish(outcome) ─▶ last
//!  drop_micro_batch (zero_grad): window restarts, the count goes on
//! ```

use zero_core::optim::{clip_coefficient, LossScaler, LrSchedule};

use crate::format::checkpoint::Manifest;

/// The step bookkeeping of one rank's engine.
pub(super) struct Progress {
    /// `gradient_accumulation_steps`.
    ga: usize,
    /// Micro-batches of the current accumulation window ended so far.
    micro: usize,
    /// Optimizer steps applied (skipped steps not counted).
    steps: u64,
    /// Optimizer-step boundaries, skipped steps included.
    global_steps: u64,
    /// Micro-batches ended by `step` or dropped by `zero_grad`: the same
    /// on every rank unless one went on alone after a failed micro-batch.
    /// It travels with the step's norm exchange (see
    /// `step::check_in_step`).
    micro_batches: u64,
    /// fp16's dynamic loss scaler (`None`: the loss scale is 1).
    scaler: Option<LossScaler>,
    /// What the last step did.
    last: StepOutcome,
    /// Training (the default) or evaluation mode.
    training: bool,
}

impl Progress {
    /// Nothing done yet, windows of `ga` micro-batches, the first step at
    /// learning rate `lr`.
    pub(super) fn new(ga: usize, scaler: Option<LossScaler>, lr: f64) -> Self {
        let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale());
        Self {
            ga,
            micro: 0,
            steps: 0,
            global_steps: 0,
            micro_batches: 0,
            scaler,
            last: StepOutcome::between(lr, loss_scale, 0),
            training: true,
        }
    }

    /// Whether the engine is in training mode.
    pub(super) fn training(&self) -> bool {
        self.training
    }

    /// Switches to training (`true`) or evaluation mode.
    pub(super) fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    /// Training call `call` is refused in evaluation mode.
    pub(super) fn check_training(&self, call: &str) -> Result<(), String> {
        if self.training {
            return Ok(());
        }
        Err(format!(
            "{call}: the engine is in evaluation mode (Engine::eval); call Engine::train() first"
        ))
    }

    /// The loss scale the trainer multiplies its loss by (1 unless fp16).
    pub(super) fn loss_scale(&self) -> f32 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale())
    }

    /// The loss scaler, as a checkpoint records it.
    pub(super) fn scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Optimizer steps applied.
    pub(super) fn steps(&self) -> u64 {
        self.steps
    }

    /// Optimizer-step boundaries passed.
    pub(super) fn global_steps(&self) -> u64 {
        self.global_steps
    }

    /// Micro-batches ended or dropped since the build (or the load).
    pub(super) fn micro_batches(&self) -> u64 {
        self.micro_batches
    }

    /// Micro-batches of the current window ended so far.
    pub(super) fn micro(&self) -> usize {
        self.micro
    }

    /// Micro-batches per window (`gradient_accumulation_steps`).
    pub(super) fn ga(&self) -> usize {
        self.ga
    }

    /// What the last step did.
    pub(super) fn last(&self) -> StepOutcome {
        self.last
    }

    /// Where the current micro-batch is in its window: not the first (its
    /// gradients accumulate), the last.
    pub(super) fn position(&self) -> (bool, bool) {
        (self.micro > 0, self.micro + 1 >= self.ga)
    }

    /// Ends the current micro-batch; `true` when it completed the window
    /// (which restarts: the optimizer step is due).
    pub(super) fn end_micro_batch(&mut self) -> bool {
        self.micro += 1;
        self.micro_batches += 1;
        if self.micro < self.ga {
            return false;
        }
        self.micro = 0;
        true
    }

    /// Drops the current window (`zero_grad`): it counts as a micro-batch.
    pub(super) fn drop_micro_batch(&mut self) {
        self.micro = 0;
        self.micro_batches += 1;
    }

    /// A `step` that ended no window, the next step at learning rate `lr`.
    pub(super) fn between(&mut self, lr: f64) -> StepOutcome {
        self.last = StepOutcome::between(lr, self.loss_scale(), self.steps);
        self.last
    }

    /// The global norm of the due step from the summed squares `sumsq` of
    /// `ranks` ranks' gradients, clipped to `clip` (see
    /// [`GlobalNorm::unscale`]); the scaler learns whether it overflowed.
    pub(super) fn unscale(&mut self, sumsq: f64, ranks: usize, clip: f64) -> GlobalNorm {
        GlobalNorm::unscale(sumsq, (self.scaler.as_mut(), ranks, self.ga), clip)
    }

    /// The due step's update was applied.
    pub(super) fn applied(&mut self) {
        self.steps += 1;
    }

    /// The due step is done (applied or skipped, as `norm` says) at
    /// learning rate `lr`: a boundary passed, and what it did.
    pub(super) fn boundary(&mut self, norm: &GlobalNorm, lr: f64) -> StepOutcome {
        self.global_steps += 1;
        StepOutcome {
            boundary: true,
            skipped: norm.grad_scale.is_none(),
            grad_norm: Some(norm.norm),
            lr,
            loss_scale: self.loss_scale(),
            steps: self.steps,
        }
    }

    /// The step that passed the boundary finished (its parameters
    /// gathered where the stage needs it).
    pub(super) fn finish(&mut self, outcome: StepOutcome) {
        self.last = outcome;
    }

    /// Resumes from the checkpoint whose manifest is `m`: its step counts
    /// and loss scaler (kept only where this run scales the loss), the
    /// next step at learning rate `schedule.lr_at(m.steps)`.
    pub(super) fn resume(&mut self, m: &Manifest, schedule: &LrSchedule) {
        self.steps = m.steps;
        self.global_steps = m.global_steps;
        self.micro_batches = 0;
        if let (Some(_), Some(s)) = (&self.scaler, &m.loss_scaler) {
            self.scaler = Some(s.clone());
        }
        self.between(schedule.lr_at(m.steps));
    }
}

/// What [`Engine::step`](super::Engine::step) did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Whether this call ended a gradient-accumulation window (the
    /// optimizer ran or was skipped); `false` for the other micro-batches.
    pub boundary: bool,
    /// Whether the update was skipped (fp16 overflow, or a non-finite
    /// gradient norm in any precision): parameters are unchanged.
    pub skipped: bool,
    /// The global gradient norm (after unscaling, before clipping), at a
    /// boundary.
    pub grad_norm: Option<f64>,
    /// The learning rate the update used (or would have used).
    pub lr: f64,
    /// The loss scale for the next micro-batch.
    pub loss_scale: f32,
    /// Optimizer steps applied so far.
    pub steps: u64,
}

impl StepOutcome {
    /// A call that ended no accumulation window, with the learning rate
    /// and loss scale for the next step and `steps` applied.
    pub(super) fn between(lr: f64, loss_scale: f32, steps: u64) -> Self {
        Self {
            boundary: false,
            skipped: false,
            grad_norm: None,
            lr,
            loss_scale,
            steps,
        }
    }
}

/// The global gradient norm of a step, unscaled, and what the step does
/// with it.
pub(super) struct GlobalNorm {
    /// After unscaling, before clipping.
    pub(super) norm: f64,
    /// The sum of squares was not finite.
    pub(super) overflow: bool,
    /// The factor AdamW multiplies the summed gradient by: `clip /
    /// (loss_scale · N · GA)`; `None` when the update is skipped (an fp16
    /// overflow, or a non-finite norm in any precision).
    pub(super) grad_scale: Option<f32>,
}

impl GlobalNorm {
    /// Unscales the summed squares `sumsq` of a step over the gradients
    /// of `ranks` ranks times `ga` micro-batches, scaled by the loss
    /// scaler's scale (1 without one), clipped to `clip`
    /// (`gradient_clipping`); the scaler (fp16) learns whether the step
    /// overflowed.
    pub(super) fn unscale(
        sumsq: f64,
        (scaler, ranks, ga): (Option<&mut LossScaler>, usize, usize),
        clip: f64,
    ) -> Self {
        let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale());
        let base = 1.0 / (f64::from(loss_scale) * ranks as f64 * ga as f64);
        let norm = sumsq.sqrt() * base;
        let overflow = !sumsq.is_finite();
        let skipped = match scaler {
            Some(s) => s.update(overflow),
            None => overflow,
        };
        let grad_scale = (!skipped).then(|| (base * clip_coefficient(norm, clip)) as f32);
        Self {
            norm,
            overflow,
            grad_scale,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_of_three_micro_batches() {
        let mut p = Progress::new(3, None, 0.5);
        assert_eq!(p.position(), (false, false));
        assert!(!p.end_micro_batch());
        assert_eq!(p.position(), (true, false));
        assert!(!p.end_micro_batch());
        assert_eq!(p.position(), (true, true));
        assert!(p.end_micro_batch());
        assert_eq!((p.micro(), p.micro_batches()), (0, 3));
        // A dropped window restarts it and still counts.
        assert!(!p.end_micro_batch());
        p.drop_micro_batch();
        assert_eq!((p.micro(), p.micro_batches()), (0, 5));
    }

    #[test]
    fn a_skipped_step_passes_a_boundary_without_applying() {
        let mut p = Progress::new(1, None, 0.1);
        assert!(p.end_micro_batch());
        let norm = p.unscale(f64::INFINITY, 2, 1.0);
        assert!(norm.grad_scale.is_none());
        let out = p.boundary(&norm, 0.1);
        assert!(out.boundary && out.skipped);
        assert_eq!((p.steps(), p.global_steps()), (0, 1));
        assert!(p.end_micro_batch());
        let norm = p.unscale(4.0, 2, 1.0);
        assert!(norm.grad_scale.is_some());
        p.applied();
        let out = p.boundary(&norm, 0.1);
        p.finish(out);
        assert_eq!((p.last().steps, p.global_steps()), (1, 2));
        assert_eq!(p.last().grad_norm, Some(1.0));
        assert!(!p.last().skipped);
    }
}
