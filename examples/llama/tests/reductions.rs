//! The row reductions of `zero_llama::ops` (cross-entropy's log-sum-exp,
//! the causal softmax's sums, RMSNorm's sums) against f64 references, at
//! the sizes where an f32 running sum loses precision: a vocabulary of
//! 151,936 (Qwen2's), softmax rows of 2048, RMSNorm rows of 8192.
//!
//! Each test has two kinds of row: a realistic one (normal values; logits
//! with one peak, as a trained model gives) and an adversarial one (one term of 1
//! and many below half an f32 ulp of 1, every one of which an f32 running
//! sum drops). Each also asserts that an f32 running sum over its data is
//! off by far more than the tolerance, so that the test fails on the old
//! code (f32 accumulation) and not only in principle.
//!
//! Tolerances, relative to the f64 reference: a loss or an inverse RMS
//! (rounded once from f64) within 2 f32 ulps (2^-22); a probability or a
//! gradient element within 4e-6 (an f32 `exp` of an argument that is
//! itself rounded: `(x - max)` and `ln Σ` each carry half an ulp of a
//! value up to ~40, ~2e-6, plus the exponential's own ulp).

use llama::ops::*;
use llama::XorShift;
use zero_llama as llama;
use zero_testkit::llama_kernel_cases::{BigVocabCase, BIG_VOCAB, GRAD_RTOL_F64, LOSS_RTOL_F64};

/// Two f32 ulps, relative.
const ULP2: f64 = LOSS_RTOL_F64;
/// Probabilities and gradients (see the module doc).
const ELEM_RTOL: f64 = GRAD_RTOL_F64;

/// `ln 2^25`: `exp(-SMALL)` is 2^-25, under half an ulp of 1 (2^-24), so an
/// f32 running sum that has reached 1 drops it.
const SMALL: f32 = 25.0 * std::f32::consts::LN_2;

/// The old code's sum: an f32 running sum.
fn f32_running_sum(v: impl Iterator<Item = f32>) -> f32 {
    v.fold(0.0f32, |a, x| a + x)
}

fn rel(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs()
}

/// `ln Σ exp(x)` of `row`, all in f64.
fn lse64(row: &[f32]) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    max + row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

#[test]
fn cross_entropy_is_exact_at_a_151936_vocabulary() {
    let case = BigVocabCase::new(3);
    let (loss, grad) = cross_entropy(&case.logits, &case.targets, BIG_VOCAB);
    case.check("ops::cross_entropy", loss, Some(&grad));
    // The old code's f32 running sum misses by far more than the tolerance.
    let mut worst_old = 0.0f64;
    for row in case.logits.chunks_exact(BIG_VOCAB) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let old = f32_running_sum(row.iter().map(|&x| (x - max).exp())) as f64;
        worst_old = worst_old.max(rel(old, (lse64(row) - max as f64).exp()));
    }
    eprintln!("an f32 running sum of the exponentials is off by {worst_old:e} relative");
    assert!(worst_old > 100.0 * GRAD_RTOL_F64, "{worst_old:e}");
}

/// The causal softmax of a [t, t] matrix (row `i` over columns `0..=i`).
fn softmax64(s: &[f32], t: usize, i: usize) -> Vec<f64> {
    let row = &s[i * t..i * t + i + 1];
    let lse = lse64(row);
    row.iter().map(|&x| (x as f64 - lse).exp()).collect()
}

