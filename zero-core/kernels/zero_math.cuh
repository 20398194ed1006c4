// zero: per-element optimizer math shared by the CUDA kernels and the host
// check (zero-core/tests/kernels_on_host.rs).
//
// This header compiles three ways:
//   - under NVRTC (__CUDACC_RTC__): no includes at all (the NVRTC wheel on
//     PyPI ships no CUDA headers), device intrinsics;
//   - under nvcc (__CUDACC__): the same, host pass uses the host branch;
//   - as plain host C++17 (g++/clang++ with -ffp-contract=off
//     -fno-fast-math): libm's fmaf/sqrtf and IEEE `*`, `/`, `+`.
//
// Every operation that could round differently is spelled out: FMA only
// where the reference (zero-core/src/optim/mod.rs, `adamw_element`) uses
// `mul_add`, and on the device the `_rn` intrinsics (never contracted, never
// approximated, never flushed to zero), so no NVRTC option can change a
// result. The bf16/f16 conversions are the integer algorithms of the `half`
// crate (bfloat/convert.rs and the non-SIMD fallback of binary16/arch.rs),
// with the same NaN, infinity and subnormal handling.
//
// Everything here works on one element or on one thread's share of a
// kernel: the thread bodies take the thread index and the thread count, so
// the host check runs exactly the kernels' index and alignment logic by
// looping over the threads of an emulated grid.

#ifndef ZERO_MATH_CUH
#define ZERO_MATH_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ZERO_HD __host__ __device__ __forceinline__
#define ZERO_UNROLL _Pragma("unroll")
#else
#include <math.h>
#include <string.h>
#define ZERO_HD inline
#define ZERO_UNROLL
#endif

typedef unsigned short zero_u16;
typedef unsigned int zero_u32;
typedef unsigned long long zero_u64;

// Threads per block of the AdamW kernels (zero-core/src/cuda/kernels.rs
// launches with the same number).
#define ZERO_ADAMW_BLOCK 256
// Threads per block of the sum-of-squares kernel (at least 16, a multiple
// of 32): all stage a tile, threads 0..15 add it.
#define ZERO_NORM_BLOCK 256
// Rows of 16 elements per shared-memory tile of the sum of squares (32 KiB
// of f32).
#define ZERO_NORM_TILE_ROWS 512
// `NORM_CHUNK` and `NORM_LANES` of zero_core::optim.
#define ZERO_NORM_CHUNK 65536ull
#define ZERO_NORM_LANES 16ull
// Loads a sum-of-squares thread issues before it uses them.
#define ZERO_NORM_UNROLL 8

// ---------------------------------------------------------------------------
// Correctly rounded primitives
// ---------------------------------------------------------------------------

#if defined(__CUDA_ARCH__)
ZERO_HD float zero_fmul(float a, float b) { return __fmul_rn(a, b); }
ZERO_HD float zero_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
ZERO_HD float zero_fsqrt(float a) { return __fsqrt_rn(a); }
ZERO_HD float zero_fdiv(float a, float b) { return __fdiv_rn(a, b); }
ZERO_HD double zero_dmul(double a, double b) { return __dmul_rn(a, b); }
ZERO_HD double zero_dadd(double a, double b) { return __dadd_rn(a, b); }
ZERO_HD zero_u32 zero_f2u(float f) { return __float_as_uint(f); }
ZERO_HD float zero_u2f(zero_u32 u) { return __uint_as_float(u); }
// Leading zeros of a value below 2^16, counted in 16 bits.
ZERO_HD int zero_clz16(zero_u32 x) { return __clz((int)x) - 16; }
#else
ZERO_HD float zero_fmul(float a, float b) { return a * b; }
ZERO_HD float zero_fma(float a, float b, float c) { return fmaf(a, b, c); }
ZERO_HD float zero_fsqrt(float a) { return sqrtf(a); }
ZERO_HD float zero_fdiv(float a, float b) { return a / b; }
ZERO_HD double zero_dmul(double a, double b) { return a * b; }
ZERO_HD double zero_dadd(double a, double b) { return a + b; }
ZERO_HD zero_u32 zero_f2u(float f) {
  zero_u32 u;
  memcpy(&u, &f, sizeof u);
  return u;
}
ZERO_HD float zero_u2f(zero_u32 u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
ZERO_HD int zero_clz16(zero_u32 x) {
  int n = 0;
  for (zero_u32 bit = 0x8000u; bit != 0 && (x & bit) == 0; bit >>= 1) {
    ++n;
  }
  return n;
}
#endif

// ---------------------------------------------------------------------------
// bf16 and f16 <-> f32, as the `half` crate
// ---------------------------------------------------------------------------

// half::bf16::to_f32: a NaN gets its quiet bit set, everything else is exact.
ZERO_HD float zero_bf16_to_f32(zero_u16 h) {
  zero_u32 i = h;
  if ((i & 0x7FFFu) > 0x7F80u) {
    return zero_u2f((i | 0x0040u) << 16);
  }
  return zero_u2f(i << 16);
}

// half::bf16::from_f32: round to nearest, ties to even; a NaN keeps its top
// payload bits and gets its quiet bit set.
ZERO_HD zero_u16 zero_f32_to_bf16(float value) {
  const zero_u32 x = zero_f2u(value);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return (zero_u16)((x >> 16) | 0x0040u);
  }
  const zero_u32 round_bit = 0x00008000u;
  if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) {
    return (zero_u16)((x >> 16) + 1u);
  }
  return (zero_u16)(x >> 16);
}

