//! Deterministic parameter initialisation: the value of every element is a
//! function of (seed, unit name, tensor index, element index) only, so each
//! rank can initialise just the elements it stores and the full tensors are
//! the same whatever the world size or stage.

use std::sync::Arc;

/// How to initialise one tensor of a unit.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones (norm weights).
    Ones,
    /// Every element `value`.
    Constant(f32),
    /// Normal with mean 0 and standard deviation `std`.
    Normal {
        /// The standard deviation.
        std: f32,
    },
    /// Uniform in `[-bound, bound)`.
    Uniform {
        /// Half the width of the interval.
        bound: f32,
    },
    /// Explicit values, row-major, as many as the tensor has elements
    /// (weights loaded from a file).
    Values(Arc<[f32]>),
}

impl Init {
    /// Normal(0, `std`).
    pub fn normal(std: f32) -> Self {
        Init::Normal { std }
    }

    /// Element `i` of tensor `tensor` of the unit whose name hashes to
    /// `unit_key`.
    pub(crate) fn value(&self, seed: u64, unit_key: u64, tensor: usize, i: usize) -> f32 {
        match self {
            Init::Zeros => 0.0,
            Init::Ones => 1.0,
            Init::Constant(v) => *v,
            Init::Values(v) => v[i],
            Init::Normal { std } => {
                let r = element_bits(seed, unit_key, tensor, i);
                // Box-Muller on two 26-bit uniforms; u1 in (0, 1].
                let u1 = ((r >> 38) + 1) as f64 / (1u64 << 26) as f64;
                let u2 = ((r >> 12) & ((1 << 26) - 1)) as f64 / (1u64 << 26) as f64;
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                (z * f64::from(*std)) as f32
            }
            Init::Uniform { bound } => {
                let r = element_bits(seed, unit_key, tensor, i);
                let u = (r >> 40) as f64 / (1u64 << 24) as f64;
                ((2.0 * u - 1.0) * f64::from(*bound)) as f32
            }
        }
    }
}

/// 64 random bits for one element (SplitMix64 over a keyed counter).
fn element_bits(seed: u64, unit_key: u64, tensor: usize, i: usize) -> u64 {
    let key = mix(seed ^ mix(unit_key ^ mix(tensor as u64 ^ 0x5bd1_e995)));
    mix(key.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

/// SplitMix64's finaliser.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a, for names and digests that every rank computes alike.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_the_right_moments_and_is_keyed() {
        let init = Init::normal(0.5);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|i| f64::from(init.value(7, 11, 0, i))).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
        assert_ne!(init.value(7, 11, 0, 3), init.value(8, 11, 0, 3));
        assert_ne!(init.value(7, 11, 0, 3), init.value(7, 12, 0, 3));
        assert_ne!(init.value(7, 11, 0, 3), init.value(7, 11, 1, 3));
        assert_eq!(init.value(7, 11, 0, 3), init.value(7, 11, 0, 3));
    }

    #[test]
    fn uniform_stays_in_bounds() {
        let init = Init::Uniform { bound: 0.25 };
        for i in 0..10_000 {
            let x = init.value(1, 2, 3, i);
            assert!((-0.25..0.25).contains(&x));
        }
    }
}
