//! The optimizer recipe of a fine-tuning run, and a watch on its loss.
//!
//! # Recipes
//!
//! The built-in presets train a small model from scratch on the addition
//! task, where a high learning rate is right ([`Recipe::scratch`]: lr 3e-3,
//! 5% warmup, cosine decay to 10%, no weight decay). A pretrained
//! checkpoint (`--model-dir`) would be wrecked by it (a full fine-tune of a
//! 135M-parameter Llama at 3e-3 goes from loss 3.79 to 9.45 in 5 steps), so
//! there the defaults are the usual fine-tuning recipe
//! ([`Recipe::pretrained`]): lr 1e-4 for LoRA and 1e-5 for a full
//! fine-tune, 3% warmup, cosine decay to 0, weight decay 0.1.
//! [`Recipe::choose`] picks one and lets every value the user gave win.
//!
//! # Loss watch
//!
//! [`LossWatch`] warns when the loss rises far above its running minimum
//! (see [`LossWatch::observe`] for the rule).

/// Where a value of the recipe came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The recipe's default.
    Default,
    /// A command-line flag.
    Flag,
}

/// Learning rate, schedule and weight decay of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recipe {
    /// Peak learning rate.
    pub lr: f64,
    /// Where `lr` came from.
    pub lr_origin: Origin,
    /// Warmup steps as a fraction of the run's steps (at least 1 step).
    pub warmup_ratio: f64,
    /// The cosine decay's floor as a fraction of `lr` (DeepSpeed
    /// `WarmupCosineLR`'s `cos_min_ratio`).
    pub cos_min_ratio: f64,
    /// Decoupled (AdamW) weight decay.
    pub weight_decay: f64,
    /// Where `weight_decay` came from.
    pub weight_decay_origin: Origin,
    /// What the defaults are for, for the report.
    pub label: &'static str,
}

impl Recipe {
    /// The built-in presets' recipe (from scratch on the addition task).
    pub fn scratch() -> Self {
        Recipe {
            lr: 3e-3,
            lr_origin: Origin::Default,
            warmup_ratio: 0.05,
            cos_min_ratio: 0.1,
            weight_decay: 0.0,
            weight_decay_origin: Origin::Default,
            label: "a model trained from scratch",
        }
    }

    /// A pretrained checkpoint's recipe: lr 1e-4 with LoRA, 1e-5 for a
    /// full fine-tune; 3% warmup, cosine to 0, weight decay 0.1.
    pub fn pretrained(lora: bool) -> Self {
        Recipe {
            lr: if lora { 1e-4 } else { 1e-5 },
            lr_origin: Origin::Default,
            warmup_ratio: 0.03,
            cos_min_ratio: 0.0,
            weight_decay: 0.1,
            weight_decay_origin: Origin::Default,
            label: if lora {
                "LoRA on a pretrained checkpoint"
            } else {
                "a full fine-tune of a pretrained checkpoint"
            },
        }
    }

    /// The recipe of a run: [`Recipe::pretrained`] when the model is a
    /// pretrained checkpoint, else [`Recipe::scratch`]; a learning rate or
    /// weight decay the user gave (`lr`, `weight_decay`) replaces the
    /// default.
    pub fn choose(
        pretrained: bool,
        lora: bool,
        lr: Option<f64>,
        weight_decay: Option<f64>,
    ) -> Self {
        let mut r = if pretrained {
            Recipe::pretrained(lora)
        } else {
            Recipe::scratch()
        };
        if let Some(lr) = lr {
            r.lr = lr;
            r.lr_origin = Origin::Flag;
        }
        if let Some(wd) = weight_decay {
            r.weight_decay = wd;
            r.weight_decay_origin = Origin::Flag;
        }
        r
    }

    /// Warmup steps of a run of `total` steps: `warmup_ratio` of them,
    /// rounded, at least 1.
    pub fn warmup_steps(&self, total: usize) -> u64 {
        ((self.warmup_ratio * total as f64).round() as u64).max(1)
    }
}

/// Warns when the loss rises far above its running minimum: a diverging
/// run (too high a learning rate) says so while it runs.
///
/// The rule: step `s`'s loss `l` is *far above* the minimum `m` of the
/// losses before it when `l > 2 m` **and** `l > m + 1` (nats). The ratio
/// alone would fire on noise once the loss is small (0.05 → 0.12); the
/// margin alone on the first steps of a loss that starts high. A non-finite
/// loss is always far above. A warning is given when the loss crosses
/// above, once per excursion: the watch re-arms when a loss is back at or
/// below the threshold. A fine-tune at too high a rate (3.79 → 9.45 in 5
/// steps) is caught as soon as the loss passes 7.58.
#[derive(Clone, Debug, Default)]
pub struct LossWatch {
    min: Option<f32>,
    above: bool,
}

