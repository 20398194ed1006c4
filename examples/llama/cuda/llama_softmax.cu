// zero llama example: the causal softmax of attention and the
// cross-entropy loss on the GPU, forward and backward (compiled at run time
// by NVRTC; the per-lane math is in llama_math.cuh).
//
// Entry points, E in {f32, bf16} (bf16 as raw bits):
//   llama_softmax_causal_fwd_E(s, p, mats, t)
//       s, p: [mats, t, t] scores (already scaled) and probabilities; row i
//       of each matrix keeps columns 0 ..= i, the rest become 0. p may be s.
//   llama_softmax_causal_bwd_E(p, dp, ds, mats, t, scale)
//       ds = p * (dp - rowsum(p * dp)) * scale, 0 above the diagonal. ds may
//       be dp.
//   llama_cross_entropy_E(logits, targets, dlogits, losses, rows, vocab, inv)
//       per row: losses[r] = logsumexp - logit of the target (0 for a
//       target < 0), dlogits = (softmax - onehot) * inv (0 for an ignored
//       row); inv = 1 / (rows not ignored).
//   llama_loss_mean(losses, rows, count, out)
//       out[0] = sum(losses) / count (f64 sum; 0 when count is 0). One warp.
// Row kernels: blocks of LLAMA_ROW_WARPS warps, one row per warp, two
// passes over the row (max, then sum of exponentials) before the write.

#include "llama_math.cuh"

#define LLAMA_FOR_EACH_ROW(ROWS)                                                              \
  const unsigned lane = threadIdx.x % LLAMA_LANES;                                           \
  const zero_u64 row_step = (zero_u64)gridDim.x * LLAMA_ROW_WARPS;                           \
  for (zero_u64 r = (zero_u64)blockIdx.x * LLAMA_ROW_WARPS + threadIdx.x / LLAMA_LANES;      \
       r < (ROWS); r += row_step)

// No __restrict__ on s/p and dp/ds: they may be the same buffer.
template <class E>
__device__ __forceinline__ void llama_softmax_fwd(const typename E::T* s, typename E::T* p,
                                                  zero_u64 mats, zero_u64 t) {
  LLAMA_FOR_EACH_ROW(mats * t) {
    const zero_u64 valid = r % t + 1;
    const typename E::T* row = s + r * t;
    const float m = llama_warp_reduce<LlamaMax>(llama_softmax_max_lane<E>(row, valid, lane));
    const double sum = llama_warp_reduce<LlamaSum>(llama_softmax_sum_lane<E>(row, valid, lane, m));
    llama_softmax_write<E>(row, p + r * t, t, valid, lane, m, sum);
  }
}

template <class E>
__device__ __forceinline__ void llama_softmax_bwd(const typename E::T* __restrict__ p,
                                                  const typename E::T* dp, typename E::T* ds,
                                                  zero_u64 mats, zero_u64 t, float scale) {
  LLAMA_FOR_EACH_ROW(mats * t) {
    const zero_u64 valid = r % t + 1;
    const zero_u64 o = r * t;
    const float dot =
        (float)llama_warp_reduce<LlamaSum>(llama_softmax_bwd_lane<E>(p + o, dp + o, valid, lane));
    llama_softmax_bwd_write<E>(p + o, dp + o, ds + o, t, valid, lane, dot, scale);
  }
}

template <class E>
__device__ __forceinline__ void llama_cross_entropy(const typename E::T* __restrict__ logits,
                                                    const llama_i32* __restrict__ targets,
                                                    typename E::T* __restrict__ dlogits,
                                                    float* __restrict__ losses, zero_u64 rows,
                                                    zero_u64 vocab, float inv) {
  LLAMA_FOR_EACH_ROW(rows) {
    const typename E::T* row = logits + r * vocab;
    const float m = llama_warp_reduce<LlamaMax>(llama_softmax_max_lane<E>(row, vocab, lane));
    const double sum = llama_warp_reduce<LlamaSum>(llama_softmax_sum_lane<E>(row, vocab, lane, m));
    const float loss =
        llama_ce_write<E>(row, dlogits + r * vocab, vocab, targets[r], lane, m, sum, inv);
    if (lane == 0) {
      losses[r] = loss;
    }
  }
}

#define LLAMA_SOFTMAX_KERNELS(SUFFIX, E)                                                        \
  extern "C" __global__ void __launch_bounds__(LLAMA_ROW_WARPS* LLAMA_LANES)                    \
      llama_softmax_causal_fwd_##SUFFIX(const E::T* s, E::T* p, zero_u64 mats, zero_u64 t) {    \
    llama_softmax_fwd<E>(s, p, mats, t);                                                        \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_ROW_WARPS* LLAMA_LANES)                    \
      llama_softmax_causal_bwd_##SUFFIX(const E::T* __restrict__ p, const E::T* dp, E::T* ds,   \
                                        zero_u64 mats, zero_u64 t, float scale) {               \
    llama_softmax_bwd<E>(p, dp, ds, mats, t, scale);                                            \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_ROW_WARPS* LLAMA_LANES)                    \
      llama_cross_entropy_##SUFFIX(const E::T* __restrict__ logits,                             \
                                   const llama_i32* __restrict__ targets,                       \
                                   E::T* __restrict__ dlogits, float* __restrict__ losses,      \
                                   zero_u64 rows, zero_u64 vocab, float inv) {                  \
    llama_cross_entropy<E>(logits, targets, dlogits, losses, rows, vocab, inv);                 \
  }

LLAMA_SOFTMAX_KERNELS(f32, ZeroF32)
LLAMA_SOFTMAX_KERNELS(bf16, ZeroBF16)

// Launch with one warp.
extern "C" __global__ void __launch_bounds__(LLAMA_LANES)
    llama_loss_mean(const float* __restrict__ losses, zero_u64 rows, zero_u64 count,
                    float* __restrict__ out) {
  const unsigned lane = threadIdx.x % LLAMA_LANES;
  const double total = llama_warp_reduce<LlamaSum>(llama_loss_lane(losses, rows, lane));
  if (threadIdx.x == 0) {
    out[0] = llama_loss_mean(total, count);
  }
}
