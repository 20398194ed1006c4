//! NEON (aarch64 Advanced SIMD) paths of the CPU AdamW and norm kernels.
//!
//! As the x86 paths: [`adamw_element`](super::adamw_element) lane by lane
//! (`vfmaq_f32(a, b, c)` is the one-rounding `b * c + a`; `vsqrtq_f32` and
//! `vdivq_f32` are correctly rounded), bf16 narrowed like `half`. f16 goes
//! through `half`'s conversions one element at a time (the f16 vector types
//! are not stable in Rust yet); f32 and bf16 are fully vectorized. There are
//! no streaming stores on this path.

use std::arch::aarch64::*;

use super::cpu::{adamw_scalar, finish_chunk, RawChunk, RawTile};
use super::{AdamWStep, NORM_LANES};
use crate::{DType, Element};

/// Loads 4 elements as f32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn load4<T: Element>(p: *const T) -> float32x4_t {
    // SAFETY: the caller gives 4 readable elements of T.
    unsafe {
        match T::DTYPE {
            DType::F32 => vld1q_f32(p.cast()),
            DType::BF16 => vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.cast()))),
            DType::F16 => {
                let w = [
                    (*p).to_f32(),
                    (*p.add(1)).to_f32(),
                    (*p.add(2)).to_f32(),
                    (*p.add(3)).to_f32(),
                ];
                vld1q_f32(w.as_ptr())
            }
        }
    }
}

/// Stores 4 lanes as `T` (rounded as `T::from_f32`).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn store4<T: Element>(p: *mut T, x: float32x4_t) {
    // SAFETY: the caller gives 4 writable elements of T.
    unsafe {
        match T::DTYPE {
            DType::F32 => vst1q_f32(p.cast(), x),
            DType::BF16 => {
                let b = vreinterpretq_u32_f32(x);
                let lsb = vandq_u32(vshrq_n_u32::<16>(b), vdupq_n_u32(1));
                let rounded = vaddq_u32(vaddq_u32(b, vdupq_n_u32(0x7FFF)), lsb);
                let quiet = vorrq_u32(b, vdupq_n_u32(0x0040_0000));
                let nan = vmvnq_u32(vceqq_f32(x, x));
                let w = vbslq_u32(nan, quiet, rounded);
                vst1_u16(p.cast(), vshrn_n_u32::<16>(w));
            }
            DType::F16 => {
                let mut w = [0f32; 4];
                vst1q_f32(w.as_mut_ptr(), x);
                for (j, e) in w.iter().enumerate() {
                    *p.add(j) = T::from_f32(*e);
                }
            }
        }
    }
}

/// The NEON path of one tile.
///
/// # Safety
/// As `cpu::run_tile`; the CPU must have NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn adamw_neon<
    G: Element,
    M: Element,
    P: Element,
    const LOW: bool,
    const TRAFFIC: bool,
>(
    k: &AdamWStep,
    t: RawTile<G, M, P>,
) {
    let n = t.n;
    let mut i = 0;
    // SAFETY: (whole body) the tile's pointers are valid for n elements and
    // this thread's alone; the loop touches i..i+4 <= n.
    unsafe {
        let gs = vdupq_n_f32(k.grad_scale);
        let b1 = vdupq_n_f32(k.beta1);
        let b2 = vdupq_n_f32(k.beta2);
        let omb1 = vdupq_n_f32(k.one_minus_beta1);
        let omb2 = vdupq_n_f32(k.one_minus_beta2);
        let eps = vdupq_n_f32(k.eps);
        let nss = vdupq_n_f32(-k.step_size);
        let isb2 = vdupq_n_f32(k.inv_sqrt_bias2);
        let decay = vdupq_n_f32(k.decay);
        while i + 4 <= n {
            let graw = load4(t.grad.add(i));
            let p = vld1q_f32(t.master.add(i));
            let m = load4(t.m.add(i));
            let v = load4(t.v.add(i));
            let (p1, m1, v1) = if TRAFFIC {
                (vaddq_f32(p, graw), vaddq_f32(m, graw), vaddq_f32(v, graw))
            } else {
                let g = vmulq_f32(graw, gs);
                // vfmaq_f32(a, b, c) = b * c + a, rounded once.
                let m1 = vfmaq_f32(vmulq_f32(omb1, g), b1, m);
                let v1 = vfmaq_f32(vmulq_f32(vmulq_f32(omb2, g), g), b2, v);
                let d = vfmaq_f32(eps, vsqrtq_f32(v1), isb2);
                let p1 = vfmaq_f32(vmulq_f32(p, decay), nss, vdivq_f32(m1, d));
                (p1, m1, v1)
            };
            vst1q_f32(t.master.add(i), p1);
            store4(t.m.add(i), m1);
            store4(t.v.add(i), v1);
            if LOW {
                store4(t.low.add(i), p1);
            }
            i += 4;
        }
        adamw_scalar::<G, M, P, LOW, TRAFFIC>(k, t, i, n);
    }
}

/// The NEON path of one norm chunk.
///
/// # Safety
/// `c` must point to `c.n` readable elements; the CPU must have NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn sum_squares_neon<G: Element>(c: RawChunk<G>) -> f64 {
    let mut acc = [vdupq_n_f64(0.0); 8];
    let mut i = 0;
    // SAFETY: i + 16 <= c.n elements are read.
    unsafe {
        while i + NORM_LANES <= c.n {
            for q in 0..4 {
                let x = load4(c.ptr.add(i + 4 * q));
                let lo = vcvt_f64_f32(vget_low_f32(x));
                let hi = vcvt_high_f64_f32(x);
                // Squares of f32 are exact in f64: one rounding, as `+= y * y`.
                acc[2 * q] = vfmaq_f64(acc[2 * q], lo, lo);
                acc[2 * q + 1] = vfmaq_f64(acc[2 * q + 1], hi, hi);
            }
            i += NORM_LANES;
        }
        let mut lanes = [0f64; NORM_LANES];
        for (j, a) in acc.iter().enumerate() {
            vst1q_f64(lanes.as_mut_ptr().add(2 * j), *a);
        }
        finish_chunk(lanes, c, i)
    }
}
