//! AVX2 (+FMA, F16C) and AVX-512F paths of the CPU AdamW and norm kernels.
//!
//! Each function here is compiled for its instruction set with
//! `#[target_feature]` and is only called (by `cpu.rs`) after the CPU was
//! checked. The update is [`adamw_element`](super::adamw_element) lane by
//! lane: `vfmadd` is the one-rounding `mul_add`, `vsqrtps` and `vdivps` are
//! correctly rounded, so every lane gives the reference's bits. Heads (to
//! align streaming stores) and tails go through the scalar path.

use std::arch::x86_64::*;

use super::cpu::{adamw_scalar, finish_chunk, RawChunk, RawTile};
use super::{AdamWStep, NORM_LANES};
use crate::{DType, Element};

/// Elements per block of the update loops (a few KiB per array: in L1).
const SUB: usize = 512;

// ---------------------------------------------------------------------------
// AVX2: 8 lanes
// ---------------------------------------------------------------------------

/// Loads 8 elements as f32 (bf16 and f16 widened exactly).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<T: Element>(p: *const T) -> __m256 {
    // SAFETY: the caller gives 8 readable elements of T, whose layout
    // matches T::DTYPE (checked in cpu.rs).
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm256_loadu_ps(p.cast()),
            DType::BF16 => {
                let h = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        }
    }
}

/// Loads 4 elements as f32 (for the norm pass, which widens to f64 four
/// at a time).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load4<T: Element>(p: *const T) -> __m128 {
    // SAFETY: the caller gives 4 readable elements of T.
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm_loadu_ps(p.cast()),
            DType::BF16 => {
                let h = _mm_loadl_epi64(p.cast());
                _mm_castsi128_ps(_mm_slli_epi32::<16>(_mm_cvtepu16_epi32(h)))
            }
            DType::F16 => _mm_cvtph_ps(_mm_loadl_epi64(p.cast())),
        }
    }
}

/// f32 → bf16 bits, 8 lanes, as `half::bf16::from_f32`: round to nearest
/// even; a NaN keeps its top bits and becomes quiet.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bf16x8(x: __m256) -> __m128i {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        _mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)),
        lsb,
    ));
    let quiet = _mm256_srli_epi32::<16>(_mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000)));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let w = _mm256_blendv_epi8(rounded, quiet, nan);
    // Every lane is below 2^16, so the unsigned saturating pack is exact.
    _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w))
}

/// 8 lanes narrowed to the 16-bit type `T` (bf16 or f16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn narrow8<T: Element>(x: __m256) -> __m128i {
    match T::DTYPE {
        DType::F16 => _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x),
        _ => bf16x8(x),
    }
}

/// Stores 8 lanes as `T` (rounded as `T::from_f32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store8<T: Element>(p: *mut T, x: __m256) {
    // SAFETY: the caller gives 8 writable elements of T.
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm256_storeu_ps(p.cast(), x),
            _ => _mm_storeu_si128(p.cast(), narrow8::<T>(x)),
        }
    }
}

/// [`store8`] with a non-temporal store; `p` must be aligned to 8 elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn stream8<T: Element>(p: *mut T, x: __m256) {
    // SAFETY: the caller gives 8 writable elements of T at an address
    // aligned to their size (32 bytes for f32, 16 for 16-bit types).
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm256_stream_ps(p.cast(), x),
            _ => _mm_stream_si128(p.cast(), narrow8::<T>(x)),
        }
    }
}

/// How many head elements to leave to the scalar path so that `low + head`
/// is aligned to `bytes` (all of `n` if that never happens).
fn head_for<P>(low: *mut P, n: usize, bytes: usize) -> usize {
    let size = std::mem::size_of::<P>();
    let misalign = (low as usize) % bytes;
    if misalign == 0 {
        0
    } else if !misalign.is_multiple_of(size) {
        n
    } else {
        ((bytes - misalign) / size).min(n)
    }
}

/// The AVX2 path of one tile.
///
/// # Safety
/// As `cpu::run_tile`; the CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn adamw_avx2<
    G: Element,
    M: Element,
    P: Element,
    const LOW: bool,
    const TRAFFIC: bool,