impl LossWatch {
    /// A watch that has seen no loss.
    pub fn new() -> Self {
        Self::default()
    }

    /// The running minimum so far.
    pub fn min(&self) -> Option<f32> {
        self.min
    }

    /// Records step `step`'s loss; returns the warning to print when this
    /// loss starts an excursion far above the running minimum.
    pub fn observe(&mut self, step: usize, loss: f32) -> Option<String> {
        let far = match self.min {
            _ if !loss.is_finite() => true,
            Some(m) => loss > 2.0 * m && loss > m + 1.0,
            None => false,
        };
        let warn = (far && !self.above).then(|| match self.min {
            Some(m) if loss.is_finite() => format!(
                "warning: step {step}: the loss rose to {loss:.4}, far above its running \
                 minimum {m:.4} (more than 2x and 1 nat above): the run may be diverging \
                 (a learning rate too high? --lr)"
            ),
            _ => format!("warning: step {step}: the loss is {loss}: the run diverged"),
        });
        self.above = far;
        if loss.is_finite() {
            self.min = Some(self.min.map_or(loss, |m| m.min(loss)));
        }
        warn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretrained_defaults_depend_on_lora() {
        let full = Recipe::choose(true, false, None, None);
        assert_eq!((full.lr, full.weight_decay), (1e-5, 0.1));
        assert_eq!((full.warmup_ratio, full.cos_min_ratio), (0.03, 0.0));
        assert_eq!(Recipe::choose(true, true, None, None).lr, 1e-4);
        let scratch = Recipe::choose(false, true, None, None);
        assert_eq!((scratch.lr, scratch.weight_decay), (3e-3, 0.0));
        assert_eq!(scratch.cos_min_ratio, 0.1);
    }

    #[test]
    fn given_values_win_over_every_recipe() {
        for (pretrained, lora) in [(true, false), (true, true), (false, false)] {
            let r = Recipe::choose(pretrained, lora, Some(2e-2), Some(0.25));
            assert_eq!((r.lr, r.lr_origin), (2e-2, Origin::Flag));
            assert_eq!(
                (r.weight_decay, r.weight_decay_origin),
                (0.25, Origin::Flag)
            );
            let d = Recipe::choose(pretrained, lora, None, None);
            assert_eq!(d.lr_origin, Origin::Default);
            // The schedule is the recipe's either way.
            assert_eq!(r.warmup_ratio, d.warmup_ratio);
        }
    }

    #[test]
    fn warmup_is_a_fraction_of_the_run_at_least_one_step() {
        let r = Recipe::pretrained(false);
        assert_eq!(r.warmup_steps(1000), 30);
        assert_eq!(r.warmup_steps(10), 1);
        assert_eq!(r.warmup_steps(0), 1);
    }

    #[test]
    fn catches_the_diverging_fine_tune_once() {
        let mut w = LossWatch::new();
        let losses = [3.79, 5.1, 6.8, 8.2, 9.45, 9.3];
        let warned: Vec<usize> = losses
            .iter()
            .enumerate()
            .filter_map(|(i, &l)| w.observe(i + 1, l).map(|_| i + 1))
            .collect();
        assert_eq!(warned, vec![4]);
        let mut msg = LossWatch::new();
        msg.observe(1, 3.79);
        let text = msg.observe(2, 9.45).expect("a warning");
        assert!(text.contains("step 2") && text.contains("3.79"), "{text}");
    }

    #[test]
    fn quiet_on_noise_of_a_small_or_falling_loss() {
        let mut w = LossWatch::new();
        // A loss that starts high and falls, then small noisy values.
        for (i, l) in [5.6, 4.0, 2.0, 0.9, 0.3, 0.05, 0.12, 0.04, 0.2, 0.06]
            .into_iter()
            .enumerate()
        {
            assert_eq!(w.observe(i + 1, l), None, "step {}", i + 1);
        }
        assert_eq!(w.min(), Some(0.04));
    }

    #[test]
    fn rearms_after_the_loss_comes_back() {
        let mut w = LossWatch::new();
        assert!(w.observe(1, 2.0).is_none());
        assert!(w.observe(2, 5.0).is_some());
        assert!(w.observe(3, 6.0).is_none(), "still the same excursion");
        assert!(w.observe(4, 2.5).is_none(), "back under the threshold");
        assert!(w.observe(5, 5.5).is_some(), "a new excursion");
        assert!(w.observe(6, f32::NAN).is_none(), "still above");
        let mut w = LossWatch::new();
        assert!(w.observe(1, f32::INFINITY).is_some());
    }
}