// half::f16::to_f32 (f16_to_f32_fallback).
ZERO_HD float zero_f16_to_f32(zero_u16 h) {
  const zero_u32 i = h;
  if ((i & 0x7FFFu) == 0) {
    return zero_u2f(i << 16);
  }
  const zero_u32 half_sign = i & 0x8000u;
  const zero_u32 half_exp = i & 0x7C00u;
  const zero_u32 half_man = i & 0x03FFu;
  if (half_exp == 0x7C00u) {
    if (half_man == 0) {
      return zero_u2f((half_sign << 16) | 0x7F800000u);
    }
    return zero_u2f((half_sign << 16) | 0x7FC00000u | (half_man << 13));
  }
  const zero_u32 sign = half_sign << 16;
  if (half_exp == 0) {
    // Subnormal: normalize by the leading zeros of the mantissa.
    const int e = zero_clz16(half_man) - 6;
    const zero_u32 exp = (zero_u32)(127 - 15 - e) << 23;
    const zero_u32 man = (half_man << (14 + e)) & 0x7FFFFFu;
    return zero_u2f(sign | exp | man);
  }
  const int unbiased_exp = (int)(half_exp >> 10) - 15;
  const zero_u32 exp = (zero_u32)(unbiased_exp + 127) << 23;
  const zero_u32 man = (half_man & 0x03FFu) << 13;
  return zero_u2f(sign | exp | man);
}

// half::f16::from_f32 (f32_to_f16_fallback; the F16C instruction that half
// uses where the CPU has it gives the same bits): round to nearest, ties to
// even, overflow to infinity, gradual underflow.
ZERO_HD zero_u16 zero_f32_to_f16(float value) {
  const zero_u32 x = zero_f2u(value);
  const zero_u32 sign = x & 0x80000000u;
  const zero_u32 exp = x & 0x7F800000u;
  const zero_u32 man = x & 0x007FFFFFu;
  if (exp == 0x7F800000u) {
    const zero_u32 nan_bit = man == 0 ? 0u : 0x0200u;
    return (zero_u16)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
  }
  const zero_u32 half_sign = sign >> 16;
  const int unbiased_exp = (int)(exp >> 23) - 127;
  const int half_exp = unbiased_exp + 15;
  if (half_exp >= 0x1F) {
    return (zero_u16)(half_sign | 0x7C00u);
  }
  if (half_exp <= 0) {
    if (14 - half_exp > 24) {
      return (zero_u16)half_sign;
    }
    const zero_u32 m = man | 0x00800000u;
    zero_u32 half_man = m >> (14 - half_exp);
    const zero_u32 round_bit = 1u << (13 - half_exp);
    if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) {
      half_man += 1u;
    }
    return (zero_u16)(half_sign | half_man);
  }
  const zero_u32 he = (zero_u32)half_exp << 10;
  const zero_u32 half_man = man >> 13;
  const zero_u32 round_bit = 0x00001000u;
  if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) {
    return (zero_u16)((half_sign | he | half_man) + 1u);
  }
  return (zero_u16)(half_sign | he | half_man);
}

// ---------------------------------------------------------------------------
// Element types: storage, widening, narrowing, 4-element loads and stores
// ---------------------------------------------------------------------------

