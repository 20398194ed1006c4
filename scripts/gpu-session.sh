#!/usr/bin/env bash
# Everything the CUDA issue needs from a machine with a GPU, in one go
# (about 10 minutes at most), with every output under $OUT (default
# ./gpu-out):
#
#   1. the machine: nvidia-smi, GPUs, driver, glibc, memory;
#   2. the libraries, found on the machine (no network is needed or used):
#      libcuda (the driver), libnvrtc.so.12/.13, libcublas.so.12/.13 and
#      libnccl.so.2, looked for
#      in the NVRTC carried with prebuilt executables (--with-nvrtc), on
#      LD_LIBRARY_PATH, in target/nvrtc-* (scripts/test-cuda.sh), in
#      Python's site-packages (the CUDA 12 and 13 wheels that torch
#      installs: nvidia/cu13/lib, nvidia/cuda_nvrtc/lib, nvidia/nccl/lib,
#      ...), the CUDA toolkit, ldconfig, and at last by `find /`; reported,
#      and their folders put first on LD_LIBRARY_PATH. No links are made:
#      zero opens `libnvrtc.so.13`, `libcublas.so.13` and `libnccl.so.2`
#      as installed (zero_core::cuda::libs), and `zero doctor` says which
#      file it opened;
#   3. zero-core's tests with --features cuda (GPU AdamW against the CPU
#      reference, arena, streams, NVRTC, the backend conformance suite on
#      the CUDA backend), with ZERO_REQUIRE_NVRTC=1 when
#      NVRTC was found;
#   4. zero-comm's NCCL tests (--test nccl) and its device collectives on
#      the CUDA backend, NCCL and host-staged (--test nccl_device);
#      zero-offload's pinned pool registered with the driver (--test cuda_pin);
#   5. the engine on the CUDA backend (the `test_device!` cases named
#      `::cuda` of tests/engine.rs, tests/offload.rs and
#      tests/checkpoint.rs: stages 0-3, optimizer and parameter offload,
#      trained on the GPU, ranks as threads with host-staged device
#      collectives, bit-identical to the CPU backend; checkpoints saved on
#      the GPU loaded on the CPU and back);
#   6. the Llama example's GPU kernels (tests/cuda_kernels.rs, tests/nvrtc.rs)
#      and its device trainer on the CUDA backend (tests/device_cuda.rs:
#      every op, cuBLAS GEMMs included, against the CPU backend, and the
#      tiny model trained on the GPU against the CPU backend);
#   7. `llama_sft --device cuda` at stages 0-3 (and stage 3 with optimizer
#      offload), 2 ranks as threads on GPU 0, each to 95% held-out accuracy;
#   8. the LoRA experiment at its full size (scripts/lora-experiment.sh
#      --device cuda: Qwen2.5-14B's shape with random weights, the four
#      DeepSpeed configs of tests/fixtures/ds_*.json, LORA_STEPS steps each
#      (default 4: a warm-up step and 3 timed), 2 ranks sharing GPU 0 where
#      `zero estimate` says they fit, then PyTorch + PEFT on the same shape
#      and batch; its table and targets in $OUT/lora-experiment.log);
#   9. the benchmarks: benches/llama_cuda.rs (a ~1B Llama, stage 3 MFU and
#      the optimizer-offload step against it; $OUT/llama_cuda.json), then
#      PyTorch on the same machine (scripts/torch_baseline.py: FSDP2 with
#      and without CPU offload, fused AdamW; $OUT/torch_baseline.json), and
#      benches/cuda.rs ($OUT/cuda.json).
#
# Prebuilt, they run in the order 3, 6, 7, 5, 4 (--run 1), then 9 (but
# benches/cuda.rs), benches/cuda.rs, the examples at every stage (--run
# 2), then 8 (--run 3: the LoRA experiment alone, since its four 14.7B
# models take up to LORA_TIMEOUT seconds, more than runs 1 and 2 leave of
# one command's time); a step that would start after BUDGET seconds
# (default 540) is not run.
#
# Usage:
#   scripts/gpu-session.sh                  on the GPU machine; builds with
#                                           cargo when it is there, else
#                                           runs target/gpu-prebuilt if
#                                           present
#   scripts/gpu-session.sh --prebuilt DIR   on the GPU machine: run the
#                                           executables in DIR, no cargo
#   scripts/gpu-session.sh --build [DIR] [--with-nvrtc]
#                                           on a machine with cargo (no GPU
#                                           needed): build those executables
#                                           into DIR (default
#                                           target/gpu-prebuilt), stripped,
#                                           gzipped, with a manifest (~25 MB);
#                                           --with-nvrtc adds NVRTC 12.8
#                                           from target/nvrtc-* gzipped
#                                           (~44 MB), for a machine without
#                                           NVRTC
#
# A device machine without Rust: build here with `--build`, carry
# target/gpu-prebuilt (ignored by git, so it must be named in the device
# tool's `carry`; at most 64 MiB), and run `scripts/gpu-session.sh
# --prebuilt target/gpu-prebuilt` there. The binaries need the device
# machine's glibc to be at least the one they were built against (printed
# by --build: 2.34 on the development machines).
#
# Environment: OUT (output folder), STEP_TIMEOUT (seconds per step,
# default 240), BUDGET (seconds after which no step starts, default 540),
# BENCH_ARGS (extra options of benches/cuda.rs, e.g. "--reps 10"),
# LLAMA_BENCH_ARGS (of benches/llama_cuda.rs, e.g. "--batch 2"),
# TORCH_ARGS (of scripts/torch_baseline.py), LORA_STEPS (steps per config of
# the LoRA experiment, default 4), LORA_TIMEOUT (its time limit, default
# 480 s), LORA_CONFIG_TIMEOUT (each of its configs' and the baseline's,
# default 100 s), NCCL_DEBUG (default WARN).
#
# The device tool brings back at most 8 files of $OUT: run it as
#   OUT=/tmp/gs scripts/gpu-session.sh --prebuilt target/gpu-prebuilt;
#   tar czf "$OUT/gpu-session.tgz" -C /tmp gs; cp /tmp/gs/summary.txt "$OUT/"
#
# MPI is not needed anywhere: zero-comm and the facade are built with
# --no-default-features (their default feature is `mpi`); zero-llama takes
# zero without it.
#
# Exit status: 0 when every step passed, 1 when one failed, 3 when there
# was nothing to run (no cargo and no prebuilt executables).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

