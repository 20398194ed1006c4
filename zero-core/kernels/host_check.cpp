// zero: host driver for zero_math.cuh, used by
// zero-core/tests/kernels_on_host.rs to check the kernels' math bit for bit
// against the Rust reference on machines without a GPU.
//
// Build: c++ -O2 -ffp-contract=off -fno-fast-math -std=c++17 host_check.cpp
//
// Binary little-endian records on stdin, results on stdout:
//
//   host_check decode bf16|f16
//       in: u16[]                       out: u32[] (f32 bits)
//   host_check encode bf16|f16
//       in: u32[] (f32 bits)            out: u16[]
//   host_check adamw G M P              (G: f32|bf16|f16, M: f32|bf16,
//                                        P: none|f32|bf16|f16)
//       in, repeated to EOF: u32 threads, u32 offsets[5] (elements, for
//           master, grad, m, v, low), f32 consts[9] (ZeroAdamWConsts order),
//           u64 n, master f32[n], grad G[n], m M[n], v M[n], low P[n] (not
//           for none)
//       out, per record: master, m, v, low (not for none)
//   host_check sumsq G
//       in, repeated to EOF: u32 offset (elements), u64 n, x G[n]
//       out, per record: u64 nchunks, f64 chunk_sums[nchunks], f64 total
//   host_check pieces S D              (S, D: f32|bf16|f16)
//       in, repeated to EOF: u32 threads, u32 accumulate, u64 npieces,
//           npieces x (u64 src_at, u64 dst_at, u64 len) (elements, none
//           empty, at most ZERO_PIECES_MAX), u64 src_len, src S[src_len],
//           u64 dst_len, dst D[dst_len]
//       out, per record: dst D[dst_len]
//
// The AdamW records run zero_adamw_thread for thread 0 .. threads-1 of an
// emulated grid (each element belongs to one thread, so running them in
// turn gives the kernel's result); each array is placed `offset` elements
// past a 64-byte boundary, so both the vectorized and the scalar paths run.
// The sum of squares runs, per chunk and tile, zero_sumsq_stage for every
// thread of a block and zero_sumsq_lane_tile for the 16 lanes, the
// kernel's shuffle tree as zero_sumsq_tree16, and zero_sumsq_finish over
// the chunk sums. The pieces records build a ZeroPieces launch over the two
// arrays and run zero_pieces_thread for every thread of an emulated grid.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "host_io.hpp"
#include "zero_convert.cuh"
#include "zero_math.cuh"

namespace {

// `n` elements of `bytes` each, starting `offset` elements past a 64-byte
// boundary.
struct Placed {
  std::vector<unsigned char> storage;
  unsigned char* at = nullptr;
  size_t bytes = 0;
  Placed(size_t n, size_t elem, size_t offset) {
    storage.resize((n + offset) * elem + 64);
    uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
    uintptr_t aligned = (base + 63) & ~static_cast<uintptr_t>(63);
    at = storage.data() + (aligned - base) + offset * elem;
    bytes = n * elem;
  }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(at);
  }
};

// Calls f with a default-constructed element type named `name`.
template <class F>
void with_elem(const std::string& name, F f) {
  if (name == "f32") {
    f(ZeroF32());
  } else if (name == "bf16") {
    f(ZeroBF16());
  } else if (name == "f16") {
    f(ZeroF16());
  } else {
    fail("unknown element type " + name);
  }
}

// with_elem, or ZeroNone for "none" (the low-precision copy).
template <class F>
void with_copy(const std::string& name, F f) {
  if (name == "none") {
    f(ZeroNone());
  } else {
    with_elem(name, f);
  }
}

template <class G, class M, class P>
void run_adamw(Reader& in, bool has_low) {
  while (!in.done()) {
    const uint32_t threads = in.get<uint32_t>();
    uint32_t off[5];
    in.take(off, sizeof off);
    ZeroAdamWConsts k;
    in.take(&k, sizeof k);
    const uint64_t n = in.get<uint64_t>();
    if (threads == 0) fail("0 threads");
    Placed master(n, sizeof(float), off[0]);
    Placed grad(n, sizeof(typename G::T), off[1]);
    Placed m(n, sizeof(typename M::T), off[2]);
    Placed v(n, sizeof(typename M::T), off[3]);
    Placed low(has_low ? n : 0, sizeof(typename P::T), off[4]);
    in.take(master.at, master.bytes);
    in.take(grad.at, grad.bytes);
    in.take(m.at, m.bytes);
    in.take(v.at, v.bytes);
    in.take(low.at, low.bytes);
    typename P::T* low_ptr = has_low ? low.as<typename P::T>() : nullptr;
    for (uint64_t tid = 0; tid < threads; ++tid) {
      zero_adamw_thread<G, M, P>(k, master.as<float>(), grad.as<typename G::T>(),
                                 m.as<typename M::T>(), v.as<typename M::T>(), low_ptr, n, tid,
                                 threads);
    }
    write_out(master.at, master.bytes);
    write_out(m.at, m.bytes);
    write_out(v.at, v.bytes);
    write_out(low.at, low.bytes);
  }
}

