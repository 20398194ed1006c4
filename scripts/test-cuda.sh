#!/usr/bin/env bash
# Tests the `cuda` feature on a machine with or without a GPU:
#
# - installs NVRTC from PyPI into target/nvrtc-<version> when it is not
#   there yet, as pip lays the wheels out: CUDA 12.8
#   (`nvidia-cuda-nvrtc-cu12`, nvidia/cuda_nvrtc/lib/libnvrtc.so.12) and
#   CUDA 13.0 (`nvidia-cuda-nvrtc`, nvidia/cu13/lib/libnvrtc.so.13, the
#   GPU image's). NVRTC runs without a GPU or driver;
# - runs zero-core's tests with `--features cuda` and NVRTC 12.8's folder
#   on LD_LIBRARY_PATH, with ZERO_REQUIRE_NVRTC=1: every CUDA source of the
#   library must compile for sm_80 and sm_90 with no error and no warning
#   (zero-core/tests/nvrtc.rs), and the host build of the kernels' math must
#   give the reference's bits (zero-core/tests/kernels_on_host.rs); the
#   library search is tested on folders laid out like the wheels
#   (zero-core's `cuda::libs` tests). Tests that need a GPU run when one is
#   present and print a "skipped" line otherwise; also every workspace
#   crate's unit tests and doc tests with `cuda`, zero-comm's NCCL tests and
#   zero-llama's kernel tests;
# - compiles every kernel of zero-core and zero-llama again with NVRTC 13.0,
#   which zero opens as `libnvrtc.so.13` from its wheel folder (no link);
#   ZERO_NVRTC_VERSION makes each run check which NVRTC compiled;
# - runs `zero doctor` on a CUDA 13 wheel layout (tests/doctor.rs).
#
# Every cargo command here selects the whole workspace with `cuda` (the
# test targets by name): one build, and the dependencies of `cargo test
# --workspace` and `clippy --features cuda` as they are. A `-p PACKAGE`
# alone unifies other features in the dependencies (serde's, half's,
# gemm's, syn's) and so rebuilds them and every crate above them, once per
# package.
#
# Without pip or without the package index this fails: the kernels would
# go untested.
set -euo pipefail
cd "$(dirname "$0")/.."

# install PACKAGE VERSION LIBDIR FILE: the wheel in target/nvrtc-VERSION
# (once); its library folder LIBDIR (relative to it) must hold FILE.
install() {
  local package=$1 version=$2 dir="target/nvrtc-$2"
  if [ ! -e "$dir/$3/$4" ]; then
    python=$(command -v python3 || command -v python || true)
    if [ -z "$python" ] || ! "$python" -m pip --version >/dev/null 2>&1; then
      echo "test-cuda: python3 with pip is needed to install $package==$version" >&2
      exit 1
    fi
    echo "test-cuda: installing $package==$version into $dir" >&2
    rm -rf "$dir.partial"
    "$python" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps \
      --target "$dir.partial" "$package==$version"
    rm -rf "$dir"
    mv "$dir.partial" "$dir"
  fi
  if [ ! -e "$dir/$3/$4" ]; then
    echo "test-cuda: $package==$version has no $3/$4" >&2
    exit 1
  fi
}
install nvidia-cuda-nvrtc-cu12 12.8.93 nvidia/cuda_nvrtc/lib libnvrtc.so.12
install nvidia-cuda-nvrtc 13.0.88 nvidia/cu13/lib libnvrtc.so.13
nvrtc12="$PWD/target/nvrtc-12.8.93/nvidia/cuda_nvrtc/lib"
nvrtc13="$PWD/target/nvrtc-13.0.88/nvidia/cu13/lib"
path="${LD_LIBRARY_PATH:-}"
export ZERO_REQUIRE_NVRTC=1

# The workspace with `cuda`; zero-core's integration tests by name (all of
# them), those of the other crates that need CUDA, and `zero doctor`'s.
ws=(--workspace --features cuda)
core_tests=()
for t in zero-core/tests/*.rs; do
  core_tests+=(--test "$(basename "$t" .rs)")
done

# CUDA 12.8: everything. Every crate's unit tests (zero-core's `cuda::libs`
# among them), zero-core's integration tests, the NCCL backend's checks and
# tests (the GPU tests print "skipped"; the missing-library path runs in a
# process that sees no NCCL), and the Llama model's kernels (the zero-llama
# crate, examples/llama): NVRTC compilation (required), the host check of
# their math against the CPU ops, and the GPU tests (skipped without one).
export LD_LIBRARY_PATH="$nvrtc12${path:+:$path}" ZERO_NVRTC_VERSION=12.8
cargo test "${ws[@]}" --lib "${core_tests[@]}" --test nccl --test cuda_kernels
cargo test "${ws[@]}" --doc

# CUDA 13.0: every kernel compiles with it too, opened as libnvrtc.so.13,
# and `zero doctor` on a CUDA 13 wheel layout (with NVRTC 13's file in it).
export LD_LIBRARY_PATH="$nvrtc13${path:+:$path}" ZERO_NVRTC_VERSION=13.0
cargo test "${ws[@]}" --test nvrtc --test doctor