usage() {
  echo "usage: $0 [--prebuilt DIR [--run 1|2|3] | --build [DIR] [--with-nvrtc]]" >&2
  exit 2
}
mode=auto
prebuilt=""
with_nvrtc=0
run=all
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt)
      mode=prebuilt
      prebuilt="${2:-}"
      [ -n "$prebuilt" ] || usage
      shift
      ;;
    --build)
      mode=build
      if [ -n "${2:-}" ] && [ "${2#--}" = "$2" ]; then
        prebuilt=$2
        shift
      fi
      ;;
    --with-nvrtc) with_nvrtc=1 ;;
    --run)
      run="${2:-}"
      case "$run" in 1 | 2 | 3) ;; *) usage ;; esac
      shift
      ;;
    *) usage ;;
  esac
  shift
done
if [ "$mode" = build ]; then prebuilt="${prebuilt:-target/gpu-prebuilt}"; fi

CARGO=$(command -v cargo || true)
if [ -z "$CARGO" ] && [ -x "$HOME/.cargo/bin/cargo" ]; then
  CARGO="$HOME/.cargo/bin/cargo"
fi

# ---------------------------------------------------------------------------
# --build: the executables, for a machine without cargo
# ---------------------------------------------------------------------------
if [ "$mode" = build ]; then
  if [ -z "$CARGO" ]; then
    echo "gpu-session: --build needs cargo" >&2
    exit 2
  fi
  PY=$(command -v python3 || command -v python || true)
  if [ -z "$PY" ]; then
    echo "gpu-session: --build needs python3 to read cargo's JSON messages" >&2
    exit 2
  fi
  mkdir -p "$prebuilt"
  dir=$(cd "$prebuilt" && pwd)
  rm -f "$dir"/*.exe "$dir"/*.exe.gz "$dir/manifest.tsv"
  # name <TAB> target kind/name <TAB> cargo arguments
  # In the order they run: the backend, the model on the GPU, the
  # benchmarks, then the engine's and the collectives' tests (the session's
  # time budget may cut the last ones).
  builds=(
    "zero|bin:zero|build -p zero --no-default-features --features cuda --bin zero"
    "zero-core-lib|lib:zero_core|test -p zero-core --features cuda --lib --no-run"
    "cuda_adamw|test:cuda_adamw|test -p zero-core --features cuda --test cuda_adamw --no-run"
    "cuda_arena|test:cuda_arena|test -p zero-core --features cuda --test cuda_arena --no-run"
    "cuda_streams|test:cuda_streams|test -p zero-core --features cuda --test cuda_streams --no-run"
    "nvrtc|test:nvrtc|test -p zero-core --features cuda --test nvrtc --no-run"
    "backend_conformance|test:backend_conformance|test -p zero-core --features cuda --test backend_conformance --no-run"
    "cuda_pool|test:cuda_pool|test -p zero-core --features cuda --test cuda_pool --no-run"
    "llama_cuda|test:cuda_kernels|test -p zero-llama --features cuda --test cuda_kernels --no-run"
    "llama_cuda_nvrtc|test:nvrtc|test -p zero-llama --features cuda --test nvrtc --no-run"
    "llama_device_cuda|test:device_cuda|test -p zero-llama --features cuda --test device_cuda --no-run"
    "llama_device_lora_cuda|test:device_lora_cuda|test -p zero-llama --features cuda --test device_lora_cuda --no-run"
    "llama_sft|example:llama_sft|build -p zero --no-default-features --features cuda --example llama_sft"
    "llama_cuda-bench|bench:llama_cuda|test -p zero --no-default-features --features cuda --bench llama_cuda --no-run"
    "engine_cuda|test:engine|test -p zero --no-default-features --features cuda --test engine --no-run"
    "engine_offload_cuda|test:offload|test -p zero --no-default-features --features cuda --test offload --no-run"
    "engine_checkpoint_cuda|test:checkpoint|test -p zero --no-default-features --features cuda --test checkpoint --no-run"
    "nccl|test:nccl|test -p zero-comm --no-default-features --features cuda --test nccl --no-run"
    "cuda_pin|test:cuda_pin|test -p zero-offload --features cuda --test cuda_pin --no-run"
    "nccl_device|test:nccl_device|test -p zero-comm --no-default-features --features cuda --test nccl_device --no-run"
    "cuda-bench|bench:cuda|test -p zero --no-default-features --features cuda --bench cuda --no-run"
  )
  # Where each one runs from (cargo runs tests in their package's folder).
  declare -A cwd=(
    [zero]=
    [zero-core-lib]=zero-core [cuda_adamw]=zero-core [cuda_arena]=zero-core
    [cuda_streams]=zero-core [nvrtc]=zero-core [backend_conformance]=zero-core [cuda_pool]=zero-core
    [nccl]=zero-comm [nccl_device]=zero-comm [cuda_pin]=zero-offload [cuda-bench]= [engine_cuda]= [engine_offload_cuda]= [engine_checkpoint_cuda]=
    [llama_cuda]=examples/llama [llama_cuda_nvrtc]=examples/llama [llama_device_cuda]=examples/llama [llama_device_lora_cuda]=examples/llama
    [llama_sft]= [llama_cuda-bench]=
  )
  for b in "${builds[@]}"; do
    IFS='|' read -r name target args <<<"$b"
    echo "== cargo $args"
    # shellcheck disable=SC2086
    exe=$("$CARGO" $args --message-format=json | "$PY" -c '
import json, sys
kind, name = sys.argv[1].split(":")
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    if t["name"] == name and kind in t["kind"]:
        print(m["executable"])
' "$target" | tail -1)
    if [ -z "$exe" ] || [ ! -x "$exe" ]; then
      echo "gpu-session: building $name failed; cargo's messages:" >&2
      # shellcheck disable=SC2086
      "$CARGO" $args 2>&1 | tail -30 >&2
      exit 1
    fi
    cp "$exe" "$dir/$name.exe"
    if command -v strip >/dev/null; then strip --strip-debug "$dir/$name.exe" || true; fi
    printf '%s\t%s\n' "$name" "${cwd[$name]}" >>"$dir/manifest.tsv"
    echo "   $exe -> $dir/$name.exe ($(du -h "$dir/$name.exe" | cut -f1))"
  done
  rm -rf "$dir/nvrtc"
  if [ "$with_nvrtc" = 1 ]; then
    lib=$(ls -d "$REPO"/target/nvrtc-*/nvidia/cuda_nvrtc/lib 2>/dev/null | sort -V | tail -1)
    if [ -z "$lib" ] || [ ! -e "$lib/libnvrtc.so.12" ]; then
      echo "gpu-session: --with-nvrtc: no target/nvrtc-*/nvidia/cuda_nvrtc/lib; run scripts/test-cuda.sh" \
        "once (it installs the NVRTC wheel there)" >&2
      exit 1
    fi
    mkdir -p "$dir/nvrtc"
    for f in "$lib"/libnvrtc.so.12 "$lib"/libnvrtc-builtins.so.*; do
      gzip -6 -c "$f" >"$dir/nvrtc/$(basename "$f").gz"
    done
    echo "nvrtc: $lib -> $dir/nvrtc ($(du -sh "$dir/nvrtc" | cut -f1), gzip)"
  fi
  {
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) (working tree may differ)"
    echo "rustc: $(rustc -V 2>/dev/null || echo unknown)"
    echo "host glibc: $(ldd --version 2>/dev/null | head -1)"
    need=$(for f in "$dir"/*.exe; do objdump -T "$f" 2>/dev/null; done |
      grep -o 'GLIBC_[0-9.]*' | sort -u -V | tail -1)
    echo "needs glibc: ${need:-unknown (objdump missing)}"
  } >"$dir/BUILD_INFO"
  cat "$dir/BUILD_INFO"
  # Compressed: the device tool carries at most 64 MiB; the GPU machine
  # unpacks them into a temporary folder.
  for f in "$dir"/*.exe; do gzip -6 -f "$f"; done
  echo "total: $(du -sh "$dir" | cut -f1) in $dir (the device tool carries at most 64 MiB)"
  echo "next, on the GPU machine: scripts/gpu-session.sh --prebuilt ${prebuilt}"
  exit 0
fi

# ---------------------------------------------------------------------------
# On the GPU machine
# ---------------------------------------------------------------------------
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STEP_TIMEOUT="${STEP_TIMEOUT:-240}"
# Steps that would start after this many seconds are not run (the device
# tool allows one command 10 minutes).
BUDGET="${BUDGET:-540}"
started=$(date +%s)
declare -a summary=()
failed=0

note() { echo "gpu-session: $*"; }
section() { echo; echo "=================== $* ==================="; }

# Runs a step with a time limit, its output also in $OUT/<name>.log.
step() {
  local name=$1
  shift
  if [ $(($(date +%s) - started)) -ge "$BUDGET" ]; then
    summary+=("$name: NOT RUN (the session's ${BUDGET}s budget was spent)")
    failed=1
    return
  fi
  section "$name: $*"
  local t0 rc
  t0=$(date +%s)
  timeout -k 15 "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    summary+=("$name: ok (${took}s)")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    summary+=("$name: TIMED OUT after ${STEP_TIMEOUT}s")
    failed=1
  else
    if grep -q "GLIBC_[0-9.]*' not found" "$OUT/$name.log"; then
      note "the executable needs a newer glibc than this machine has ($(ldd --version | head -1))"
    fi
    summary+=("$name: FAILED (exit $rc, ${took}s)")
    failed=1
  fi
}

# The session proper (not indented: it holds a heredoc); its output also
# goes to $OUT/session.log.
session() {
tmp_dirs=()
trap 'rm -rf "${tmp_dirs[@]}"' EXIT
section "machine"
date -u
uname -a
ldd --version 2>/dev/null | head -1
nproc
free -g 2>/dev/null || true
if command -v nvidia-smi >/dev/null; then
  nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 | tee -a "$OUT/nvidia-smi.txt"
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ]; then
    nvidia-smi topo -m 2>&1 | tee -a "$OUT/nvidia-smi.txt"
  fi
else
  note "nvidia-smi not found"
fi

section "libraries"
# The prebuilt executables to run when there is no cargo.
if [ "$mode" = auto ] && [ -z "$CARGO" ] && [ -f target/gpu-prebuilt/manifest.tsv ]; then
  mode=prebuilt
  prebuilt=target/gpu-prebuilt
  note "cargo not found; running the prebuilt executables in $prebuilt"
fi
# NVRTC carried with them (--build --with-nvrtc): the version the kernels
# are tested with, so it goes first.
carried=""
if [ "$mode" = prebuilt ] && [ -d "$prebuilt/nvrtc" ]; then
  carried=$(mktemp -d "${TMPDIR:-/tmp}/zero-nvrtc.XXXXXX")
  tmp_dirs+=("$carried")
  for f in "$prebuilt"/nvrtc/*.gz; do
    gzip -dc "$f" >"$carried/$(basename "$f" .gz)" || note "unpacking $f failed"
  done
  note "unpacked the carried NVRTC into $carried"
fi
PY=$(command -v python3 || command -v python || true)
# Folders that may hold the CUDA libraries, most specific first.
candidate_dirs() {
  local p
  [ -n "$carried" ] && echo "$carried"
  IFS=: read -ra parts <<<"${LD_LIBRARY_PATH:-}"
  for p in "${parts[@]}"; do [ -n "$p" ] && echo "$p"; done
  for p in "$REPO"/target/nvrtc-*/nvidia/cuda_nvrtc/lib; do [ -d "$p" ] && echo "$p"; done
  if [ -n "$PY" ]; then
    "$PY" - <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = []
try:
    roots += site.getsitepackages()
except Exception:
    pass
try:
    roots.append(site.getusersitepackages())
except Exception:
    pass
roots += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
seen = set()
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))) + [os.path.join(r, "torch", "lib")]:
        if os.path.isdir(d) and d not in seen:
            seen.add(d)
            print(d)