>(
    k: &AdamWStep,
    t: RawTile<G, M, P>,
    stream: bool,
) {
    let stream = LOW && stream;
    let n = t.n;
    let mut i = if stream {
        head_for(t.low, n, 8 * std::mem::size_of::<P>())
    } else {
        0
    };
    // SAFETY: (whole body) the tile's pointers are valid for n elements and
    // this thread's alone; the loop touches i..i+8 <= n.
    unsafe {
        adamw_scalar::<G, M, P, LOW, TRAFFIC>(k, t, 0, i);
        let gs = _mm256_set1_ps(k.grad_scale);
        let b1 = _mm256_set1_ps(k.beta1);
        let b2 = _mm256_set1_ps(k.beta2);
        let omb1 = _mm256_set1_ps(k.one_minus_beta1);
        let omb2 = _mm256_set1_ps(k.one_minus_beta2);
        let eps = _mm256_set1_ps(k.eps);
        let nss = _mm256_set1_ps(-k.step_size);
        let isb2 = _mm256_set1_ps(k.inv_sqrt_bias2);
        let decay = _mm256_set1_ps(k.decay);
        // Eight elements at `$i`, without the copy.
        macro_rules! eight {
            ($i:expr) => {{
                let i = $i;
                let graw = load8(t.grad.add(i));
                let p = _mm256_loadu_ps(t.master.add(i));
                let m = load8(t.m.add(i));
                let v = load8(t.v.add(i));
                let g = _mm256_mul_ps(graw, gs);
                let m1 = _mm256_fmadd_ps(b1, m, _mm256_mul_ps(omb1, g));
                let v1 = _mm256_fmadd_ps(b2, v, _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
                let d = _mm256_fmadd_ps(_mm256_sqrt_ps(v1), isb2, eps);
                let p1 = _mm256_fmadd_ps(nss, _mm256_div_ps(m1, d), _mm256_mul_ps(p, decay));
                _mm256_storeu_ps(t.master.add(i), p1);
                store8(t.m.add(i), m1);
                store8(t.v.add(i), v1);
            }};
        }
        // Blocks of SUB elements: first the update, then the copy from the
        // block's fresh master (still in L1). Narrowing right after the
        // division would keep the vector scheduler full of operations
        // waiting on the sqrt/div chains; a separate short loop does not.
        let simd_end = i + (n - i) / 8 * 8;
        if TRAFFIC {
            // The roofline: one plain pass, every store in place.
            while i < simd_end {
                let g = load8(t.grad.add(i));
                let p1 = _mm256_add_ps(_mm256_loadu_ps(t.master.add(i)), g);
                _mm256_storeu_ps(t.master.add(i), p1);
                store8(t.m.add(i), _mm256_add_ps(load8(t.m.add(i)), g));
                store8(t.v.add(i), _mm256_add_ps(load8(t.v.add(i)), g));
                if LOW {
                    if stream {
                        stream8(t.low.add(i), p1);
                    } else {
                        store8(t.low.add(i), p1);
                    }
                }
                i += 8;
            }
        }
        while i < simd_end {
            let end = (i + SUB).min(simd_end);
            let mut j = i;
            // Two independent groups per iteration.
            while j + 16 <= end {
                eight!(j);
                eight!(j + 8);
                j += 16;
            }
            if j < end {
                eight!(j);
            }
            if LOW {
                for j in (i..end).step_by(8) {
                    let p1 = _mm256_loadu_ps(t.master.add(j));
                    if stream {
                        stream8(t.low.add(j), p1);
                    } else {
                        store8(t.low.add(j), p1);
                    }
                }
            }
            i = end;
        }
        adamw_scalar::<G, M, P, LOW, TRAFFIC>(k, t, i, n);
        if stream {
            _mm_sfence();
        }
    }
}

/// The AVX2 path of one norm chunk.
///
/// # Safety
/// `c` must point to `c.n` readable elements; the CPU must have AVX2, FMA
/// and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn sum_squares_avx2<G: Element>(c: RawChunk<G>) -> f64 {
    let mut acc = [_mm256_setzero_pd(); 4];
    let mut i = 0;
    // SAFETY: i + 16 <= c.n elements are read.
    unsafe {
        while i + NORM_LANES <= c.n {
            let d = if G::DTYPE == DType::BF16 {
                // bf16 → f32 is the 16 bits moved to the top: interleave
                // with zeros (one instruction per four elements).
                let z = _mm_setzero_si128();
                let a = _mm_loadu_si128(c.ptr.add(i).cast());
                let b = _mm_loadu_si128(c.ptr.add(i + 8).cast());
                [
                    _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(z, a))),
                    _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpackhi_epi16(z, a))),
                    _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(z, b))),
                    _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpackhi_epi16(z, b))),
                ]
            } else {
                [
                    _mm256_cvtps_pd(load4(c.ptr.add(i))),
                    _mm256_cvtps_pd(load4(c.ptr.add(i + 4))),
                    _mm256_cvtps_pd(load4(c.ptr.add(i + 8))),
                    _mm256_cvtps_pd(load4(c.ptr.add(i + 12))),
                ]
            };
            // The square of an f32 is exact in f64, so the fused
            // multiply-add rounds once, like the reference's `+= y * y`.
            for j in 0..4 {
                acc[j] = _mm256_fmadd_pd(d[j], d[j], acc[j]);
            }
            i += NORM_LANES;
        }
        let mut lanes = [0f64; NORM_LANES];
        for (j, a) in acc.iter().enumerate() {
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * j), *a);
        }
        finish_chunk(lanes, c, i)
    }
}

