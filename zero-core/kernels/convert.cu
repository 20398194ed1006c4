// zero: conversion, accumulation and copies over many element ranges in
// one launch (the CUDA backend's cast, pack and unpack), compiled at run
// time by NVRTC with the options of adamw.cu.
//
// One kernel per (source, destination) type, named convert_{src}_{dst}
// with both in {f32, bf16, f16}. Arguments: the pieces (ZeroPieces of
// zero_convert.cuh, by value: the driver copies them at launch, so the
// host keeps nothing alive and allocates nothing), and accumulate (0 or
// 1). Each thread runs zero_pieces_thread, a grid-stride loop over the
// launch's elements; zero-core/tests/kernels_on_host.rs runs the same body
// on the host against zero_core::convert.
//
// `__grid_constant__` guarantees that the descriptor array stays in
// parameter space when a thread indexes it (without it the compiler may
// copy the 3 KiB to each thread's local memory; zero-core/tests/nvrtc.rs
// checks the PTX has no local memory); it needs compute capability 7.0,
// below every architecture the library targets.

#include "zero_convert.cuh"

#define ZERO_CONVERT_KERNEL(NAME, S, D)                                                      \
  extern "C" __global__ void __launch_bounds__(ZERO_CONVERT_BLOCK)                            \
      NAME(const __grid_constant__ ZeroPieces ps, zero_u32 accumulate) {                      \
    zero_pieces_thread<S, D>(ps, accumulate != 0,                                            \
                             (zero_u64)blockIdx.x * blockDim.x + threadIdx.x,                \
                             (zero_u64)gridDim.x * blockDim.x);                               \
  }

ZERO_CONVERT_KERNEL(convert_f32_f32, ZeroF32, ZeroF32)
ZERO_CONVERT_KERNEL(convert_f32_bf16, ZeroF32, ZeroBF16)
ZERO_CONVERT_KERNEL(convert_f32_f16, ZeroF32, ZeroF16)
ZERO_CONVERT_KERNEL(convert_bf16_f32, ZeroBF16, ZeroF32)
ZERO_CONVERT_KERNEL(convert_bf16_bf16, ZeroBF16, ZeroBF16)
ZERO_CONVERT_KERNEL(convert_bf16_f16, ZeroBF16, ZeroF16)
ZERO_CONVERT_KERNEL(convert_f16_f32, ZeroF16, ZeroF32)
ZERO_CONVERT_KERNEL(convert_f16_bf16, ZeroF16, ZeroBF16)
ZERO_CONVERT_KERNEL(convert_f16_f16, ZeroF16, ZeroF16)
