// zero llama example: host driver for llama_math.cuh, used by
// examples/llama/tests/kernels_on_host.rs to check the GPU kernels' math
// against the CPU ops of examples/llama/src/ops.rs on machines without a GPU.
//
// Build: c++ -O2 -ffp-contract=off -fno-fast-math -std=c++17
//        -I zero-core/kernels -I examples/llama/cuda host_check.cpp
//
// `host_check OP E` with E in f32|bf16 (bf16 as u16 bits) reads one record
// of little-endian values from stdin and writes the results to stdout:
//
//   rmsnorm_fwd   in: u64 rows, d; f32 eps; x E[rows*d], w E[d]
//                 out: y E[rows*d], inv f32[rows]
//   rmsnorm_bwd   in: u64 rows, d; u32 accumulate; dy E, x E, w E, inv f32[rows],
//                     dx E[rows*d], dw f32[d]
//                 out: dx, dw (dw += the column sums, chunked as on the GPU)
//   softmax_fwd   in: u64 mats, t; s E[mats*t*t]     out: p E (computed in place)
//   softmax_bwd   in: u64 mats, t; f32 scale; p E, dp E    out: ds E (in place)
//   cross_entropy in: u64 rows, vocab, count; f32 inv; targets i32[rows],
//                     logits E[rows*vocab]
//                 out: dlogits E, losses f32[rows], mean f32
//   embedding_fwd in: u64 rows, dim, vocab; tokens u32[rows], table E  out: E[rows*dim]
//   embedding_bwd in: u64 rows, dim, vocab, nseg, norder (<= rows: the
//                     padding token's rows are not in the plan); order u32[norder],
//                     seg_start u32[nseg+1], seg_token u32[nseg], dout E,
//                     dtable f32[vocab*dim]
//                 out: dtable
//   swiglu_fwd    in: u64 n; h1 E, h3 E                  out: a E
//   swiglu_bwd    in: u64 n; da E, h1 E, h3 E             out: dh1 E, dh3 E
//   rope          in: u64 rows, seq, heads, half, max_seq; u32 inverse;
//                     cos f32[max_seq*half], sin f32, x E[rows*heads*2*half]
//                 out: x
//
// Each op is an emulated launch: the row kernels run phase 1 for the 32
// lanes of a row, the butterfly (llama_butterfly, the device's shuffles)
// and phase 3 for the 32 lanes, row after row; the elementwise and column
// kernels run their per-thread body for every thread index. The ones that
// work in place on the GPU work in place here too.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "host_io.hpp"
#include "llama_math.cuh"

namespace {

template <class T>
void put(const std::vector<T>& v) {
  write_out(v.data(), v.size() * sizeof(T));
}

template <class T>
void put1(T x) {
  put(std::vector<T>{x});
}

// Phase 1 for all lanes, then the butterfly: the value every lane holds.
template <class Op, class V, class F>
V row_reduce(F lane_value) {
  V lanes[LLAMA_LANES];
  for (unsigned l = 0; l < LLAMA_LANES; ++l) lanes[l] = lane_value(l);
  llama_butterfly<Op>(lanes);
  for (unsigned l = 1; l < LLAMA_LANES; ++l) {
    if (memcmp(&lanes[l], &lanes[0], sizeof(V)) != 0) fail("lanes disagree after the butterfly");
  }
  return lanes[0];
}

template <class E>
void rmsnorm_fwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t rows = in.get<uint64_t>(), d = in.get<uint64_t>();
  const float eps = in.get<float>();
  const std::vector<T> x = in.vec<T>(rows * d), w = in.vec<T>(d);
  in.finish();
  std::vector<T> y(rows * d);
  std::vector<float> inv(rows);
  for (uint64_t r = 0; r < rows; ++r) {
    const T* xr = x.data() + r * d;
    const double ss =
        row_reduce<LlamaSum, double>([&](unsigned l) { return llama_rms_fwd_lane<E>(xr, d, l); });
    const float s = llama_rms_inv(ss, d, eps);
    for (unsigned l = 0; l < LLAMA_LANES; ++l) {
      llama_rms_fwd_write<E>(xr, w.data(), y.data() + r * d, d, l, s);
    }
    inv[r] = s;
  }
  put(y);
  put(inv);
}