EOF
  fi
  for p in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
    /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib /opt/conda/lib; do
    [ -d "$p" ] && echo "$p"
  done
}
mapfile -t DIRS < <(candidate_dirs | awk '!seen[$0]++')

# find_lib NAME...: the first path of one of the names, in the folders
# above or in ldconfig's cache.
find_lib() {
  local d n p
  for d in "${DIRS[@]}"; do
    for n in "$@"; do
      if [ -e "$d/$n" ]; then echo "$d/$n"; return 0; fi
    done
  done
  for n in "$@"; do
    p=$(ldconfig -p 2>/dev/null | awk -v n="$n" '$1 == n { print $NF; exit }')
    if [ -n "$p" ]; then echo "$p"; return 0; fi
  done
  return 1
}

# When some library was not found there: one search of the whole file
# system (60 s at most) for all of them, whose folders join DIRS.
search_everywhere() {
  local args=() n
  for n in "$@"; do args+=(-o -name "$n"); done
  note "searching / for ${*} (at most 60 s)"
  mapfile -t found < <(timeout 60 find / -xdev \( -path /proc -o -path /sys \) -prune \
    -o \( -false "${args[@]}" \) -print 2>/dev/null)
  for n in "${found[@]}"; do DIRS+=("$(dirname "$n")"); done
}
if ! find_lib libcuda.so.1 libcuda.so >/dev/null || ! find_lib libnvrtc.so.12 libnvrtc.so.13 libnvrtc.so >/dev/null ||
  ! find_lib libcublas.so.12 libcublas.so.13 libcublas.so >/dev/null || ! find_lib libnccl.so libnccl.so.2 >/dev/null; then
  search_everywhere libcuda.so.1 libnvrtc.so.12 libnvrtc.so.13 libcublas.so.12 libcublas.so.13 libnccl.so.2 libnccl.so
