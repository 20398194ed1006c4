//! Deterministic parameter initialisation: the value of every element is a
//! function of (seed, unit name, tensor index, element index) only, so each
//! rank can initialise just the elements it stores and the full tensors are
//! the same whatever the world size or stage.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use crate::Result;

/// Where the values of one tensor come from when they are not computed:
/// weights in a file, read on demand. [`EngineBuilder::build`] asks for the
/// element ranges this rank stores (a unit shard, an offload tile's piece,
/// a frozen segment), never for the whole model at once, so a model larger
/// than memory can start from its pretrained weights.
///
/// [`EngineBuilder::build`]: crate::EngineBuilder::build
pub trait TensorSource: Send + Sync + fmt::Debug {
    /// Number of elements: the registered tensor's.
    fn numel(&self) -> usize;

    /// Elements `range` (row-major) of the tensor into `out`
    /// (`out.len() == range.len()`), as f32. An error names what it read
    /// (the file and the tensor); `build` returns it.
    fn read(&self, range: Range<usize>, out: &mut [f32]) -> Result<()>;
}

/// How to initialise one tensor of a unit.
#[derive(Debug, Clone)]
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
    /// Values read on demand, range by range (weights streamed from a
    /// file): bit for bit what [`Init::Values`] of the same values gives.
    Source(Arc<dyn TensorSource>),
}

impl PartialEq for Init {
    /// Sources are equal when they are the same object.
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Init::Zeros, Init::Zeros) | (Init::Ones, Init::Ones) => true,
            (Init::Constant(a), Init::Constant(b)) => a == b,
            (Init::Normal { std: a }, Init::Normal { std: b }) => a == b,
            (Init::Uniform { bound: a }, Init::Uniform { bound: b }) => a == b,
            (Init::Values(a), Init::Values(b)) => a == b,
            (Init::Source(a), Init::Source(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Init {
    /// Normal(0, `std`).
    pub fn normal(std: f32) -> Self {
        Init::Normal { std }
    }

    /// Elements `range` of tensor `tensor` of the unit whose name hashes
    /// to `unit_key` into `out` (as long as `range`): a source's error is
    /// returned.
    pub(crate) fn fill(
        &self,
        seed: u64,
        unit_key: u64,
        tensor: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let bits = |i: usize| element_bits(seed, unit_key, tensor, i);
        match self {
            Init::Zeros => out.fill(0.0),
            Init::Ones => out.fill(1.0),
            Init::Constant(v) => out.fill(*v),
            Init::Values(v) => out.copy_from_slice(&v[range]),
            Init::Source(s) => s.read(range, out)?,
            Init::Normal { std } => {
                for (o, i) in out.iter_mut().zip(range) {
                    let r = bits(i);
                    // Box-Muller on two 26-bit uniforms; u1 in (0, 1].
                    let u1 = ((r >> 38) + 1) as f64 / (1u64 << 26) as f64;
                    let u2 = ((r >> 12) & ((1 << 26) - 1)) as f64 / (1u64 << 26) as f64;
                    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                    *o = (z * f64::from(*std)) as f32;
                }
            }
            Init::Uniform { bound } => {
                for (o, i) in out.iter_mut().zip(range) {
                    let u = (bits(i) >> 40) as f64 / (1u64 << 24) as f64;
                    *o = ((2.0 * u - 1.0) * f64::from(*bound)) as f32;
                }
            }
        }
        Ok(())
    }
}

impl Init {
    /// What every rank must agree on (see `check_agreement`): the kind and
    /// its parameters, and for [`Init::Values`] the CRC32 of the values'
    /// bytes. A [`Init::Source`] counts by kind only: its file is read at
    /// `build`, range by range, and hashing it would read it twice.
    pub(crate) fn digest(&self) -> u64 {
        let tagged = |tag: u64, bits: u32| mix((tag << 32) | u64::from(bits));
        match self {
            Init::Zeros => tagged(1, 0),
            Init::Ones => tagged(2, 0),
            Init::Constant(v) => tagged(3, v.to_bits()),
            Init::Normal { std } => tagged(4, std.to_bits()),
            Init::Uniform { bound } => tagged(5, bound.to_bits()),
            Init::Values(v) => {
                let mut h = crc32fast::Hasher::new();
                h.update(bytemuck::cast_slice(v));
                tagged(6, h.finalize()) ^ mix(v.len() as u64)
            }
            Init::Source(_) => tagged(7, 0),
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

    impl Init {
        /// Element `i` alone.
        fn value(&self, seed: u64, unit_key: u64, tensor: usize, i: usize) -> f32 {
            let mut out = [0f32];
            self.fill(seed, unit_key, tensor, i..i + 1, &mut out)
                .expect("a computed initialiser");
            out[0]
        }
    }

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