template <class E>
void rmsnorm_bwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t rows = in.get<uint64_t>(), d = in.get<uint64_t>();
  const int accumulate = (int)in.get<uint32_t>();
  const std::vector<T> dy = in.vec<T>(rows * d), x = in.vec<T>(rows * d), w = in.vec<T>(d);
  const std::vector<float> inv = in.vec<float>(rows);
  std::vector<T> dx = in.vec<T>(rows * d);
  std::vector<float> dw = in.vec<float>(d);
  in.finish();
  for (uint64_t r = 0; r < rows; ++r) {
    const uint64_t o = r * d;
    const double dot = row_reduce<LlamaSum, double>(
        [&](unsigned l) { return llama_rms_bwd_lane<E>(dy.data() + o, x.data() + o, w.data(), d, l); });
    for (unsigned l = 0; l < LLAMA_LANES; ++l) {
      llama_rms_bwd_write<E>(dy.data() + o, x.data() + o, w.data(), dx.data() + o, d, l, inv[r],
                             dot, accumulate);
    }
  }
  const uint64_t nchunks = (rows + LLAMA_COL_CHUNK - 1) / LLAMA_COL_CHUNK;
  std::vector<float> partial(nchunks * d);
  for (uint64_t e = 0; e < nchunks * d; ++e) {
    llama_rms_dw_partial_elem<E>(dy.data(), x.data(), inv.data(), partial.data(), rows, d, e);
  }
  for (uint64_t j = 0; j < d; ++j) {
    llama_colsum_finish_elem(partial.data(), nchunks, d, dw.data(), j);
  }
  put(dx);
  put(dw);
}

template <class E>
void softmax_fwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t mats = in.get<uint64_t>(), t = in.get<uint64_t>();
  std::vector<T> s = in.vec<T>(mats * t * t);
  in.finish();
  for (uint64_t r = 0; r < mats * t; ++r) {
    T* row = s.data() + r * t;
    const uint64_t valid = r % t + 1;
    const float m = row_reduce<LlamaMax, float>(
        [&](unsigned l) { return llama_softmax_max_lane<E>(row, valid, l); });
    const double sum = row_reduce<LlamaSum, double>(
        [&](unsigned l) { return llama_softmax_sum_lane<E>(row, valid, l, m); });
    for (unsigned l = 0; l < LLAMA_LANES; ++l) {
      llama_softmax_write<E>(row, row, t, valid, l, m, sum);
    }
  }
  put(s);
}

template <class E>
void softmax_bwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t mats = in.get<uint64_t>(), t = in.get<uint64_t>();
  const float scale = in.get<float>();
  const std::vector<T> p = in.vec<T>(mats * t * t);
  std::vector<T> dp = in.vec<T>(mats * t * t);
  in.finish();
  for (uint64_t r = 0; r < mats * t; ++r) {
    const uint64_t o = r * t, valid = r % t + 1;
    const float dot = (float)row_reduce<LlamaSum, double>(
        [&](unsigned l) { return llama_softmax_bwd_lane<E>(p.data() + o, dp.data() + o, valid, l); });
    for (unsigned l = 0; l < LLAMA_LANES; ++l) {
      llama_softmax_bwd_write<E>(p.data() + o, dp.data() + o, dp.data() + o, t, valid, l, dot,
                                 scale);
    }
  }
  put(dp);
}

template <class E>
void cross_entropy(Reader& in) {
  typedef typename E::T T;
  const uint64_t rows = in.get<uint64_t>(), vocab = in.get<uint64_t>(),
                 count = in.get<uint64_t>();
  const float inv = in.get<float>();
  const std::vector<llama_i32> targets = in.vec<llama_i32>(rows);
  const std::vector<T> x = in.vec<T>(rows * vocab);
  in.finish();
  std::vector<T> dx(rows * vocab);
  std::vector<float> losses(rows);
  for (uint64_t r = 0; r < rows; ++r) {
    const T* row = x.data() + r * vocab;
    const float m = row_reduce<LlamaMax, float>(
        [&](unsigned l) { return llama_softmax_max_lane<E>(row, vocab, l); });
    const double sum = row_reduce<LlamaSum, double>(
        [&](unsigned l) { return llama_softmax_sum_lane<E>(row, vocab, l, m); });
    for (unsigned l = 0; l < LLAMA_LANES; ++l) {
      const float loss =
          llama_ce_write<E>(row, dx.data() + r * vocab, vocab, targets[r], l, m, sum, inv);
      if (l == 0) losses[r] = loss;
    }
  }
  const double total = row_reduce<LlamaSum, double>(
      [&](unsigned l) { return llama_loss_lane(losses.data(), rows, l); });
  put(dx);
  put(losses);
  put1(llama_loss_mean(total, count));
}

