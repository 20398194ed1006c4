// zero llama example: per-lane and per-element bodies of the model's GPU
// kernels (embedding, RMSNorm, RoPE, causal softmax, SwiGLU, cross-entropy,
// forward and backward), shared by the `__global__` wrappers in the .cu
// files next to this header and by the host driver host_check.cpp, which
// examples/llama/tests/kernels_on_host.rs builds with the host C++ compiler.
//
// Like zero_math.cuh (included by name: zero-core's kernel registry hands
// it to NVRTC) this compiles as CUDA under NVRTC without any toolkit header
// and as plain host C++17. bf16 elements are raw u16 bits converted with
// the integer code of zero_math.cuh (`ZeroBF16`). The row reductions
// (RMSNorm's sums, the softmax's and cross-entropy's sums) accumulate in f64,
// as the CPU ops do, so that a lane's running sum over a 150k vocabulary
// loses nothing; the RMSNorm weight gradient's column sums are f32, as is
// everything elementwise.
//
// Row reductions (RMSNorm, softmax, cross-entropy) are written in phases
// for one row per warp of LLAMA_LANES lanes:
//   1. each lane folds its strided elements i = lane, lane + 32, ... into
//      one value (`*_lane` functions);
//   2. the lanes are combined by a butterfly: at distance s = 16, 8, 4, 2, 1
//      lane l becomes op(v[l], v[l ^ s]), so every lane ends with the same
//      value; the device does it with __shfl_xor_sync (llama_warp_reduce),
//      the host driver with llama_butterfly over an array of lanes. The two
//      give the same bits (the ops are commutative);
//   3. each lane writes its strided outputs (`*_write` functions).
// The host driver runs phase 1 for every lane, phase 2, then phase 3 for
// every lane, for every row: the device's computation, in the same order.
//
// Column sums over rows (the RMSNorm weight gradient) are deterministic:
// partial sums per chunk of LLAMA_COL_CHUNK rows, then the chunks added in
// order; no atomics anywhere, so results are run-to-run identical.

#ifndef LLAMA_MATH_CUH
#define LLAMA_MATH_CUH

#include "zero_math.cuh"

#define LLAMA_HD ZERO_HD

// Lanes per row of the row kernels (one warp).
#define LLAMA_LANES 32
// Rows (warps) per block of the row kernels.
#define LLAMA_ROW_WARPS 4
// Threads per block of the elementwise and column kernels.
#define LLAMA_EW_BLOCK 256
// Rows per partial sum of the column reductions.
#define LLAMA_COL_CHUNK 256

typedef int llama_i32;

LLAMA_HD float llama_nan() { return zero_u2f(0x7FC00000u); }
LLAMA_HD float llama_neg_inf() { return zero_u2f(0xFF800000u); }

// ---------------------------------------------------------------------------
// Lane combination
// ---------------------------------------------------------------------------

struct LlamaSum {
  static LLAMA_HD float op(float a, float b) { return a + b; }
  static LLAMA_HD double op(double a, double b) { return a + b; }
};
struct LlamaMax {
  static LLAMA_HD float op(float a, float b) { return fmaxf(a, b); }
};

#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
// Phase 2 on the host: the butterfly the device runs with shuffles.
template <class Op, class V>
inline void llama_butterfly(V lanes[LLAMA_LANES]) {
  for (int s = LLAMA_LANES / 2; s >= 1; s /= 2) {
    V next[LLAMA_LANES];
    for (int l = 0; l < LLAMA_LANES; ++l) {
      next[l] = Op::op(lanes[l], lanes[l ^ s]);
    }
    for (int l = 0; l < LLAMA_LANES; ++l) {
      lanes[l] = next[l];
    }
  }
}
#else
// Phase 2 on the device: lane l takes op(own, lane l ^ s) at s = 16 .. 1.
template <class Op, class V>
__device__ __forceinline__ V llama_warp_reduce(V v) {
  ZERO_UNROLL
  for (int s = LLAMA_LANES / 2; s >= 1; s /= 2) {
    v = Op::op(v, __shfl_xor_sync(0xFFFFFFFFu, v, s));
  }
  return v;
}
#endif

// ---------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------

// Forward, element e of out [rows, dim]: out[r, j] = table[tokens[r], j];
// NaN for a token id >= vocab.
template <class E>
LLAMA_HD void llama_embed_fwd_elem(const typename E::T* table, const zero_u32* tokens,
                                   typename E::T* out, zero_u64 dim, zero_u64 vocab,
                                   zero_u64 e) {
  const zero_u64 r = e / dim;
  const zero_u64 j = e - r * dim;
  const zero_u64 t = tokens[r];
  E::store(out, e, t < vocab ? E::load(table, t * dim + j) : llama_nan());
}

