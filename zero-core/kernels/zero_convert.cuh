// zero: per-element conversion between f32, bf16 and f16 over many element
// ranges at once, shared by the CUDA kernels of convert.cu and the host
// check (zero-core/tests/kernels_on_host.rs). Compiles the three ways
// zero_math.cuh does (NVRTC, nvcc, plain host C++17).
//
// One launch moves up to ZERO_PIECES_MAX ranges ("pieces"): the CUDA
// backend's cast (one piece), bucket pack (many sources, one bucket) and
// unpack (one bucket, many destinations) are all this. Element i of piece
// p is `dst[i] = D(f32(src[i]))`, or with accumulate
// `dst[i] = D(f32(dst[i]) + f32(src[i]))` (one IEEE f32 addition, rounded
// to nearest), exactly zero_core::convert; the same type without
// accumulate copies the bits (a NaN payload included), as convert's byte
// copy does.

#ifndef ZERO_CONVERT_CUH
#define ZERO_CONVERT_CUH

#include "zero_math.cuh"

// Threads per block of the conversion kernels (zero-core/src/cuda/kernels.rs
// launches with the same number).
#define ZERO_CONVERT_BLOCK 256
// Pieces per launch: the descriptor array is a kernel parameter, and 16 +
// 96 * 32 bytes stays under the 4 KiB every driver accepts.
#define ZERO_PIECES_MAX 96

// One range: `len` elements from address `src` to address `dst` (each the
// range's first element). `start` is the sum of the lengths of the pieces
// before it: the range covers elements [start, start + len) of the launch.
struct ZeroPiece {
  zero_u64 src;
  zero_u64 dst;
  zero_u64 start;
  zero_u64 len;
};

// The pieces of one launch, in order of `start`, none empty; `total` is
// the sum of their lengths.
struct ZeroPieces {
  zero_u64 count;
  zero_u64 total;
  ZeroPiece piece[ZERO_PIECES_MAX];
};

#if defined(__CUDA_ARCH__)
ZERO_HD float zero_fadd(float a, float b) { return __fadd_rn(a, b); }
#else
ZERO_HD float zero_fadd(float a, float b) { return a + b; }
#endif

// Element i of a piece without accumulation: through f32 between types,
// the bits within one type.
template <class S, class D>
struct ZeroConvert {
  static ZERO_HD void copy(const typename S::T* s, typename D::T* d, zero_u64 i) {
    D::store(d, i, S::load(s, i));
  }
};
template <class T>
struct ZeroConvert<T, T> {
  static ZERO_HD void copy(const typename T::T* s, typename T::T* d, zero_u64 i) { d[i] = s[i]; }
};

// The index of the piece holding launch element i, searching from `from`
// (a piece whose start is at most i).
ZERO_HD zero_u64 zero_piece_of(const ZeroPieces& ps, zero_u64 from, zero_u64 i) {
  zero_u64 lo = from;
  zero_u64 hi = ps.count;
  // start[lo] <= i < start[hi] (start[count] standing for total).
  while (hi - lo > 1) {
    const zero_u64 mid = lo + (hi - lo) / 2;
    if (ps.piece[mid].start <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One thread's share of a launch: launch elements tid, tid + nthreads, ...
// (consecutive threads on consecutive elements of a piece). The thread's
// elements only grow, so each search starts at the previous piece.
template <class S, class D>
ZERO_HD void zero_pieces_thread(const ZeroPieces& ps, bool accumulate, zero_u64 tid,
                                zero_u64 nthreads) {
  zero_u64 p = 0;
  for (zero_u64 i = tid; i < ps.total; i += nthreads) {
    p = zero_piece_of(ps, p, i);
    const ZeroPiece& q = ps.piece[p];
    const zero_u64 j = i - q.start;
    const typename S::T* s = (const typename S::T*)q.src;
    typename D::T* d = (typename D::T*)q.dst;
    if (accumulate) {
      D::store(d, j, zero_fadd(D::load(d, j), S::load(s, j)));
    } else {
      ZeroConvert<S, D>::copy(s, d, j);
    }
  }
}

#endif  // ZERO_CONVERT_CUH
