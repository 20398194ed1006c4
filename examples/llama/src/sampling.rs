//! How generation picks the next token from a row of logits: greedy
//! (argmax), or sampled at a temperature from the top-p nucleus, as
//! transformers' `generate(do_sample=True, temperature=T, top_p=P)` does.

use super::XorShift;

/// Greedy or sampled choice of the next token.
pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: XorShift,
}

impl Sampler {
    /// Greedy decoding: always the largest logit (the first of ties).
    pub fn greedy() -> Self {
        Sampler {
            temperature: 0.0,
            top_p: 1.0,
            rng: XorShift::new(0),
        }
    }

    /// Sampling at `temperature` (0: greedy) from the smallest set of most
    /// likely tokens whose probabilities sum to at least `top_p` (1: all),
    /// seeded with `seed`. Errors name the bad value.
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Result<Self, String> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(format!(
                "--temperature {temperature}: expected a number of at least 0"
            ));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!("--top-p {top_p}: expected a number in (0, 1]"));
        }
        Ok(Sampler {
            temperature,
            top_p,
            rng: XorShift::new(seed),
        })
    }

    /// Whether this sampler is greedy.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The next token of `logits` (one row, the vocabulary's size).
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(t, &v)| (t as u32, f64::from((v - max) / self.temperature).exp()))
            .collect();
        // Most likely first; ties by id, so the nucleus is deterministic.
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: f64 = probs.iter().map(|p| p.1).sum();
        let mut kept = 0;
        let mut mass = 0.0;
        for p in &probs {
            kept += 1;
            mass += p.1 / total;
            if mass >= f64::from(self.top_p) {
                break;
            }
        }
        let nucleus = &probs[..kept];
        let sum: f64 = nucleus.iter().map(|p| p.1).sum();
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * sum;
        let mut acc = 0.0;
        for p in nucleus {
            acc += p.1;
            if u < acc {
                return p.0;
            }
        }
        nucleus[kept - 1].0
    }
}

/// The index of the largest value (the first of ties).
pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |m, (t, &v)| if v > m.1 { (t, v) } else { m },
        )
        .0 as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest() {
        let mut s = Sampler::greedy();
        assert_eq!(s.pick(&[0.1, 3.0, -1.0, 3.0]), 1);
        assert!(Sampler::new(0.0, 0.5, 1).unwrap().is_greedy());
    }

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        // Probabilities ~0.64, 0.24, 0.09, 0.03 at temperature 1: top_p 0.7
        // keeps the first two.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(1.0, 0.7, 7).unwrap();
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.pick(&logits) as usize] += 1;
        }
        assert_eq!((seen[2], seen[3]), (0, 0), "{seen:?}");
        // 0.64 / 0.88 of the draws go to the first.
        let share = seen[0] as f64 / 2000.0;
        assert!((share - 0.73).abs() < 0.04, "{seen:?}");
    }

    #[test]
    fn temperature_flattens_and_the_seed_repeats() {
        let logits = [2.0f32, 0.0];
        let draws = |t: f32, seed: u64| -> Vec<u32> {
            let mut s = Sampler::new(t, 1.0, seed).unwrap();
            (0..4000).map(|_| s.pick(&logits)).collect()
        };
        let ones = |v: &[u32]| v.iter().filter(|&&x| x == 1).count() as f64 / v.len() as f64;
        // p(1) = 1 / (1 + e^(2/T)): 0.119 at T = 1, 0.269 at T = 2.
        assert!((ones(&draws(1.0, 3)) - 0.119).abs() < 0.02);
        assert!((ones(&draws(2.0, 3)) - 0.269).abs() < 0.025);
        assert_eq!(draws(1.0, 5), draws(1.0, 5));
        assert_ne!(draws(1.0, 5), draws(1.0, 6));
    }

    #[test]
    fn bad_settings_are_named() {
        assert!(Sampler::new(-1.0, 1.0, 0)
            .err()
            .unwrap()
            .contains("--temperature"));
        assert!(Sampler::new(1.0, 0.0, 0).err().unwrap().contains("--top-p"));
        assert!(Sampler::new(1.0, 1.5, 0).err().unwrap().contains("--top-p"));
    }
}