// Backward, thread (segment s, column j), e = s * dim + j: rows
// order[seg_start[s] .. seg_start[s + 1]] all hold token seg_token[s]
// (built on the host by a stable sort, so in increasing row order); their
// gradients are added to dtable[seg_token[s], j] one after another, in the
// CPU's order. One thread per table element: no atomics.
template <class E>
LLAMA_HD void llama_embed_bwd_elem(const typename E::T* dout, const zero_u32* order,
                                   const zero_u32* seg_start, const zero_u32* seg_token,
                                   float* dtable, zero_u64 dim, zero_u64 e) {
  const zero_u64 s = e / dim;
  const zero_u64 j = e - s * dim;
  const zero_u64 at = (zero_u64)seg_token[s] * dim + j;
  float acc = dtable[at];
  for (zero_u32 k = seg_start[s]; k < seg_start[s + 1]; ++k) {
    acc = acc + E::load(dout, (zero_u64)order[k] * dim + j);
  }
  dtable[at] = acc;
}

// ---------------------------------------------------------------------------
// RMSNorm: y = x * inv * w, inv = 1 / sqrt(sum(x^2) / d + eps)
// ---------------------------------------------------------------------------

// Phase 1: this lane's share of sum(x^2) over row x[0 .. d), in f64 (the
// square of an f32 is exact in f64).
template <class E>
LLAMA_HD double llama_rms_fwd_lane(const typename E::T* x, zero_u64 d, unsigned lane) {
  double acc = 0.0;
  for (zero_u64 i = lane; i < d; i += LLAMA_LANES) {
    const double v = (double)E::load(x, i);
    acc = zero_dadd(acc, zero_dmul(v, v));
  }
  return acc;
}

// 1 / sqrt(sumsq / d + eps) in f64, rounded once to f32 (ops::rms_inv).
LLAMA_HD float llama_rms_inv(double sumsq, zero_u64 d, float eps) {
  return (float)(1.0 / sqrt(sumsq / (double)d + (double)eps));
}

// Phase 3: y = x * inv * w for this lane's elements.
template <class E>
LLAMA_HD void llama_rms_fwd_write(const typename E::T* x, const typename E::T* w,
                                  typename E::T* y, zero_u64 d, unsigned lane, float inv) {
  for (zero_u64 i = lane; i < d; i += LLAMA_LANES) {
    E::store(y, i, E::load(x, i) * inv * E::load(w, i));
  }
}

// Backward phase 1: this lane's share of sum(dy * w * x), in f64.
template <class E>
LLAMA_HD double llama_rms_bwd_lane(const typename E::T* dy, const typename E::T* x,
                                   const typename E::T* w, zero_u64 d, unsigned lane) {
  double acc = 0.0;
  for (zero_u64 i = lane; i < d; i += LLAMA_LANES) {
    const double t = zero_dmul(zero_dmul((double)E::load(dy, i), (double)E::load(w, i)),
                               (double)E::load(x, i));
    acc = zero_dadd(acc, t);
  }
  return acc;
}

// Backward phase 3: dx = inv * (dy * w - x * c), c = inv^2 * dot / d (f64,
// rounded once: ops::rms_bwd_coef), added to dx when `accumulate`, else
// written.
template <class E>
LLAMA_HD void llama_rms_bwd_write(const typename E::T* dy, const typename E::T* x,
                                  const typename E::T* w, typename E::T* dx, zero_u64 d,
                                  unsigned lane, float inv, double dot, int accumulate) {
  const double s = (double)inv;
  const float c = (float)(zero_dmul(s, s) * dot / (double)d);
  for (zero_u64 i = lane; i < d; i += LLAMA_LANES) {
    const float g = inv * (E::load(dy, i) * E::load(w, i) - E::load(x, i) * c);
    E::store(dx, i, accumulate ? E::load(dx, i) + g : g);
  }
}

// Weight gradient, thread (chunk c, column j), e = c * d + j:
// partial[e] = sum over rows r of chunk c of dy[r, j] * x[r, j] * inv[r].
template <class E>
LLAMA_HD void llama_rms_dw_partial_elem(const typename E::T* dy, const typename E::T* x,
                                        const float* inv, float* partial, zero_u64 rows,
                                        zero_u64 d, zero_u64 e) {
  const zero_u64 c = e / d;
  const zero_u64 j = e - c * d;
  const zero_u64 end = (c + 1) * LLAMA_COL_CHUNK < rows ? (c + 1) * LLAMA_COL_CHUNK : rows;
  float acc = 0.0f;
  for (zero_u64 r = c * LLAMA_COL_CHUNK; r < end; ++r) {
    acc = acc + E::load(dy, r * d + j) * E::load(x, r * d + j) * inv[r];
  }
  partial[e] = acc;
}

