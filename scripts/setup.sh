#!/usr/bin/env bash
# Installs what zero needs to build and test on Debian/Ubuntu: OpenMPI
# (runtime + headers, for the `mpi` feature), libclang and clang (bindgen,
# used by the `mpi` crate, loads libclang and asks clang for the system
# include paths that mpi.h needs) and pkg-config. Installs with apt-get when
# run as root; otherwise says exactly what to install and fails.
set -euo pipefail

packages=(openmpi-bin libopenmpi-dev libclang-dev clang pkg-config)
missing=()
if command -v dpkg >/dev/null 2>&1; then
  for p in "${packages[@]}"; do
    # Removed packages keep their config files and dpkg -s still knows
    # them: only "install ok installed" counts.
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$p")
  done
else
  # Not Debian: check for the tools themselves.
  command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
  command -v mpicc >/dev/null 2>&1 || missing+=(libopenmpi-dev)
  command -v clang >/dev/null 2>&1 || missing+=(libclang-dev clang)
  command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "setup: missing ${missing[*]}." >&2
    echo "setup: install them with: sudo apt-get install -y ${missing[*]}" >&2
    echo "setup: (other systems: an MPI implementation with mpicc, libclang, pkg-config)" >&2
    exit 1
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust from https://rustup.rs" >&2
  exit 1
fi
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
  echo "setup: mpirun/mpicc still missing after install; the mpi feature cannot build" >&2
  exit 1
fi
