#!/usr/bin/env bash
# Tests the NEON (aarch64) path of the CPU AdamW and norm kernels on an
# x86-64 machine: cross-compiles zero-core's kernel tests for
# aarch64-unknown-linux-gnu and runs them under qemu-user, then lints that
# target. Installs what it needs when run as root on Debian/Ubuntu
# (gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user, and the rustup
# target). If the toolchain cannot be installed it says so loudly and
# skips; a failing test or lint fails.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
skip() {
  echo "test-neon: NEON PATH NOT TESTED: $*" >&2
  exit 0
}

if [ "$(uname -m)" = aarch64 ]; then
  # Native: the ordinary test run already covered NEON.
  exit 0
fi

packages=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test-neon: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || skip "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || skip "could not install ${missing[*]}"
  else
    skip "missing ${missing[*]} (install them, e.g. sudo apt-get install -y ${missing[*]})"
  fi
fi
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  rustup target add "$target" >/dev/null 2>&1 || skip "rustup target add $target failed"
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo test -p zero-core --target "$target" --test cpu_adam --test optim
cargo clippy -p zero-core --target "$target" --all-targets -- -D warnings