// out[j] += the chunk partials of column j, in chunk order.
LLAMA_HD void llama_colsum_finish_elem(const float* partial, zero_u64 nchunks, zero_u64 d,
                                       float* out, zero_u64 j) {
  float acc = 0.0f;
  for (zero_u64 c = 0; c < nchunks; ++c) {
    acc = acc + partial[c * d + j];
  }
  out[j] = out[j] + acc;
}

// ---------------------------------------------------------------------------
// Causal softmax over the rows of [mats, t, t] score matrices (row i of a
// matrix has the valid columns 0 ..= i; the rest become 0)
// ---------------------------------------------------------------------------

// Phase 1a: this lane's max over the valid columns (-inf when it has none).
template <class E>
LLAMA_HD float llama_softmax_max_lane(const typename E::T* s, zero_u64 valid, unsigned lane) {
  float m = llama_neg_inf();
  for (zero_u64 j = lane; j < valid; j += LLAMA_LANES) {
    m = fmaxf(m, E::load(s, j));
  }
  return m;
}

// Phase 1b: this lane's sum of exp(s - max) over the valid columns: f32
// exponentials added in f64.
template <class E>
LLAMA_HD double llama_softmax_sum_lane(const typename E::T* s, zero_u64 valid, unsigned lane,
                                       float max) {
  double acc = 0.0;
  for (zero_u64 j = lane; j < valid; j += LLAMA_LANES) {
    acc = zero_dadd(acc, (double)expf(E::load(s, j) - max));
  }
  return acc;
}

// Phase 3: p = exp(s - max) * r on the valid columns, r = 1 / sum rounded
// to f32, 0 after them. `p` may be `s` (in place: a lane rewrites only what
// it read).
template <class E>
LLAMA_HD void llama_softmax_write(const typename E::T* s, typename E::T* p, zero_u64 t,
                                  zero_u64 valid, unsigned lane, float max, double sum) {
  const float r = (float)(1.0 / sum);
  for (zero_u64 j = lane; j < t; j += LLAMA_LANES) {
    E::store(p, j, j < valid ? expf(E::load(s, j) - max) * r : 0.0f);
  }
}

// Backward phase 1: this lane's share of sum(p * dp) over the valid
// columns, in f64 (each product exact); the row's sum is rounded to f32
// before phase 3.
template <class E>
LLAMA_HD double llama_softmax_bwd_lane(const typename E::T* p, const typename E::T* dp,
                                       zero_u64 valid, unsigned lane) {
  double acc = 0.0;
  for (zero_u64 j = lane; j < valid; j += LLAMA_LANES) {
    acc = zero_dadd(acc, zero_dmul((double)E::load(p, j), (double)E::load(dp, j)));
  }
  return acc;
}

// Backward phase 3: ds = p * (dp - dot) * scale on the valid columns, 0
// after them. `ds` may be `dp`.
template <class E>
LLAMA_HD void llama_softmax_bwd_write(const typename E::T* p, const typename E::T* dp,
                                      typename E::T* ds, zero_u64 t, zero_u64 valid,
                                      unsigned lane, float dot, float scale) {
  for (zero_u64 j = lane; j < t; j += LLAMA_LANES) {
    E::store(ds, j, j < valid ? E::load(p, j) * (E::load(dp, j) - dot) * scale : 0.0f);
  }
}

// ---------------------------------------------------------------------------
// Cross-entropy over rows of [rows, vocab] logits with targets (< 0:
// ignored row); `inv` = 1 / (number of rows not ignored)
// ---------------------------------------------------------------------------

// Phase 1a / 1b: the softmax lanes over the whole row (`valid` = vocab).

