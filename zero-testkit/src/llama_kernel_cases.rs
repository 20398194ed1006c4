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

/// Qwen2's vocabulary: the size of [`BigVocabCase`]'s rows.
pub const BIG_VOCAB: usize = 151_936;

/// Cross-entropy at a real vocabulary, where an f32 running sum of the
/// exponentials loses precision: a realistic row (normal logits of std 2,
/// one raised by 15) and an adversarial one (a logit of 0 first, then
/// `-25 ln 2`, whose exponential 2^-25 an f32 sum past 1 drops: the sum
/// reads low by 151935·2^-25 = 4.5e-3, and a lane of 32 holding the peak by
/// 4747·2^-25 = 1.4e-4). Logits are exact in bf16 (`round::<bf16>`).
pub struct BigVocabCase {
    /// `[2, BIG_VOCAB]`.
    pub logits: Vec<f32>,
    /// One target per row.
    pub targets: Vec<i32>,
    /// The mean loss, all in f64.
    pub loss: f64,
    /// The gradient of the mean loss, all in f64.
    pub grad: Vec<f64>,
}

/// Two f32 ulps, relative: [`BigVocabCase::check`]'s tolerance of the loss.
pub const LOSS_RTOL_F64: f64 = 2.0 / (1u64 << 23) as f64;

/// [`BigVocabCase::check`]'s tolerance of a gradient element, relative to
/// its f64 value (to `1 / rows` at the target, where it cancels): the f32
/// `exp` of an argument that is itself rounded (`(x - max)` and `ln Σ`
/// each carry half an ulp of a value up to ~40, ~2e-6), plus the
/// exponential's own error (2 ulps on a GPU).
pub const GRAD_RTOL_F64: f64 = 4e-6;

impl BigVocabCase {
    /// The case (deterministic in `seed`).
    pub fn new(seed: u64) -> BigVocabCase {
        let v = BIG_VOCAB;
        let mut rng = XorShift::new(seed);
        let mut logits: Vec<f32> = (0..v).map(|_| 2.0 * rng.normal()).collect();
        logits[rng.below(v)] += 15.0;
        let mut adv = vec![-25.0 * std::f32::consts::LN_2; v];
        adv[0] = 0.0;
        logits.extend(adv);
        let logits = round::<bf16>(&logits);
        let targets = vec![rng.below(v) as i32, 90_001];
        let rows = targets.len() as f64;
        let (mut loss, mut grad) = (0.0f64, Vec::with_capacity(logits.len()));
        for (r, &t) in targets.iter().enumerate() {
            let row = &logits[r * v..(r + 1) * v];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            loss += lse - row[t as usize] as f64;
            for (j, &x) in row.iter().enumerate() {
                let p = (x as f64 - lse).exp() / rows;
                grad.push(if j == t as usize { p - 1.0 / rows } else { p });
            }
        }
        BigVocabCase {
            logits,
            targets,
            loss: loss / rows,
            grad,
        }
    }

    /// `loss` within [`LOSS_RTOL_F64`] of the f64 loss and, when given,
    /// every element of `grad` (f32 gradients) within [`GRAD_RTOL_F64`].
    pub fn check(&self, what: &str, loss: f32, grad: Option<&[f32]>) {
        let err = (loss as f64 - self.loss).abs() / self.loss.abs();
        assert!(
            err <= LOSS_RTOL_F64,
            "{what}: loss {loss} vs f64 {}: relative {err:e}",
            self.loss
        );
        let mut worst = 0.0f64;
        if let Some(grad) = grad {
            assert_eq!(grad.len(), self.grad.len(), "{what}: gradient length");
            let v = BIG_VOCAB;
            let inv = 1.0 / self.targets.len() as f64;
            for (i, (&g, &w)) in grad.iter().zip(&self.grad).enumerate() {
                let at_target = (i % v) as i32 == self.targets[i / v];
                let scale = if at_target { inv } else { w.abs() };
                let e = (g as f64 - w).abs() / scale;
                assert!(
                    e <= GRAD_RTOL_F64,
                    "{what}: gradient {i}: {g:e} vs f64 {w:e}: relative {e:e}"
                );
                worst = worst.max(e);
            }
        }
        let _ = writeln!(
            std::io::stderr(),
            "{what}: loss relative error {err:e}, worst gradient relative error {worst:e}"
        );
    }
}
