// zero llama example: the elementwise kernels of the model on the GPU,
// embedding, SwiGLU and RoPE, forward and backward (compiled at run time by
// NVRTC; the per-element math is in llama_math.cuh).
//
// Entry points, E in {f32, bf16} (bf16 as raw bits); every kernel is one
// grid-stride loop, blocks of LLAMA_EW_BLOCK threads:
//   llama_embedding_fwd_E(table, tokens, out, rows, dim, vocab)
//       out[r, :] = table[tokens[r], :] (NaN for a token >= vocab).
//   llama_embedding_bwd_E(dout, order, seg_start, seg_token, dtable, nseg, dim)
//       dtable (f32) += the rows of dout grouped by token: one thread per
//       (token present, column) adds that token's rows in increasing row
//       order, as the CPU does. The grouping (a stable sort of the row
//       indices by token) is built on the host from the batch's tokens.
//   llama_swiglu_fwd_E(h1, h3, a, n)           a = silu(h1) * h3
//   llama_swiglu_bwd_E(da, h1, h3, dh1, dh3, n)
//   llama_dropout_E(x, bits, keep, out, n, acc)  out (+)= x * (bit i ? keep : 0)
//   llama_rope_E(x, cos, sin, rows, seq, heads, half, inverse)
//       in place on [rows, heads * 2 * half]; inverse = 1 for the backward.

#include "llama_math.cuh"

#define LLAMA_GRID_STRIDE(I, N)                                                                \
  for (zero_u64 I = (zero_u64)blockIdx.x * blockDim.x + threadIdx.x; I < (N);                 \
       I += (zero_u64)gridDim.x * blockDim.x)

#define LLAMA_EW_KERNELS(SUFFIX, E)                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK)                                  \
      llama_embedding_fwd_##SUFFIX(const E::T* __restrict__ table,                              \
                                   const zero_u32* __restrict__ tokens, E::T* __restrict__ out, \
                                   zero_u64 rows, zero_u64 dim, zero_u64 vocab) {               \
    LLAMA_GRID_STRIDE(e, rows* dim) {                                                           \
      llama_embed_fwd_elem<E>(table, tokens, out, dim, vocab, e);                               \
    }                                                                                           \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK) llama_embedding_bwd_##SUFFIX(    \
      const E::T* __restrict__ dout, const zero_u32* __restrict__ order,                        \
      const zero_u32* __restrict__ seg_start, const zero_u32* __restrict__ seg_token,           \
      float* __restrict__ dtable, zero_u64 nseg, zero_u64 dim) {                                \
    LLAMA_GRID_STRIDE(e, nseg* dim) {                                                           \
      llama_embed_bwd_elem<E>(dout, order, seg_start, seg_token, dtable, dim, e);               \
    }                                                                                           \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK)                                  \
      llama_swiglu_fwd_##SUFFIX(const E::T* __restrict__ h1, const E::T* __restrict__ h3,       \
                                E::T* __restrict__ a, zero_u64 n) {                             \
    LLAMA_GRID_STRIDE(i, n) { llama_swiglu_fwd_elem<E>(h1, h3, a, i); }                         \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK)                                  \
      llama_swiglu_bwd_##SUFFIX(const E::T* __restrict__ da, const E::T* __restrict__ h1,       \
                                const E::T* __restrict__ h3, E::T* __restrict__ dh1,            \
                                E::T* __restrict__ dh3, zero_u64 n) {                           \
    LLAMA_GRID_STRIDE(i, n) { llama_swiglu_bwd_elem<E>(da, h1, h3, dh1, dh3, i); }              \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK)                                  \
      llama_dropout_##SUFFIX(const E::T* __restrict__ x, const zero_u32* __restrict__ bits,     \
                             float keep, E::T* __restrict__ out, zero_u64 n, int acc) {         \
    LLAMA_GRID_STRIDE(i, n) { llama_dropout_elem<E>(x, bits, keep, out, acc, i); }              \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(LLAMA_EW_BLOCK)                                  \
      llama_rope_##SUFFIX(E::T* __restrict__ x, const float* __restrict__ cos_t,                \
                          const float* __restrict__ sin_t, zero_u64 rows, zero_u64 seq,         \
                          zero_u64 heads, zero_u64 half, int inverse) {                         \
    LLAMA_GRID_STRIDE(p, rows* heads* half) {                                                   \
      llama_rope_pair<E>(x, cos_t, sin_t, seq, heads, half, inverse, p);                        \
    }                                                                                           \
  }

LLAMA_EW_KERNELS(f32, ZeroF32)
LLAMA_EW_KERNELS(bf16, ZeroBF16)