#[test]
fn causal_softmax_sums_in_f64() {
    let t = 2048;
    let mut rng = XorShift::new(5);
    let mut s: Vec<f32> = (0..t * t).map(|_| 3.0 * rng.normal()).collect();
    // The last row: a score of 0 first, then t - 1 at -SMALL.
    let last = &mut s[(t - 1) * t..];
    last.fill(-SMALL);
    last[0] = 0.0;
    let old = f32_running_sum(last.iter().map(|&x| x.exp())) as f64;
    let exact = lse64(last).exp();
    let mut p = s.clone();
    softmax_causal(&mut p, t);
    for i in [t / 3, t - 2, t - 1] {
        for (j, (&g, w)) in p[i * t..].iter().zip(softmax64(&s, t, i)).enumerate() {
            assert!(
                rel(g as f64, w) <= ELEM_RTOL,
                "row {i} column {j}: {g:e} vs {w:e}"
            );
        }
    }
    // Backward: the row sum of dp ∘ p over the same adversarial row.
    let dp: Vec<f32> = (0..t * t).map(|_| rng.normal()).collect();
    let mut ds = dp.clone();
    softmax_causal_backward(&p, &mut ds, t, 0.5);
    let i = t - 1;
    let (pr, dr) = (&p[i * t..(i + 1) * t], &dp[i * t..(i + 1) * t]);
    let dot: f64 = pr.iter().zip(dr).map(|(&a, &b)| a as f64 * b as f64).sum();
    for j in 0..t {
        let w = pr[j] as f64 * (dr[j] as f64 - dot) * 0.5;
        let g = ds[i * t + j] as f64;
        assert!(
            (g - w).abs() <= ELEM_RTOL * (pr[j] as f64 * (dr[j].abs() as f64 + dot.abs())),
            "ds column {j}: {g:e} vs {w:e}"
        );
    }
    // 2047 · 2^-25 = 6.1e-5 relative: the old sum misses it all.
    assert!(rel(old, exact) > 10.0 * ELEM_RTOL, "{old} vs {exact}");
}

#[test]
fn rmsnorm_sums_in_f64() {
    let d = 8192;
    let mut rng = XorShift::new(9);
    // Row 0 realistic; row 1: one element 1 and the rest 2^-13 (squares
    // 2^-26, each dropped by an f32 running sum past 1).
    let mut x: Vec<f32> = (0..d).map(|_| rng.normal()).collect();
    let mut adv = vec![1.0 / 8192.0; d];
    adv[7] = 1.0;
    x.extend(&adv);
    let w: Vec<f32> = (0..d).map(|_| 1.0 + 0.1 * rng.normal()).collect();
    let eps = 1e-6f32;
    let (y, inv) = rmsnorm_forward(&x, &w, eps);
    let mut worst_old = 0.0f64;
    for r in 0..2 {
        let xr = &x[r * d..(r + 1) * d];
        let ss: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum();
        let want = 1.0 / (ss / d as f64 + eps as f64).sqrt();
        assert!(
            rel(inv[r] as f64, want) <= ULP2,
            "row {r}: inv {} vs {want}",
            inv[r]
        );
        let old = f32_running_sum(xr.iter().map(|v| v * v)) as f64;
        worst_old = worst_old.max(rel(old, ss));
        for i in 0..d {
            let want_y = xr[i] as f64 * want * w[i] as f64;
            assert!(rel(y[r * d + i] as f64, want_y) <= ELEM_RTOL);
        }
    }
    // Backward on the adversarial row: dy = ones, so dot = Σ w·x.
    let dy = vec![1.0f32; 2 * d];
    let (mut dx, mut dw) = (vec![0.0f32; 2 * d], vec![0.0f32; d]);
    rmsnorm_backward(&dy, &x, &w, &inv, &mut dx, &mut dw);
    let xr = &x[d..];
    let s = inv[1] as f64;
    let dot: f64 = (0..d).map(|i| w[i] as f64 * xr[i] as f64).sum();
    let c = s * s * dot / d as f64;
    for i in 0..d {
        let want = s * (w[i] as f64 - xr[i] as f64 * c);
        let g = dx[d + i] as f64;
        assert!(
            (g - want).abs() <= ELEM_RTOL * s * (w[i] as f64).abs(),
            "dx {i}: {g:e} vs {want:e}"
        );
    }
    assert!(worst_old > 50.0 * ULP2, "{worst_old:e}");
}