template <class E>
void embedding_fwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t rows = in.get<uint64_t>(), dim = in.get<uint64_t>(), vocab = in.get<uint64_t>();
  const std::vector<zero_u32> tokens = in.vec<zero_u32>(rows);
  const std::vector<T> table = in.vec<T>(vocab * dim);
  in.finish();
  std::vector<T> out(rows * dim);
  for (uint64_t e = 0; e < rows * dim; ++e) {
    llama_embed_fwd_elem<E>(table.data(), tokens.data(), out.data(), dim, vocab, e);
  }
  put(out);
}

template <class E>
void embedding_bwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t rows = in.get<uint64_t>(), dim = in.get<uint64_t>(), vocab = in.get<uint64_t>(),
                 nseg = in.get<uint64_t>(), norder = in.get<uint64_t>();
  if (norder > rows) fail("plan longer than the batch");
  const std::vector<zero_u32> order = in.vec<zero_u32>(norder);
  const std::vector<zero_u32> seg_start = in.vec<zero_u32>(nseg + 1);
  const std::vector<zero_u32> seg_token = in.vec<zero_u32>(nseg);
  const std::vector<T> dout = in.vec<T>(rows * dim);
  std::vector<float> dtable = in.vec<float>(vocab * dim);
  in.finish();
  for (uint64_t e = 0; e < nseg * dim; ++e) {
    llama_embed_bwd_elem<E>(dout.data(), order.data(), seg_start.data(), seg_token.data(),
                            dtable.data(), dim, e);
  }
  put(dtable);
}

template <class E>
void swiglu_fwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t n = in.get<uint64_t>();
  const std::vector<T> h1 = in.vec<T>(n), h3 = in.vec<T>(n);
  in.finish();
  std::vector<T> a(n);
  for (uint64_t i = 0; i < n; ++i) llama_swiglu_fwd_elem<E>(h1.data(), h3.data(), a.data(), i);
  put(a);
}

template <class E>
void swiglu_bwd(Reader& in) {
  typedef typename E::T T;
  const uint64_t n = in.get<uint64_t>();
  const std::vector<T> da = in.vec<T>(n), h1 = in.vec<T>(n), h3 = in.vec<T>(n);
  in.finish();
  std::vector<T> dh1(n), dh3(n);
  for (uint64_t i = 0; i < n; ++i) {
    llama_swiglu_bwd_elem<E>(da.data(), h1.data(), h3.data(), dh1.data(), dh3.data(), i);
  }
  put(dh1);
  put(dh3);
}

template <class E>
void rope(Reader& in) {
  typedef typename E::T T;
  const uint64_t rows = in.get<uint64_t>(), seq = in.get<uint64_t>(), heads = in.get<uint64_t>(),
                 half = in.get<uint64_t>(), max_seq = in.get<uint64_t>();
  const int inverse = (int)in.get<uint32_t>();
  const std::vector<float> c = in.vec<float>(max_seq * half), s = in.vec<float>(max_seq * half);
  std::vector<T> x = in.vec<T>(rows * heads * 2 * half);
  in.finish();
  if (seq == 0 || seq > max_seq) fail("bad seq");
  for (uint64_t p = 0; p < rows * heads * half; ++p) {
    llama_rope_pair<E>(x.data(), c.data(), s.data(), seq, heads, half, inverse, p);
  }
  put(x);
}

template <class E>
void dispatch(const std::string& op, Reader& in) {
  if (op == "rmsnorm_fwd") return rmsnorm_fwd<E>(in);
  if (op == "rmsnorm_bwd") return rmsnorm_bwd<E>(in);
  if (op == "softmax_fwd") return softmax_fwd<E>(in);
  if (op == "softmax_bwd") return softmax_bwd<E>(in);
  if (op == "cross_entropy") return cross_entropy<E>(in);
  if (op == "embedding_fwd") return embedding_fwd<E>(in);
  if (op == "embedding_bwd") return embedding_bwd<E>(in);
  if (op == "swiglu_fwd") return swiglu_fwd<E>(in);
  if (op == "swiglu_bwd") return swiglu_bwd<E>(in);
  if (op == "rope") return rope<E>(in);
  fail("unknown op " + op);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) fail("usage: host_check OP f32|bf16");
  const std::string op = argv[1], e = argv[2];
  Reader in = read_stdin();
  if (e == "f32") {
    dispatch<ZeroF32>(op, in);
  } else if (e == "bf16") {
    dispatch<ZeroBF16>(op, in);
  } else {
    fail("unknown element type " + e);
  }
  if (fflush(stdout) != 0) fail("cannot write stdout");
  return 0;
}