template <class G>
void run_sumsq(Reader& in) {
  const zero_u64 tile_elems = ZERO_NORM_TILE_ROWS * ZERO_NORM_LANES;
  std::vector<float> tile(tile_elems);
  while (!in.done()) {
    const uint32_t offset = in.get<uint32_t>();
    const uint64_t n = in.get<uint64_t>();
    Placed x(n, sizeof(typename G::T), offset);
    in.take(x.at, x.bytes);
    const typename G::T* xs = x.as<typename G::T>();
    const uint64_t nchunks = (n + ZERO_NORM_CHUNK - 1) / ZERO_NORM_CHUNK;
    std::vector<double> sums(nchunks);
    for (uint64_t c = 0; c < nchunks; ++c) {
      // One block of ZERO_NORM_BLOCK threads, as zero_sumsq_chunks in
      // norm.cu: stage each tile with every thread, add it with 16 lanes.
      const zero_u64 start = c * ZERO_NORM_CHUNK;
      const zero_u64 len = n - start < ZERO_NORM_CHUNK ? n - start : ZERO_NORM_CHUNK;
      double lanes[16] = {0.0};
      for (zero_u64 t = 0; t < len; t += tile_elems) {
        const zero_u64 count = len - t < tile_elems ? len - t : tile_elems;
        for (zero_u64 tid = 0; tid < ZERO_NORM_BLOCK; ++tid) {
          zero_sumsq_stage<G>(xs + start + t, count, tile.data(), tid, ZERO_NORM_BLOCK);
        }
        for (unsigned j = 0; j < 16; ++j) {
          lanes[j] = zero_sumsq_lane_tile(tile.data(), count, j, lanes[j]);
        }
      }
      sums[c] = zero_sumsq_tree16(lanes);
    }
    const double total = zero_sumsq_finish(sums.data(), nchunks);
    write_out(&nchunks, sizeof nchunks);
    write_out(sums.data(), sums.size() * sizeof(double));
    write_out(&total, sizeof total);
  }
}

template <class S, class D>
void run_pieces(Reader& in) {
  while (!in.done()) {
    const uint32_t threads = in.get<uint32_t>();
    const uint32_t accumulate = in.get<uint32_t>();
    const uint64_t count = in.get<uint64_t>();
    if (threads == 0) fail("0 threads");
    if (count > ZERO_PIECES_MAX) fail("more than ZERO_PIECES_MAX pieces");
    std::vector<uint64_t> desc = in.vec<uint64_t>(count * 3);
    const uint64_t src_len = in.get<uint64_t>();
    std::vector<typename S::T> src = in.vec<typename S::T>(src_len);
    const uint64_t dst_len = in.get<uint64_t>();
    std::vector<typename D::T> dst = in.vec<typename D::T>(dst_len);
    ZeroPieces ps;
    memset(&ps, 0, sizeof ps);
    ps.count = count;
    for (uint64_t p = 0; p < count; ++p) {
      const uint64_t src_at = desc[3 * p], dst_at = desc[3 * p + 1], len = desc[3 * p + 2];
      if (len == 0 || src_at > src_len || len > src_len - src_at || dst_at > dst_len ||
          len > dst_len - dst_at) {
        fail("piece out of range or empty");
      }
      ps.piece[p].src = reinterpret_cast<uintptr_t>(src.data() + src_at);
      ps.piece[p].dst = reinterpret_cast<uintptr_t>(dst.data() + dst_at);
      ps.piece[p].start = ps.total;
      ps.piece[p].len = len;
      ps.total += len;
    }
    for (uint64_t tid = 0; tid < threads; ++tid) {
      zero_pieces_thread<S, D>(ps, accumulate != 0, tid, threads);
    }
    write_out(dst.data(), dst.size() * sizeof(typename D::T));
  }
}

}  // namespace

int main(int argc, char** argv) {
  static_assert(sizeof(ZeroAdamWConsts) == 9 * sizeof(float), "ZeroAdamWConsts has padding");
  if (argc < 3) fail("usage: host_check decode|encode|adamw|sumsq|pieces TYPE...");
  const std::string mode = argv[1];
  Reader in = read_stdin();
  if (mode == "decode" || mode == "encode") {
    const std::string t = argv[2];
    if (t != "bf16" && t != "f16") fail("unknown type " + t);
    const bool bf = t == "bf16";
    if (mode == "decode") {
      while (!in.done()) {
        const zero_u16 h = in.get<zero_u16>();
        const zero_u32 bits = zero_f2u(bf ? zero_bf16_to_f32(h) : zero_f16_to_f32(h));
        write_out(&bits, sizeof bits);
      }
    } else {
      while (!in.done()) {
        const float f = zero_u2f(in.get<zero_u32>());
        const zero_u16 h = bf ? zero_f32_to_bf16(f) : zero_f32_to_f16(f);
        write_out(&h, sizeof h);
      }
    }
  } else if (mode == "adamw") {
    if (argc != 5) fail("usage: host_check adamw G M P");
    const std::string p = argv[4];
    with_elem(argv[2], [&](auto g) {
      with_elem(argv[3], [&](auto m) {
        with_copy(p, [&](auto l) {
          run_adamw<decltype(g), decltype(m), decltype(l)>(in, p != "none");
        });
      });
    });
  } else if (mode == "pieces") {
    if (argc != 4) fail("usage: host_check pieces S D");
    with_elem(argv[2], [&](auto src) {
      with_elem(argv[3], [&](auto dst) { run_pieces<decltype(src), decltype(dst)>(in); });
    });
  } else if (mode == "sumsq") {
    with_elem(argv[2], [&](auto g) { run_sumsq<decltype(g)>(in); });
  } else {
    fail("unknown mode " + mode);
  }
  if (fflush(stdout) != 0) fail("cannot write stdout");
  return 0;
}