// ---------------------------------------------------------------------------
// AVX-512F: 16 lanes
// ---------------------------------------------------------------------------

/// Loads 16 elements as f32.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn load16<T: Element>(p: *const T) -> __m512 {
    // SAFETY: the caller gives 16 readable elements of T.
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm512_loadu_ps(p.cast()),
            DType::BF16 => {
                let h = _mm256_loadu_si256(p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        }
    }
}

/// f32 → bf16 bits, 16 lanes, as [`bf16x8`].
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn bf16x16(x: __m512) -> __m256i {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
        _mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
        lsb,
    ));
    let quiet = _mm512_srli_epi32::<16>(_mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000)));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
}

/// 16 lanes narrowed to the 16-bit type `T`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn narrow16<T: Element>(x: __m512) -> __m256i {
    match T::DTYPE {
        DType::F16 => _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x),
        _ => bf16x16(x),
    }
}

/// Stores 16 lanes as `T`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn store16<T: Element>(p: *mut T, x: __m512) {
    // SAFETY: the caller gives 16 writable elements of T.
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm512_storeu_ps(p.cast(), x),
            _ => _mm256_storeu_si256(p.cast(), narrow16::<T>(x)),
        }
    }
}

/// [`store16`] with a non-temporal store; `p` aligned to 16 elements.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn stream16<T: Element>(p: *mut T, x: __m512) {
    // SAFETY: the caller gives 16 writable elements of T at an address
    // aligned to their size (64 bytes for f32, 32 for 16-bit types).
    unsafe {
        match T::DTYPE {
            DType::F32 => _mm512_stream_ps(p.cast(), x),
            _ => _mm256_stream_si256(p.cast(), narrow16::<T>(x)),
        }
    }
}

/// The AVX-512 path of one tile.
///
/// # Safety
/// As `cpu::run_tile`; the CPU must have AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn adamw_avx512<
    G: Element,
    M: Element,
    P: Element,
    const LOW: bool,
    const TRAFFIC: bool,