fi

# prepend_lib_path DIR: DIR first on LD_LIBRARY_PATH (moved there when it
# is already on it).
prepend_lib_path() {
  local rest=":${LD_LIBRARY_PATH:-}:"
  rest=${rest//":$1:"/:}
  rest=${rest#:}
  rest=${rest%:}
  export LD_LIBRARY_PATH="$1${rest:+:$rest}"
}

# The folders of the libraries found, put first on LD_LIBRARY_PATH at the
# end, NVRTC's first: zero searches LD_LIBRARY_PATH folder by folder (each
# for `.so.13`, `.so.12`, `.so`), so the copy reported here is the one it
# opens. No links: zero opens the files under their installed names.
lib_dirs=()

cuda_lib=$(find_lib libcuda.so.1 libcuda.so || true)
if [ -n "$cuda_lib" ]; then
  note "driver: $cuda_lib"
else
  note "libcuda.so.1 NOT FOUND: no CUDA driver; every GPU test and bench section will skip"
fi

nvrtc_lib=$(find_lib libnvrtc.so.12 libnvrtc.so.13 libnvrtc.so || true)
if [ -n "$nvrtc_lib" ]; then
  lib_dirs+=("$(dirname "$nvrtc_lib")")
  export ZERO_REQUIRE_NVRTC=1
  note "nvrtc: $nvrtc_lib ($(ls "$(dirname "$nvrtc_lib")" | grep -E 'nvrtc' | tr '\n' ' '))"
else
  note "libnvrtc.so.12/.13 NOT FOUND: the GPU AdamW tests and bench sections will skip"
fi

# cuBLAS (with its libcublasLt beside it), for the Llama device trainer's
# GEMMs.
cublas_lib=$(find_lib libcublas.so.12 libcublas.so.13 libcublas.so || true)
if [ -n "$cublas_lib" ]; then
  lib_dirs+=("$(dirname "$cublas_lib")")
  note "cublas: $cublas_lib"
else
  note "libcublas.so.12/.13 NOT FOUND: the Llama device trainer's GPU tests will fail (they need cuBLAS)"
fi

nccl_lib=$(find_lib libnccl.so.2 libnccl.so || true)
if [ -n "$nccl_lib" ]; then
  lib_dirs+=("$(dirname "$nccl_lib")")
  note "nccl: $nccl_lib"
else
  note "libnccl.so.2 NOT FOUND: the NCCL tests and bench section will skip"
fi
for ((i = ${#lib_dirs[@]} - 1; i >= 0; i--)); do prepend_lib_path "${lib_dirs[i]}"; done
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
note "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
{
  echo "libcuda=${cuda_lib:-}"
  echo "libnvrtc=${nvrtc_lib:-}"
  echo "libcublas=${cublas_lib:-}"
  echo "libnccl=${nccl_lib:-}"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} >"$OUT/libraries.txt"

# shellcheck disable=SC2206
bench_args=(--json "$OUT/cuda.json" ${BENCH_ARGS:-})

# The example on the GPU (--device cuda: the device trainer), every
# stage, 2 ranks as threads on GPU 0, each to 95% held-out accuracy.
llama_sft_stages() {
  local exe=$1 st
  for st in 0 1 2 3; do
    step "llama_sft-stage$st" "$exe" --device cuda --stage "$st" --min-accuracy 95 \
      --metrics "$OUT/llama_sft-stage$st.jsonl"
  done
}

# The LoRA experiment at Qwen2.5-14B's size (issue 31): the executables
# given (prebuilt) or built by the script; its own time limit.
lora_experiment() {
  local bins=()
  [ -n "${1:-}" ] && bins=(--bin "$1" --zero "$2")
  STEP_TIMEOUT="${LORA_TIMEOUT:-480}" step lora-experiment bash "$REPO/scripts/lora-experiment.sh" \
    --device cuda --shape qwen2.5-14b --steps "${LORA_STEPS:-4}" --timeout "${LORA_CONFIG_TIMEOUT:-100}" \
    "${bins[@]}" --out "$OUT/lora-experiment"
}

# PyTorch on the same machine: FSDP2 and fused AdamW (scripts/torch_baseline.py).
torch_baseline() {
  if [ -n "$PY" ] && "$PY" -c 'import torch' 2>/dev/null; then
    # shellcheck disable=SC2086
    step torch-baseline "$PY" "$REPO/scripts/torch_baseline.py" --json "$OUT/torch_baseline.json" ${TORCH_ARGS:-}
  else
    summary+=("torch-baseline: NOT RUN (no python3 with torch)")
  fi
}

if [ "$mode" = auto ]; then
  if [ -n "$CARGO" ]; then
    mode=cargo
  else
    section "nothing to run"
    note "cargo is NOT installed on this machine and no prebuilt executables are here."
    note "On a machine with cargo run: scripts/gpu-session.sh --build target/gpu-prebuilt"
    note "then carry target/gpu-prebuilt here and run: scripts/gpu-session.sh --prebuilt target/gpu-prebuilt"
    return 3
  fi
fi

if [ "$mode" = cargo ]; then
  export CARGO_NET_OFFLINE=true
  note "cargo: $CARGO ($("$CARGO" -V)); offline"
  step test-zero-core "$CARGO" test -p zero-core --features cuda
  step test-nccl "$CARGO" test -p zero-comm --no-default-features --features cuda --test nccl --test nccl_device
  step test-cuda_pin "$CARGO" test -p zero-offload --features cuda --test cuda_pin
  step test-llama_cuda "$CARGO" test -p zero-llama --features cuda --test cuda_kernels --test nvrtc
  step test-llama_device_cuda "$CARGO" test -p zero-llama --features cuda --test device_cuda --test device_lora_cuda
  step test-engine_cuda "$CARGO" test -p zero --no-default-features --features cuda --test engine --test offload --test checkpoint -- ::cuda
  "$CARGO" build -q -p zero --no-default-features --features cuda --example llama_sft &&
    llama_sft_stages "$REPO/target/debug/examples/llama_sft" &&
    step llama_sft-stage3-offload "$REPO/target/debug/examples/llama_sft" --device cuda --stage 3 --offload cpu --min-accuracy 95
  "$CARGO" build -q -p zero --no-default-features --features cuda --bin zero &&
    lora_experiment "$REPO/target/debug/examples/llama_sft" "$REPO/target/debug/zero"
  # shellcheck disable=SC2086
  step bench-llama_cuda "$CARGO" bench -p zero --no-default-features --features cuda --bench llama_cuda -- \
    --json "$OUT/llama_cuda.json" ${LLAMA_BENCH_ARGS:-}
  torch_baseline
  step bench-cuda "$CARGO" bench -p zero --no-default-features --features cuda --bench cuda -- "${bench_args[@]}"
else
  dir=$(cd "$prebuilt" 2>/dev/null && pwd) || {
    note "no folder $prebuilt"
    return 3
  }
  if [ ! -f "$dir/manifest.tsv" ]; then
    note "$dir has no manifest.tsv: build it with scripts/gpu-session.sh --build $prebuilt"
    return 3
  fi
  [ -f "$dir/BUILD_INFO" ] && cat "$dir/BUILD_INFO"
  unpacked=$(mktemp -d "${TMPDIR:-/tmp}/zero-prebuilt.XXXXXX")
  tmp_dirs+=("$unpacked")
  declare -A exes=() where=()
  while IFS=$'\t' read -r name folder; do
    exe="$dir/$name.exe"
    if [ -f "$exe.gz" ]; then
      gzip -dc "$exe.gz" >"$unpacked/$name.exe" && chmod +x "$unpacked/$name.exe"
      exe="$unpacked/$name.exe"
    fi
    exes[$name]=$exe
    where[$name]="$REPO${folder:+/$folder}"
  done <"$dir/manifest.tsv"
  # run_exe NAME: the step for one executable.
  run_exe() {
    local name=$1 exe=${exes[$1]:-}
    if [ -z "$exe" ] || [ ! -x "$exe" ]; then
      summary+=("$name: MISSING (${exe:-not in the manifest})")
      failed=1
      return
    fi
    case "$name" in
      zero) step doctor "$exe" doctor ;;
      cuda-bench) step bench-cuda bash -c 'cd "$1" && shift && exec "$@"' _ "${where[$name]}" "$exe" --bench "${bench_args[@]}" ;;
      # shellcheck disable=SC2086
      llama_cuda-bench) step bench-llama_cuda "$exe" --bench --json "$OUT/llama_cuda.json" ${LLAMA_BENCH_ARGS:-} ;;
      engine_*) step "test-$name" bash -c 'cd "$1" && shift && exec "$@"' _ "${where[$name]}" "$exe" ::cuda ;;
      *) step "test-$name" bash -c 'cd "$1" && shift && exec "$@"' _ "${where[$name]}" "$exe" ;;
    esac
  }
  # Run 1, correctness: what the libraries open, the backend, the model's
  # GPU ops, the example trained with the optimizer offloaded, the engine
  # against the CPU backend, the collectives.
  if [ "$run" = all ] || [ "$run" = 1 ]; then
    for name in zero zero-core-lib cuda_adamw cuda_arena cuda_streams nvrtc backend_conformance cuda_pool \
      llama_cuda llama_cuda_nvrtc llama_device_cuda llama_device_lora_cuda; do
      run_exe "$name"
    done
    if [ -n "${exes[llama_sft]:-}" ]; then
      step llama_sft-stage3-offload "${exes[llama_sft]}" --device cuda --stage 3 --offload cpu --min-accuracy 95 \
        --metrics "$OUT/llama_sft-stage3-offload.jsonl"
    fi
    for name in engine_cuda engine_offload_cuda engine_checkpoint_cuda nccl cuda_pin nccl_device; do
      run_exe "$name"
    done
  fi
  # Run 2, speed: the ~1B Llama and PyTorch's FSDP2 on the same machine,
  # the backend's benchmark, then the example at every stage.
  if [ "$run" = all ] || [ "$run" = 2 ]; then
    run_exe llama_cuda-bench
    torch_baseline
    run_exe cuda-bench
    [ -n "${exes[llama_sft]:-}" ] && llama_sft_stages "${exes[llama_sft]}"
  fi
  # Run 3: the LoRA experiment at its full size, and PyTorch + PEFT.
  if [ "$run" = all ] || [ "$run" = 3 ]; then
    if [ -n "${exes[llama_sft]:-}" ] && [ -n "${exes[zero]:-}" ]; then
      lora_experiment "${exes[llama_sft]}" "${exes[zero]}"
    else
      summary+=("lora-experiment: NOT RUN (llama_sft or zero missing from $dir)")
    fi
  fi
