// zero: the sum of squares of a gradient on the GPU, bit-identical to
// zero_core::optim::sum_squares (compiled at run time by NVRTC, see
// adamw.cu for the options).
//
// The reference fixes the order of every f64 addition: chunks of 65536
// elements; in a chunk 16 lanes, lane j adding x[i]^2 for i = j (mod 16) in
// increasing i from 0.0; the lanes combined by the pairwise tree
// 16 -> 8 -> 4 -> 2 -> 1; the chunk sums added in chunk order from 0.0.
// f64 addition is not associative, so each lane is one dependent chain of
// 4096 additions and a chunk offers only 16 of them. What is left to design
// is how to keep enough bytes in flight to feed so few chains:
//
// - A block of ZERO_NORM_BLOCK threads takes one chunk at a time
//   (grid-stride over chunks). All its threads stage a tile of
//   ZERO_NORM_TILE_ROWS rows (8192 elements, widened to f32 in shared
//   memory) with 16-byte (f32) or 8-byte (bf16/f16) loads, several in
//   flight per thread; then threads 0..15 each continue their lane over the
//   tile (conflict-free: the 16 lanes of a row are 16 consecutive words).
//   Loading with the whole block and adding with 16 threads lets a chunk
//   stream at memory speed even when there are only a few chunks per SM
//   (a shard of a few million elements), where per-lane threads reading
//   their own elements would leave most of the bandwidth unused. With many
//   chunks, several blocks per SM (32 KiB of shared memory each) overlap
//   one block's additions with the others' loads.
// - After the last tile the 16 lane threads combine their sums with four
//   shuffles at distance 1, 2, 4, 8: exactly the reference's pairwise tree
//   (zero_sumsq_tree16 on the host).
// - The chunk sums go to a scratch array; `sumsq_finish`, one thread, adds
//   them in order: n / 65536 dependent additions (15 259 for 10^9
//   elements, a few microseconds); atomics could not give a fixed order.
//   The result stays on the device, so a caller copies 8 bytes only when
//   it needs the value.
//
// zero-core/tests/kernels_on_host.rs runs the same staging, lane and tree
// functions (zero_math.cuh) on the host against the reference.

#include "zero_math.cuh"

template <class G>
__device__ __forceinline__ void zero_sumsq_chunks(const typename G::T* __restrict__ x,
                                                  zero_u64 n, double* __restrict__ chunk_sums) {
  __shared__ alignas(16) float tile[ZERO_NORM_TILE_ROWS * ZERO_NORM_LANES];
  const zero_u64 tile_elems = ZERO_NORM_TILE_ROWS * ZERO_NORM_LANES;
  const zero_u64 nchunks = (n + ZERO_NORM_CHUNK - 1) / ZERO_NORM_CHUNK;
  const unsigned tid = threadIdx.x;
  for (zero_u64 chunk = blockIdx.x; chunk < nchunks; chunk += gridDim.x) {
    const zero_u64 start = chunk * ZERO_NORM_CHUNK;
    const zero_u64 len = n - start < ZERO_NORM_CHUNK ? n - start : ZERO_NORM_CHUNK;
    double acc = 0.0;
    for (zero_u64 t = 0; t < len; t += tile_elems) {
      const zero_u64 count = len - t < tile_elems ? len - t : tile_elems;
      __syncthreads();  // the lanes are done with the previous tile
      zero_sumsq_stage<G>(x + start + t, count, tile, tid, blockDim.x);
      __syncthreads();  // the tile is complete
      if (tid < ZERO_NORM_LANES) {
        acc = zero_sumsq_lane_tile(tile, count, tid, acc);
      }
    }
    if (tid < ZERO_NORM_LANES) {
      // The pairwise tree: lane j (a multiple of 2s) adds lane j+s.
      for (unsigned s = 1; s < ZERO_NORM_LANES; s *= 2) {
        acc = zero_dadd(acc, __shfl_down_sync(0x0000FFFFu, acc, s, 16));
      }
      if (tid == 0) {
        chunk_sums[chunk] = acc;
      }
    }
  }
}

// Per-chunk sums: chunk_sums[c] = sum_squares_chunk(x[c*65536 ..]) for every
// chunk c < ceil(n / 65536). Launch with ZERO_NORM_BLOCK threads per block.
extern "C" __global__ void __launch_bounds__(ZERO_NORM_BLOCK)
    sumsq_chunks_f32(const float* __restrict__ x, zero_u64 n, double* __restrict__ chunk_sums) {
  zero_sumsq_chunks<ZeroF32>(x, n, chunk_sums);
}

extern "C" __global__ void __launch_bounds__(ZERO_NORM_BLOCK)
    sumsq_chunks_bf16(const zero_u16* __restrict__ x, zero_u64 n,
                      double* __restrict__ chunk_sums) {
  zero_sumsq_chunks<ZeroBF16>(x, n, chunk_sums);
}

extern "C" __global__ void __launch_bounds__(ZERO_NORM_BLOCK)
    sumsq_chunks_f16(const zero_u16* __restrict__ x, zero_u64 n,
                     double* __restrict__ chunk_sums) {
  zero_sumsq_chunks<ZeroF16>(x, n, chunk_sums);
}

// out[0] = the chunk sums added in chunk order from 0.0. Launch with one
// thread.
extern "C" __global__ void sumsq_finish(const double* __restrict__ chunk_sums, zero_u64 nchunks,
                                        double* __restrict__ out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    out[0] = zero_sumsq_finish(chunk_sums, nchunks);
  }
}