// Four elements of 4 bytes / of 2 bytes, loaded and stored as one access.
struct alignas(16) zero_v4u32 {
  zero_u32 a, b, c, d;
};
struct alignas(8) zero_v2u32 {
  zero_u32 a, b;
};

ZERO_HD bool zero_aligned(const void* p, zero_u64 bytes) {
  return ((zero_u64)p & (bytes - 1)) == 0;
}

#if defined(__CUDA_ARCH__)
ZERO_HD zero_v4u32 zero_load_v4(const void* p) {
  return *static_cast<const zero_v4u32*>(p);
}
ZERO_HD zero_v2u32 zero_load_v2(const void* p) {
  return *static_cast<const zero_v2u32*>(p);
}
ZERO_HD void zero_store_v4(void* p, zero_v4u32 w) { *static_cast<zero_v4u32*>(p) = w; }
ZERO_HD void zero_store_v2(void* p, zero_v2u32 w) { *static_cast<zero_v2u32*>(p) = w; }
#else
ZERO_HD zero_v4u32 zero_load_v4(const void* p) {
  zero_v4u32 w;
  memcpy(&w, p, sizeof w);
  return w;
}
ZERO_HD zero_v2u32 zero_load_v2(const void* p) {
  zero_v2u32 w;
  memcpy(&w, p, sizeof w);
  return w;
}
ZERO_HD void zero_store_v4(void* p, zero_v4u32 w) { memcpy(p, &w, sizeof w); }
ZERO_HD void zero_store_v2(void* p, zero_v2u32 w) { memcpy(p, &w, sizeof w); }
#endif

// f32 elements.
struct ZeroF32 {
  typedef float T;
  static ZERO_HD float load(const T* p, zero_u64 i) { return p[i]; }
  static ZERO_HD void store(T* p, zero_u64 i, float x) { p[i] = x; }
  // Whether 4-element accesses at multiples of 4 elements are aligned.
  static ZERO_HD bool aligned4(const T* p) { return zero_aligned(p, 16); }
  static ZERO_HD void load4(const T* p, zero_u64 i, float x[4]) {
    const zero_v4u32 w = zero_load_v4(p + i);
    x[0] = zero_u2f(w.a);
    x[1] = zero_u2f(w.b);
    x[2] = zero_u2f(w.c);
    x[3] = zero_u2f(w.d);
  }
  static ZERO_HD void store4(T* p, zero_u64 i, const float x[4]) {
    zero_v4u32 w;
    w.a = zero_f2u(x[0]);
    w.b = zero_f2u(x[1]);
    w.c = zero_f2u(x[2]);
    w.d = zero_f2u(x[3]);
    zero_store_v4(p + i, w);
  }
};

// The conversions of a 16-bit element type.
struct ZeroBF16Codec {
  static ZERO_HD float widen(zero_u16 h) { return zero_bf16_to_f32(h); }
  static ZERO_HD zero_u16 narrow(float x) { return zero_f32_to_bf16(x); }
};
struct ZeroF16Codec {
  static ZERO_HD float widen(zero_u16 h) { return zero_f16_to_f32(h); }
  static ZERO_HD zero_u16 narrow(float x) { return zero_f32_to_f16(x); }
};

// 16-bit elements (bf16 or f16, by `Codec`).
template <class Codec>
struct ZeroHalfBits {
  typedef zero_u16 T;
  static ZERO_HD float load(const T* p, zero_u64 i) { return Codec::widen(p[i]); }
  static ZERO_HD void store(T* p, zero_u64 i, float x) { p[i] = Codec::narrow(x); }
  static ZERO_HD bool aligned4(const T* p) { return zero_aligned(p, 8); }
  static ZERO_HD void load4(const T* p, zero_u64 i, float x[4]) {
    // Little endian: the element at the lower address is the low half.
    const zero_v2u32 w = zero_load_v2(p + i);
    x[0] = Codec::widen((zero_u16)(w.a & 0xFFFFu));
    x[1] = Codec::widen((zero_u16)(w.a >> 16));
    x[2] = Codec::widen((zero_u16)(w.b & 0xFFFFu));
    x[3] = Codec::widen((zero_u16)(w.b >> 16));
  }
  static ZERO_HD void store4(T* p, zero_u64 i, const float x[4]) {
    zero_v2u32 w;
    w.a = (zero_u32)Codec::narrow(x[0]) | ((zero_u32)Codec::narrow(x[1]) << 16);
    w.b = (zero_u32)Codec::narrow(x[2]) | ((zero_u32)Codec::narrow(x[3]) << 16);
    zero_store_v2(p + i, w);
  }
};

