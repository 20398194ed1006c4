#!/usr/bin/env bash
# Tests the `cuda` feature on a machine with or without a GPU:
#
# - installs NVRTC from PyPI (`nvidia-cuda-nvrtc-cu12`, the CUDA 12.8 runtime
#   compiler the build targets: cudarc's `cuda-12080`) into
#   target/nvrtc-<version> when it is not there yet; NVRTC runs without a
#   GPU or driver;
# - runs zero-core's tests with `--features cuda` and that library on the
#   loader path, with ZERO_REQUIRE_NVRTC=1: every CUDA source of the
#   library must compile for sm_80 and sm_90 with no error and no warning
#   (zero-core/tests/nvrtc.rs), and the host build of the kernels' math must
#   give the reference's bits (zero-core/tests/kernels_on_host.rs). Tests
#   that need a GPU run when one is
#   present and print a "skipped" line otherwise.
#
# Without pip or without the package index this fails: the kernels would
# go untested.
set -euo pipefail
cd "$(dirname "$0")/.."

version=12.8.93
dir="target/nvrtc-$version"
lib="$PWD/$dir/nvidia/cuda_nvrtc/lib"
if [ ! -e "$lib/libnvrtc.so.12" ]; then
  python=$(command -v python3 || command -v python || true)
  if [ -z "$python" ] || ! "$python" -m pip --version >/dev/null 2>&1; then
    echo "test-cuda: python3 with pip is needed to install nvidia-cuda-nvrtc-cu12==$version" >&2
    exit 1
  fi
  echo "test-cuda: installing nvidia-cuda-nvrtc-cu12==$version into $dir" >&2
  rm -rf "$dir.partial"
  "$python" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps \
    --target "$dir.partial" "nvidia-cuda-nvrtc-cu12==$version"
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
fi
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ZERO_REQUIRE_NVRTC=1
cargo test -p zero-core --features cuda
# The NCCL backend's checks and tests (no libnccl here: the missing-library
# path is tested for real; the GPU tests print "skipped").
cargo test -p zero-comm --features cuda --lib nccl
cargo test -p zero-comm --features cuda --test nccl
# The Llama model's kernels (the zero-llama crate, examples/llama): NVRTC
# compilation (required), the host check of their math against the CPU ops,
# and the GPU tests (skipped without one).
cargo test -p zero-llama --features cuda --test nvrtc --test kernels_on_host --test cuda_kernels
