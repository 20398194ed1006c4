#!/usr/bin/env bash
# Installs what zero needs to build and test on Debian/Ubuntu: a Rust
# toolchain check, OpenMPI (runtime + headers, for the `mpi` feature) and
# libclang (bindgen, used by the `mpi` crate). Installs with apt-get when run
# as root; otherwise says exactly what to install and fails.
set -euo pipefail

missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || missing+=(libopenmpi-dev)
if ! ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so' \
   && ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
  missing+=(libclang-dev)
fi
# bindgen asks the clang driver for the system include paths (mpi.h
# includes <stddef.h>).
command -v clang >/dev/null 2>&1 || missing+=(clang)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing ${missing[*]}." >&2
    echo "setup: install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust from https://rustup.rs" >&2
  exit 1
fi
command -v mpirun >/dev/null && command -v mpicc >/dev/null || {
  echo "setup: MPI is still missing after install; the mpi feature cannot build" >&2
  exit 1
}