typedef ZeroHalfBits<ZeroBF16Codec> ZeroBF16;
typedef ZeroHalfBits<ZeroF16Codec> ZeroF16;

// No low-precision copy: stores do nothing (the pointer is null).
struct ZeroNone {
  typedef zero_u16 T;
  static ZERO_HD void store(T*, zero_u64, float) {}
  static ZERO_HD bool aligned4(const T*) { return true; }
  static ZERO_HD void store4(T*, zero_u64, const float*) {}
};

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

// zero_core::optim::AdamWStep, field for field (the Rust launcher passes a
// #[repr(C)] struct of nine f32 in this order).
struct ZeroAdamWConsts {
  float grad_scale;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float step_size;
  float inv_sqrt_bias2;
  float decay;
};

// zero_core::optim::adamw_element:
//   g  = grad * grad_scale
//   m' = fma(beta1, m, one_minus_beta1 * g)
//   v' = fma(beta2, v, (one_minus_beta2 * g) * g)
//   d  = fma(sqrt(v'), inv_sqrt_bias2, eps)
//   p' = fma(-step_size, m' / d, p * decay)
ZERO_HD void zero_adamw_element(const ZeroAdamWConsts& k, float p, float grad, float m, float v,
                                float* p_out, float* m_out, float* v_out) {
  const float g = zero_fmul(grad, k.grad_scale);
  const float m1 = zero_fma(k.beta1, m, zero_fmul(k.one_minus_beta1, g));
  const float v1 = zero_fma(k.beta2, v, zero_fmul(zero_fmul(k.one_minus_beta2, g), g));
  const float d = zero_fma(zero_fsqrt(v1), k.inv_sqrt_bias2, k.eps);
  const float p1 = zero_fma(-k.step_size, zero_fdiv(m1, d), zero_fmul(p, k.decay));
  *p_out = p1;
  *m_out = m1;
  *v_out = v1;
}

// One thread's share of the fused AdamW over `n` elements, thread `tid` of
// `nthreads` (a grid-stride loop).
//
// When every pointer allows it, the elements go in groups of four with one
// 16-byte (f32) or 8-byte (bf16/f16) access per array and group; the last
// n % 4 elements, or all of them when any pointer is misaligned, go one by
// one. Each element is written by exactly one thread, so running the
// threads one after another (the host check) gives the kernel's result.
template <class G, class M, class P>
ZERO_HD void zero_adamw_thread(const ZeroAdamWConsts& k, float* master, const typename G::T* grad,
                               typename M::T* m, typename M::T* v, typename P::T* low,
                               zero_u64 n, zero_u64 tid, zero_u64 nthreads) {
  const bool vec = ZeroF32::aligned4(master) && G::aligned4(grad) && M::aligned4(m) &&
                   M::aligned4(v) && P::aligned4(low);
  const zero_u64 groups = vec ? n / 4 : 0;
  for (zero_u64 q = tid; q < groups; q += nthreads) {
    const zero_u64 i = 4 * q;
    float p[4], g[4], mm[4], vv[4];
    ZeroF32::load4(master, i, p);
    G::load4(grad, i, g);
    M::load4(m, i, mm);
    M::load4(v, i, vv);
    ZERO_UNROLL
    for (int j = 0; j < 4; ++j) {
      zero_adamw_element(k, p[j], g[j], mm[j], vv[j], &p[j], &mm[j], &vv[j]);
    }
    ZeroF32::store4(master, i, p);
    M::store4(m, i, mm);
    M::store4(v, i, vv);
    P::store4(low, i, p);
  }
  for (zero_u64 i = 4 * groups + tid; i < n; i += nthreads) {
    float p1, m1, v1;
    zero_adamw_element(k, master[i], G::load(grad, i), M::load(m, i), M::load(v, i), &p1, &m1,
                       &v1);
    master[i] = p1;
    M::store(m, i, m1);
    M::store(v, i, v1);
    P::store(low, i, p1);
  }
}