// Phase 3 (ops::cross_entropy): dlogits = exp((x - max) - ln sum) * inv
// (ln sum rounded to f32), minus inv at the target; returns the row's loss
// max - x[target] + ln sum, computed in f64 (for lane 0 to store). An
// ignored row gets zeros and loss 0; a target >= vocab NaN gradients and a
// NaN loss.
template <class E>
LLAMA_HD float llama_ce_write(const typename E::T* x, typename E::T* dx, zero_u64 vocab,
                              llama_i32 target, unsigned lane, float max, double sum,
                              float inv) {
  if (target < 0) {
    for (zero_u64 j = lane; j < vocab; j += LLAMA_LANES) {
      E::store(dx, j, 0.0f);
    }
    return 0.0f;
  }
  if ((zero_u64)target >= vocab) {
    for (zero_u64 j = lane; j < vocab; j += LLAMA_LANES) {
      E::store(dx, j, llama_nan());
    }
    return llama_nan();
  }
  const double ln_sum = log(sum);
  const float ln_sum32 = (float)ln_sum;
  for (zero_u64 j = lane; j < vocab; j += LLAMA_LANES) {
    const float g = expf((E::load(x, j) - max) - ln_sum32) * inv;
    E::store(dx, j, j == (zero_u64)target ? g - inv : g);
  }
  return (float)zero_dadd((double)max - (double)E::load(x, (zero_u64)target), ln_sum);
}

// The mean loss, one warp: lane folds rows lane, lane + 32, ... in f64,
// the butterfly adds the lanes; the total is divided by `count`.
LLAMA_HD double llama_loss_lane(const float* losses, zero_u64 rows, unsigned lane) {
  double acc = 0.0;
  for (zero_u64 r = lane; r < rows; r += LLAMA_LANES) {
    acc = acc + (double)losses[r];
  }
  return acc;
}

LLAMA_HD float llama_loss_mean(double total, zero_u64 count) {
  return count == 0 ? 0.0f : (float)(total / (double)count);
}

// ---------------------------------------------------------------------------
// SwiGLU (elementwise): a = silu(h1) * h3
// ---------------------------------------------------------------------------

LLAMA_HD float llama_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

template <class E>
LLAMA_HD void llama_swiglu_fwd_elem(const typename E::T* h1, const typename E::T* h3,
                                    typename E::T* a, zero_u64 i) {
  const float z = E::load(h1, i);
  E::store(a, i, z * llama_sigmoid(z) * E::load(h3, i));
}

// dh3 = da * z * sig(z), dh1 = da * h3 * sig(z) * (1 + z * (1 - sig(z))).
template <class E>
LLAMA_HD void llama_swiglu_bwd_elem(const typename E::T* da, const typename E::T* h1,
                                    const typename E::T* h3, typename E::T* dh1,
                                    typename E::T* dh3, zero_u64 i) {
  const float z = E::load(h1, i);
  const float g = E::load(da, i);
  const float sg = llama_sigmoid(z);
  const float u = E::load(h3, i);
  E::store(dh3, i, g * z * sg);
  E::store(dh1, i, g * u * sg * (1.0f + z * (1.0f - sg)));
}

// LoRA's inverted dropout with a bit mask (bit i % 32 of word i / 32 set:
// element i kept): v = x * (kept ? keep : 0); out = v, or out + v with acc
// (the backward's dx += dx_in * mask). f32 arithmetic, as the CPU's.
template <class E>
LLAMA_HD void llama_dropout_elem(const typename E::T* x, const zero_u32* bits, float keep,
                                 typename E::T* out, int acc, zero_u64 i) {
  const float k = ((bits[i >> 5] >> (i & 31)) & 1u) ? keep : 0.0f;
  const float v = E::load(x, i) * k;
  E::store(out, i, acc ? E::load(out, i) + v : v);
}

// ---------------------------------------------------------------------------
// RoPE, "rotate half": in place on [rows, heads * 2 * half], position of
// row r = r % seq; cos/sin tables [max_seq, half] (f32)
// ---------------------------------------------------------------------------

// Pair p = (r * heads + h) * half + i rotates elements i and i + half of
// head h of row r; `inverse` applies the transposed rotation (backward).
template <class E>
LLAMA_HD void llama_rope_pair(typename E::T* x, const float* cos_t, const float* sin_t,
                              zero_u64 seq, zero_u64 heads, zero_u64 half, int inverse,
                              zero_u64 p) {
  const zero_u64 i = p % half;
  const zero_u64 rh = p / half;
  const zero_u64 r = rh / heads;
  const zero_u64 pos = r % seq;
  const zero_u64 lo = rh * 2 * half + i;
  const float c = cos_t[pos * half + i];
  const float s = inverse ? -sin_t[pos * half + i] : sin_t[pos * half + i];
  const float a = E::load(x, lo);
  const float b = E::load(x, lo + half);
  E::store(x, lo, a * c - b * s);
  E::store(x, lo + half, b * c + a * s);
}

#endif  // LLAMA_MATH_CUH
