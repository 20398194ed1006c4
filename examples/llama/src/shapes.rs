//! Published model shapes with random weights: a model the size of a real
//! checkpoint, built without its files, for measuring time and memory
//! (`llama_sft --model qwen2.5-14b`, `scripts/lora-experiment.sh`).
//!
//! The weights are a stand-in: their values change neither the work of a
//! step nor the memory it takes. They are drawn so that a 14.7 B-parameter
//! model starts in seconds: [`RandomUniform`] computes element `i` of a
//! tensor from (seed, tensor, `i`) alone, on every core at once, so the
//! engine's build asks for any range in any order and every rank, stage and
//! thread count sees the same model.

use std::ops::Range;
use std::sync::Arc;

use zero::{Init, TensorSource};

use crate::{tensors, Config, Kind};

/// Qwen2.5-14B (and -Instruct) as its `config.json` publishes it: 48
/// layers, hidden 5120, 40 query heads and 8 key/value heads of width 128,
/// intermediate 13824, vocabulary 152064, q/k/v biases, `rope_theta` 1e6,
/// `rms_norm_eps` 1e-6, an LM head of its own. `max_seq` is the run's to
/// set (the RoPE tables cover the positions it uses).
pub fn qwen2_5_14b() -> Config {
    Config {
        vocab: 152_064,
        dim: 5120,
        n_layers: 48,
        n_heads: 40,
        n_kv_heads: 8,
        hidden: 13_824,
        max_seq: 128,
        norm_eps: 1e-6,
        rope_theta: 1e6,
        qkv_bias: true,
        tie_embeddings: false,
        pad_id: None,
    }
}

/// The initialisers of every tensor of `cfg` ([`tensors`] order) for a
/// random stand-in model: matrices and embeddings [`RandomUniform`] with
/// standard deviation 0.02 (the presets' normal's), norms one, biases zero.
pub fn random_init(cfg: &Config, seed: u64) -> Vec<Init> {
    tensors(cfg)
        .iter()
        .enumerate()
        .map(|(i, t)| match t.kind {
            Kind::Norm => Init::Ones,
            Kind::Bias => Init::Zeros,
            Kind::Embedding | Kind::Linear => Init::Source(Arc::new(RandomUniform {
                numel: t.numel(),
                key: seed ^ mix(i as u64 ^ 0x51ed_270b),
                bound: 0.02 * 3f32.sqrt(),
            })),
        })
        .collect()
}

/// A tensor of independent uniform values in `[-bound, bound)` (standard
/// deviation `bound / √3`), element `i` a function of (`key`, `i`) only,
/// read on all the host's cores.
#[derive(Debug)]
pub struct RandomUniform {
    numel: usize,
    key: u64,
    bound: f32,
}

/// Below this many elements a read runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 20;

impl RandomUniform {
    fn fill(&self, start: usize, out: &mut [f32]) {
        let key = mix(self.key);
        for (j, o) in out.iter_mut().enumerate() {
            let bits =
                mix(key.wrapping_add(((start + j) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
            let u = (bits >> 40) as f32 / (1u64 << 24) as f32;
            *o = (2.0 * u - 1.0) * self.bound;
        }
    }
}

impl TensorSource for RandomUniform {
    fn numel(&self) -> usize {
        self.numel
    }

    fn read(&self, range: Range<usize>, out: &mut [f32]) -> zero::Result<()> {
        if range.end > self.numel || out.len() != range.len() {
            return Err(zero::core::Error::InvalidSize {
                op: "RandomUniform::read",
                msg: format!(
                    "elements {range:?} into {} values of a tensor of {}",
                    out.len(),
                    self.numel
                ),
            }
            .into());
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        if out.len() < PARALLEL_MIN || threads == 1 {
            self.fill(range.start, out);
            return Ok(());
        }
        let chunk = out.len().div_ceil(threads);
        std::thread::scope(|s| {
            for (c, part) in out.chunks_mut(chunk).enumerate() {
                s.spawn(move || self.fill(range.start + c * chunk, part));
            }
        });
        Ok(())
    }
}

/// SplitMix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(init: &Init) -> &dyn TensorSource {
        match init {
            Init::Source(s) => s.as_ref(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn qwen2_5_14b_has_the_published_parameter_count() {
        // 14,770,033,664: the count transformers reports for
        // Qwen2ForCausalLM(Qwen2Config of Qwen2.5-14B).
        let c = qwen2_5_14b();
        c.validate();
        assert_eq!(crate::param_count(&c), 14_770_033_664);
        assert_eq!(c.head_dim(), 128);
    }

    #[test]
    fn any_range_in_any_order_reads_the_same_values() {
        let c = Config {
            vocab: 5000,
            dim: 512,
            ..Config::tiny()
        };
        let init = random_init(&c, 7);
        let t = source(&init[0]);
        let n = t.numel();
        // The whole tensor and its large piece on all cores, the others on one.
        assert!(n / 3 * 2 >= PARALLEL_MIN, "the parallel path is taken");
        let mut whole = vec![0f32; n];
        t.read(0..n, &mut whole).unwrap();
        let mut pieces = vec![0f32; n];
        for r in [n / 3..n, 5..n / 3, 0..5] {
            t.read(r.clone(), &mut pieces[r]).unwrap();
        }
        assert_eq!(whole, pieces);
        let bound = 0.02 * 3f32.sqrt();
        assert!(whole.iter().all(|x| (-bound..bound).contains(x)));
        let mean = whole.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
        let var = whole
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n as f64;
        assert!(
            mean.abs() < 1e-4 && (var.sqrt() - 0.02).abs() < 1e-4,
            "{mean} {var}"
        );
        // Another tensor, another seed: other values.
        let mut other = vec![0f32; 64];
        source(&init[2]).read(0..64, &mut other).unwrap();
        assert_ne!(other[..], whole[..64]);
        let reseeded = random_init(&c, 8);
        source(&reseeded[0]).read(0..64, &mut other).unwrap();
        assert_ne!(other[..], whole[..64]);
        // A range past the tensor or an output of another length is an
        // error naming both, not a panic.
        let e = t
            .read(n - 2..n + 1, &mut [0f32; 3])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("of {n}")), "{e}");
        assert!(t.read(0..4, &mut [0f32; 3]).is_err());
    }

    #[test]
    fn norms_are_ones_and_biases_zeros() {
        let c = Config {
            qkv_bias: true,
            ..Config::tiny()
        };
        let init = random_init(&c, 1);
        for (t, i) in tensors(&c).iter().zip(&init) {
            match t.kind {
                Kind::Norm => assert_eq!(*i, Init::Ones, "{}", t.name),
                Kind::Bias => assert_eq!(*i, Init::Zeros, "{}", t.name),
                _ => assert_eq!(source(i).numel(), t.numel(), "{}", t.name),
            }
        }
    }
}