// ---------------------------------------------------------------------------
// Sum of squares in zero_core::optim::sum_squares's order
// ---------------------------------------------------------------------------
//
// One block per chunk at a time. The chunk goes through shared memory in
// tiles of ZERO_NORM_TILE_ROWS rows of 16 elements: every thread of the
// block stages the tile (zero_sumsq_stage, widened to f32), then the 16
// lane threads add it (zero_sumsq_lane_tile), each continuing its own lane.
// After the last tile the lanes are combined by the pairwise tree.

// lane += x^2, with x widened to f64 (the square of an f32 is exact in f64).
ZERO_HD double zero_sq_add(double lane, float x) {
  const double y = (double)x;
  return zero_dadd(lane, zero_dmul(y, y));
}

// Thread `tid` of `nthreads`: copies its share of `count` elements from
// `src` to the f32 tile `dst`. With `src` aligned, four elements per access
// and ZERO_NORM_UNROLL accesses in flight per thread before the stores.
template <class G>
ZERO_HD void zero_sumsq_stage(const typename G::T* src, zero_u64 count, float* dst,
                              zero_u64 tid, zero_u64 nthreads) {
  const zero_u64 groups = G::aligned4(src) ? count / 4 : 0;
  for (zero_u64 q0 = tid; q0 < groups; q0 += ZERO_NORM_UNROLL * nthreads) {
    float v[ZERO_NORM_UNROLL][4];
    ZERO_UNROLL
    for (int u = 0; u < ZERO_NORM_UNROLL; ++u) {
      const zero_u64 q = q0 + u * nthreads;
      if (q < groups) {
        G::load4(src, 4 * q, v[u]);
      }
    }
    ZERO_UNROLL
    for (int u = 0; u < ZERO_NORM_UNROLL; ++u) {
      const zero_u64 q = q0 + u * nthreads;
      if (q < groups) {
        ZERO_UNROLL
        for (int j = 0; j < 4; ++j) {
          dst[4 * q + j] = v[u][j];
        }
      }
    }
  }
  for (zero_u64 i = 4 * groups + tid; i < count; i += nthreads) {
    dst[i] = G::load(src, i);
  }
}

// Lane `lane` (0..16) of a staged tile of `count` elements (rows of 16 from
// the tile's start, the last row possibly partial): adds the squares of
// tile[r * 16 + lane] in increasing r to `acc` and returns it. The tile
// reads are independent of the chain, so ZERO_NORM_UNROLL of them are
// issued before their additions.
ZERO_HD double zero_sumsq_lane_tile(const float* tile, zero_u64 count, unsigned lane,
                                    double acc) {
  const zero_u64 rows = count / ZERO_NORM_LANES;
  zero_u64 r = 0;
  for (; r + ZERO_NORM_UNROLL <= rows; r += ZERO_NORM_UNROLL) {
    float v[ZERO_NORM_UNROLL];
    ZERO_UNROLL
    for (int u = 0; u < ZERO_NORM_UNROLL; ++u) {
      v[u] = tile[(r + u) * ZERO_NORM_LANES + lane];
    }
    ZERO_UNROLL
    for (int u = 0; u < ZERO_NORM_UNROLL; ++u) {
      acc = zero_sq_add(acc, v[u]);
    }
  }
  for (; r < rows; ++r) {
    acc = zero_sq_add(acc, tile[r * ZERO_NORM_LANES + lane]);
  }
  const zero_u64 i = rows * ZERO_NORM_LANES + lane;
  if (i < count) {
    acc = zero_sq_add(acc, tile[i]);
  }
  return acc;
}

// The pairwise tree 16 -> 8 -> 4 -> 2 -> 1 over the lanes, in the order of
// the kernel's shuffles: at distance s = 1, 2, 4, 8, lane j (a multiple of
// 2s) becomes lane j + lane j+s, i.e. the sum of lanes j .. j+2s-1.
ZERO_HD double zero_sumsq_tree16(double lanes[16]) {
  for (int s = 1; s < 16; s *= 2) {
    for (int j = 0; j < 16; j += 2 * s) {
      lanes[j] = zero_dadd(lanes[j], lanes[j + s]);
    }
  }
  return lanes[0];
}

// The chunk sums added in chunk order, from 0.0.
ZERO_HD double zero_sumsq_finish(const double* chunk_sums, zero_u64 nchunks) {
  double acc = 0.0;
  for (zero_u64 c = 0; c < nchunks; ++c) {
    acc = zero_dadd(acc, chunk_sums[c]);
  }
  return acc;
}

#endif  // ZERO_MATH_CUH
