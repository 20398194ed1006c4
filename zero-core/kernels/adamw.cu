// zero: the fused AdamW step on the GPU, compiled at run time by NVRTC
// (zero-core/src/cuda/kernels.rs, options `--fmad=false` and IEEE division,
// square root and denormals; the math uses explicit `_rn` intrinsics anyway).
//
// One kernel per type combination, named
//   adamw_g{grad}_m{moments}_p{copy}
// with grad in {f32, bf16, f16}, moments in {f32, bf16} and the
// low-precision copy of the updated parameter in {none, f32, bf16, f16}.
// Arguments: the step constants (ZeroAdamWConsts, by value), then the
// pointers master (f32, in place), grad, m, v (in place), low (absent for
// `pnone`), and the element count n. Each is one grid-stride loop over n
// (zero_adamw_thread in zero_math.cuh), bit-identical to
// zero_core::optim::adamw_reference; 16-bit elements are passed as raw bits.
//
// The step reads 4 streams and writes 3 or 4, so it is bound by memory
// bandwidth: the loads and stores are vectorized (16 bytes per f32 access,
// 8 bytes per bf16/f16 access, four elements per thread and iteration)
// whenever every pointer is aligned for it, which holds for the arena's
// buffers; the grid is sized by the launcher to fill the GPU once, so each
// thread keeps several groups in flight through its loop.

#include "zero_math.cuh"

__device__ __forceinline__ zero_u64 zero_thread_index() {
  return (zero_u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ zero_u64 zero_thread_count() {
  return (zero_u64)gridDim.x * blockDim.x;
}

#define ZERO_ADAMW_WITH_COPY(NAME, G, M, P)                                                   \
  extern "C" __global__ void __launch_bounds__(ZERO_ADAMW_BLOCK)                              \
      NAME(ZeroAdamWConsts k, float* __restrict__ master, const G::T* __restrict__ grad,      \
           M::T* __restrict__ m, M::T* __restrict__ v, P::T* __restrict__ low, zero_u64 n) {  \
    zero_adamw_thread<G, M, P>(k, master, grad, m, v, low, n, zero_thread_index(),            \
                               zero_thread_count());                                          \
  }

#define ZERO_ADAMW_NO_COPY(NAME, G, M)                                                        \
  extern "C" __global__ void __launch_bounds__(ZERO_ADAMW_BLOCK)                              \
      NAME(ZeroAdamWConsts k, float* __restrict__ master, const G::T* __restrict__ grad,      \
           M::T* __restrict__ m, M::T* __restrict__ v, zero_u64 n) {                          \
    zero_adamw_thread<G, M, ZeroNone>(k, master, grad, m, v, (ZeroNone::T*)0, n,              \
                                      zero_thread_index(), zero_thread_count());              \
  }

// Gradients f32.
ZERO_ADAMW_NO_COPY(adamw_gf32_mf32_pnone, ZeroF32, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gf32_mf32_pf32, ZeroF32, ZeroF32, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gf32_mf32_pbf16, ZeroF32, ZeroF32, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gf32_mf32_pf16, ZeroF32, ZeroF32, ZeroF16)
ZERO_ADAMW_NO_COPY(adamw_gf32_mbf16_pnone, ZeroF32, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gf32_mbf16_pf32, ZeroF32, ZeroBF16, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gf32_mbf16_pbf16, ZeroF32, ZeroBF16, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gf32_mbf16_pf16, ZeroF32, ZeroBF16, ZeroF16)

// Gradients bf16.
ZERO_ADAMW_NO_COPY(adamw_gbf16_mf32_pnone, ZeroBF16, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gbf16_mf32_pf32, ZeroBF16, ZeroF32, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gbf16_mf32_pbf16, ZeroBF16, ZeroF32, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gbf16_mf32_pf16, ZeroBF16, ZeroF32, ZeroF16)
ZERO_ADAMW_NO_COPY(adamw_gbf16_mbf16_pnone, ZeroBF16, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gbf16_mbf16_pf32, ZeroBF16, ZeroBF16, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gbf16_mbf16_pbf16, ZeroBF16, ZeroBF16, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gbf16_mbf16_pf16, ZeroBF16, ZeroBF16, ZeroF16)

// Gradients f16.
ZERO_ADAMW_NO_COPY(adamw_gf16_mf32_pnone, ZeroF16, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gf16_mf32_pf32, ZeroF16, ZeroF32, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gf16_mf32_pbf16, ZeroF16, ZeroF32, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gf16_mf32_pf16, ZeroF16, ZeroF32, ZeroF16)
ZERO_ADAMW_NO_COPY(adamw_gf16_mbf16_pnone, ZeroF16, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gf16_mbf16_pf32, ZeroF16, ZeroBF16, ZeroF32)
ZERO_ADAMW_WITH_COPY(adamw_gf16_mbf16_pbf16, ZeroF16, ZeroBF16, ZeroBF16)
ZERO_ADAMW_WITH_COPY(adamw_gf16_mbf16_pf16, ZeroF16, ZeroBF16, ZeroF16)