>(
    k: &AdamWStep,
    t: RawTile<G, M, P>,
    stream: bool,
) {
    let stream = LOW && stream;
    let n = t.n;
    let mut i = if stream {
        head_for(t.low, n, 16 * std::mem::size_of::<P>())
    } else {
        0
    };
    // SAFETY: (whole body) as in `adamw_avx2`, with i..i+16 <= n.
    unsafe {
        adamw_scalar::<G, M, P, LOW, TRAFFIC>(k, t, 0, i);
        let gs = _mm512_set1_ps(k.grad_scale);
        let b1 = _mm512_set1_ps(k.beta1);
        let b2 = _mm512_set1_ps(k.beta2);
        let omb1 = _mm512_set1_ps(k.one_minus_beta1);
        let omb2 = _mm512_set1_ps(k.one_minus_beta2);
        let eps = _mm512_set1_ps(k.eps);
        let nss = _mm512_set1_ps(-k.step_size);
        let isb2 = _mm512_set1_ps(k.inv_sqrt_bias2);
        let decay = _mm512_set1_ps(k.decay);
        // Sixteen elements at `$i`, without the copy.
        macro_rules! sixteen {
            ($i:expr) => {{
                let i = $i;
                let graw = load16(t.grad.add(i));
                let p = _mm512_loadu_ps(t.master.add(i));
                let m = load16(t.m.add(i));
                let v = load16(t.v.add(i));
                let g = _mm512_mul_ps(graw, gs);
                let m1 = _mm512_fmadd_ps(b1, m, _mm512_mul_ps(omb1, g));
                let v1 = _mm512_fmadd_ps(b2, v, _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
                let d = _mm512_fmadd_ps(_mm512_sqrt_ps(v1), isb2, eps);
                let p1 = _mm512_fmadd_ps(nss, _mm512_div_ps(m1, d), _mm512_mul_ps(p, decay));
                _mm512_storeu_ps(t.master.add(i), p1);
                store16(t.m.add(i), m1);
                store16(t.v.add(i), v1);
            }};
        }
        // As in `adamw_avx2`: blocks of SUB elements, the update then the copy.
        let simd_end = i + (n - i) / 16 * 16;
        if TRAFFIC {
            // The roofline: one plain pass, every store in place.
            while i < simd_end {
                let g = load16(t.grad.add(i));
                let p1 = _mm512_add_ps(_mm512_loadu_ps(t.master.add(i)), g);
                _mm512_storeu_ps(t.master.add(i), p1);
                store16(t.m.add(i), _mm512_add_ps(load16(t.m.add(i)), g));
                store16(t.v.add(i), _mm512_add_ps(load16(t.v.add(i)), g));
                if LOW {
                    if stream {
                        stream16(t.low.add(i), p1);
                    } else {
                        store16(t.low.add(i), p1);
                    }
                }
                i += 16;
            }
        }
        while i < simd_end {
            let end = (i + SUB).min(simd_end);
            let mut j = i;
            while j + 32 <= end {
                sixteen!(j);
                sixteen!(j + 16);
                j += 32;
            }
            if j < end {
                sixteen!(j);
            }
            if LOW {
                for j in (i..end).step_by(16) {
                    let p1 = _mm512_loadu_ps(t.master.add(j));
                    if stream {
                        stream16(t.low.add(j), p1);
                    } else {
                        store16(t.low.add(j), p1);
                    }
                }
            }
            i = end;
        }
        adamw_scalar::<G, M, P, LOW, TRAFFIC>(k, t, i, n);
        if stream {
            _mm_sfence();
        }
    }
}

/// The AVX-512 path of one norm chunk.
///
/// # Safety
/// `c` must point to `c.n` readable elements; the CPU must have AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn sum_squares_avx512<G: Element>(c: RawChunk<G>) -> f64 {
    let mut acc = [_mm512_setzero_pd(); 2];
    let mut i = 0;
    // SAFETY: i + 16 <= c.n elements are read.
    unsafe {
        while i + NORM_LANES <= c.n {
            let x = load16(c.ptr.add(i));
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)));
            let d = [
                _mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                _mm512_cvtps_pd(hi),
            ];
            acc[0] = _mm512_fmadd_pd(d[0], d[0], acc[0]);
            acc[1] = _mm512_fmadd_pd(d[1], d[1], acc[1]);
            i += NORM_LANES;
        }
        let mut lanes = [0f64; NORM_LANES];
        _mm512_storeu_pd(lanes.as_mut_ptr(), acc[0]);
        _mm512_storeu_pd(lanes.as_mut_ptr().add(8), acc[1]);
        finish_chunk(lanes, c, i)
    }
}
