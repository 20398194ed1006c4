//! What the Llama kernel tests share, on the host (zero-llama's
//! `kernels_on_host`) and on a GPU (`cuda_kernels`): the activation types
//! and their tolerances, random inputs, the comparisons with the CPU ops,
//! and reference cases built from `zero_llama::ops`.

use std::io::Write;

use zero_core::{bf16, Element};
use zero_llama::ops::{self, AttnShape};
use zero_llama::XorShift;

/// The activation types of the kernels.
pub trait Act: Element {
    /// The type's name in test output and driver arguments (`f32`, `bf16`).
    const NAME: &'static str;
    /// Tolerance relative to |want|: f32 rounding or one bf16 ulp.
    const RTOL: f32;
}

impl Act for f32 {
    const NAME: &'static str = "f32";
    const RTOL: f32 = 1e-5;
}

impl Act for bf16 {
    const NAME: &'static str = "bf16";
    const RTOL: f32 = 1.0 / 128.0;
}

/// Tolerance relative to the largest |want| of an output.
pub const SCALE_TOL: f32 = 1e-5;

/// `n` values of `scale` times a standard normal draw.
pub fn randn(rng: &mut XorShift, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| scale * rng.normal()).collect()
}

/// `v` narrowed to E.
pub fn narrow<E: Element>(v: &[f32]) -> Vec<E> {
    v.iter().map(|&x| E::from_f32(x)).collect()
}

/// `v` rounded through E (the values E can hold).
pub fn round<E: Element>(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| E::from_f32(x).to_f32()).collect()
}

/// The kernel's `got` against the CPU's `want` (rounded through E) within
/// E's tolerance; prints the worst error as a fraction of the tolerance.
pub fn check<E: Act>(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let want = round::<E>(want);
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut worst = 0.0f32;
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        if g.is_nan() && w.is_nan() {
            continue;
        }
        let tol = E::RTOL * w.abs() + SCALE_TOL * scale;
        let err = (g - w).abs();
        assert!(
            err <= tol,
            "{what} ({}): element {i}: kernel {g:e}, CPU {w:e}, |diff| {err:e} > {tol:e}",
            E::NAME
        );
        worst = worst.max(err / tol.max(f32::MIN_POSITIVE));
    }
    let _ = writeln!(
        std::io::stderr(),
        "{what} ({}): {} values, worst error {worst:.3} of the tolerance",
        E::NAME,
        got.len()
    );
}

/// Bit for bit.
pub fn check_exact(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}: element {i}: {g:e} vs {w:e}"
        );
    }
}

/// The CPU SwiGLU with identity projections (x = [h1 | h3], W2 = [I; 0]),
/// so that its cache holds the kernels' inputs and outputs exactly:
/// forward h1, h3 → a; backward da, h1, h3 → dh1, dh3 (dx = [dh1 | dh3]).
pub struct SwigluCase {
    /// Gate projections (inputs of the forward kernel).
    pub h1: Vec<f32>,
    /// Up projections (inputs of the forward kernel).
    pub h3: Vec<f32>,
    /// The CPU's forward output `silu(h1) ∘ h3`.
    pub a: Vec<f32>,
    /// The output gradient (input of the backward kernel).
    pub da: Vec<f32>,
    /// The CPU's gradient of `h1`.
    pub dh1: Vec<f32>,
    /// The CPU's gradient of `h3`.
    pub dh3: Vec<f32>,
}

impl SwigluCase {
    /// `rows` rows of `hidden`, inputs representable in E.
    pub fn new<E: Element>(rows: usize, hidden: usize, seed: u64) -> SwigluCase {
        let mut rng = XorShift::new(seed);
        let dim = 2 * hidden;
        let x = round::<E>(&randn(&mut rng, rows * dim, 3.0));
        let mut w1 = vec![0.0f32; hidden * dim];
        let mut w3 = vec![0.0f32; hidden * dim];
        let mut w2 = vec![0.0f32; dim * hidden];
        for i in 0..hidden {
            w1[i * dim + i] = 1.0;
            w3[i * dim + hidden + i] = 1.0;
            w2[i * hidden + i] = 1.0;
        }
        let (_, cache) = ops::swiglu_forward(&x, &w1, &w3, &w2, dim, hidden, 1);
        // dy = [da | anything]: W2 = [I; 0] routes its first half to da.
        let dy = round::<E>(&randn(&mut rng, rows * dim, 1.0));
        let mut dx = vec![0.0f32; rows * dim];
        ops::swiglu_backward(&dy, &x, &cache, &w1, &w3, &w2, &mut dx, (dim, hidden), 1);
        let (mut da, mut dh1, mut dh3) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            da.extend_from_slice(&dy[r * dim..r * dim + hidden]);
            dh1.extend_from_slice(&dx[r * dim..r * dim + hidden]);
            dh3.extend_from_slice(&dx[r * dim + hidden..(r + 1) * dim]);
        }
        SwigluCase {
            h1: cache.h1,
            h3: cache.h3,
            a: cache.a,
            da,
            dh1,
            dh3,
        }
    }
}

/// Attention whose keys and values are the identity (one K/V head of
/// `head_dim = t` over `mats` query heads, sequence `t`): its probabilities
/// are the causal softmax of `scale * q` per head, and its dQ is dS.
/// The shape and the identity `[t, t]`.
pub fn identity_attention(mats: usize, t: usize) -> (AttnShape, Vec<f32>) {
    let mut eye = vec![0.0f32; t * t];
    for i in 0..t {
        eye[i * t + i] = 1.0;
    }
    let s = AttnShape {
        batch: 1,
        seq: t,
        n_heads: mats,
        n_kv_heads: 1,
        head_dim: t,
    };
    (s, eye)
}