fi

section "summary"
{
  echo "mode: $mode, run $run; $(($(date +%s) - started)) s"
  printf '%s\n' "${summary[@]}"
  [ -f "$OUT/doctor.log" ] && grep -E "^ *(driver|nvrtc|cublas|nccl|NVRTC|cuBLAS|NCCL|libcuda)" "$OUT/doctor.log" | head -8
  for name in test-zero-core test-zero-core-lib test-cuda_adamw test-cuda_arena test-cuda_streams test-nvrtc test-backend_conformance test-cuda_pool test-nccl test-llama_cuda test-llama_cuda_nvrtc test-llama_device_cuda test-llama_device_lora_cuda test-engine_cuda test-engine_offload_cuda test-engine_checkpoint_cuda; do
    f="$OUT/$name.log"
    [ -f "$f" ] || continue
    n=$(grep -c -E "skipped|^SKIP" "$f" || true)
    [ "$n" -gt 0 ] && echo "$name: $n skip line(s), e.g. $(grep -m1 -E "skipped|^SKIP" "$f")"
  done
  [ -f "$OUT/bench-cuda.log" ] && grep -E "skipped:|FAILED:|MISS" "$OUT/bench-cuda.log"
  [ -f "$OUT/bench-llama_cuda.log" ] && grep -E "^\||target|skipped:" "$OUT/bench-llama_cuda.log"
  [ -f "$OUT/lora-experiment.log" ] &&
    grep -E "^\| ds_|^\| PyTorch|^LoRA experiment|^steps cut|^  .*: (met|MISSED|-) \(" "$OUT/lora-experiment.log"
  for f in "$OUT"/llama_sft-stage*.log; do
    [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "^\| [0-3] \|" "$f" | head -1)"
  done
} | tee "$OUT/summary.txt"
echo "outputs: $OUT"
return "$failed"
}

session 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
