// zero llama example: RMSNorm forward and backward on the GPU (compiled at
// run time by NVRTC; the per-lane math is in llama_math.cuh).
//
// Entry points, E in {f32, bf16} (activations and the norm weight; bf16 as
// raw bits), f32 inverse RMS and weight gradient:
//   llama_rmsnorm_fwd_E(x, w, y, inv, rows, d, eps)
//   llama_rmsnorm_bwd_E(dy, x, w, inv, dx, rows, d, accumulate)
//   llama_rmsnorm_dw_partial_E(dy, x, inv, partial, rows, d)
//   llama_colsum_finish(partial, nchunks, d, dw)
// Row kernels: blocks of LLAMA_ROW_WARPS warps, one row per warp
// (grid-stride over rows). The weight gradient is two launches: per chunk
// of LLAMA_COL_CHUNK rows and column a partial sum, then dw[j] += the
// partials in chunk order (deterministic, no atomics).

#include "llama_math.cuh"

__device__ __forceinline__ zero_u64 llama_tid() {
  return (zero_u64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ zero_u64 llama_nthreads() { return (zero_u64)gridDim.x * blockDim.x; }

template <class E>
__device__ __forceinline__ void llama_rmsnorm_fwd(const typename E::T* __restrict__ x,
                                                  const typename E::T* __restrict__ w,
                                                  typename E::T* __restrict__ y,
                                                  float* __restrict__ inv, zero_u64 rows,
                                                  zero_u64 d, float eps) {
  const unsigned lane = threadIdx.x % LLAMA_LANES;
  const zero_u64 step = (zero_u64)gridDim.x * LLAMA_ROW_WARPS;
  for (zero_u64 r = (zero_u64)blockIdx.x * LLAMA_ROW_WARPS + threadIdx.x / LLAMA_LANES; r < rows;
       r += step) {
    const double ss = llama_warp_reduce<LlamaSum>(llama_rms_fwd_lane<E>(x + r * d, d, lane));
    const float s = llama_rms_inv(ss, d, eps);
    llama_rms_fwd_write<E>(x + r * d, w, y + r * d, d, lane, s);
    if (lane == 0) {
      inv[r] = s;
    }
  }
}

template <class E>
__device__ __forceinline__ void llama_rmsnorm_bwd(const typename E::T* __restrict__ dy,
                                                  const typename E::T* __restrict__ x,
                                                  const typename E::T* __restrict__ w,
                                                  const float* __restrict__ inv,
                                                  typename E::T* __restrict__ dx, zero_u64 rows,
                                                  zero_u64 d, int accumulate) {
  const unsigned lane = threadIdx.x % LLAMA_LANES;
  const zero_u64 step = (zero_u64)gridDim.x * LLAMA_ROW_WARPS;
  for (zero_u64 r = (zero_u64)blockIdx.x * LLAMA_ROW_WARPS + threadIdx.x / LLAMA_LANES; r < rows;
       r += step) {
    const zero_u64 o = r * d;
    const double dot = llama_warp_reduce<LlamaSum>(llama_rms_bwd_lane<E>(dy + o, x + o, w, d, lane));
    llama_rms_bwd_write<E>(dy + o, x + o, w, dx + o, d, lane, inv[r], dot, accumulate);
  }
}

#define LLAMA_NORM_KERNELS(SUFFIX, E)                                                            \
  extern "C" __global__ void __launch_bounds__(LLAMA_ROW_WARPS* LLAMA_LANES)                     \
      llama_rmsnorm_fwd_##SUFFIX(const E::T* __restrict__ x, const E::T* __restrict__ w,          \
                                 E::T* __restrict__ y, float* __restrict__ inv, zero_u64 rows,   \
                                 zero_u64 d, float eps) {                                        \
    llama_rmsnorm_fwd<E>(x, w, y, inv, rows, d, eps);                                            \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(LLAMA_ROW_WARPS* LLAMA_LANES)                     \
      llama_rmsnorm_bwd_##SUFFIX(const E::T* __restrict__ dy, const E::T* __restrict__ x,         \
                                 const E::T* __restrict__ w, const float* __restrict__ inv,      \
                                 E::T* __restrict__ dx, zero_u64 rows, zero_u64 d,               \
                                 int accumulate) {                                               \
    llama_rmsnorm_bwd<E>(dy, x, w, inv, dx, rows, d, accumulate);                                \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK)                                   \
      llama_rmsnorm_dw_partial_##SUFFIX(const E::T* __restrict__ dy, const E::T* __restrict__ x, \
                                        const float* __restrict__ inv,                           \
                                        float* __restrict__ partial, zero_u64 rows,              \
                                        zero_u64 d) {                                            \
    const zero_u64 n = (rows + LLAMA_COL_CHUNK - 1) / LLAMA_COL_CHUNK * d;                       \
    for (zero_u64 e = llama_tid(); e < n; e += llama_nthreads()) {                               \
      llama_rms_dw_partial_elem<E>(dy, x, inv, partial, rows, d, e);                             \
    }                                                                                            \
  }

LLAMA_NORM_KERNELS(f32, ZeroF32)
LLAMA_NORM_KERNELS(bf16, ZeroBF16)

extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK)
    llama_colsum_finish(const float* __restrict__ partial, zero_u64 nchunks, zero_u64 d,
                        float* __restrict__ out) {
  for (zero_u64 j = llama_tid(); j < d; j += llama_nthreads()) {
    llama_colsum_finish_elem(partial, nchunks, d, out, j);
  }
}
