#!/usr/bin/env bash
# The experiment zero comes from, per ZeRO stage: a LoRA SFT under the four
# DeepSpeed configs of tests/fixtures/ds_*.json as they are (stage 0, 1,
# 2 + optimizer offload, 3 + optimizer and parameter offload), 2 ranks
# under mpirun, on the experiment's data format (the built-in addition
# task: `N=` -> `王大丫丫的回答是--->a + b`, held-out numbers scored), one
# after the other on this machine. Prints one table: wall time of the run,
# its ratio to stage 0, peak device and host memory per rank (the engine's
# tracker) and held-out accuracy.
#
# Usage: bash scripts/lora-experiment.sh [llama_sft flags...]
#   default flags: --lora 16 --lora-alpha 32 on all seven projections of the
#   `task` preset from its random initialisation (base frozen);
#   e.g. --model-dir DIR for a Hugging Face model, --steps N to cut it short.
# Takes ~5-10 minutes on the 2-core development machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release --example llama_sft
bin=target/release/examples/llama_sft
if [ -n "${CARGO_TARGET_DIR:-}" ]; then bin=$CARGO_TARGET_DIR/release/examples/llama_sft; fi
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(--lora 16 --lora-alpha 32 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
configs=(ds_stage0 ds_stage1 ds_stage2_offload ds_stage3_offload)
for c in "${configs[@]}"; do
  echo "== $c: mpirun -n 2 llama_sft --config tests/fixtures/$c.json ${args[*]}" >&2
  bash scripts/mpirun.sh -n 2 "$bin" --config "tests/fixtures/$c.json" "${args[@]}" >"$out/$c.log" 2>&1 || {
    tail -20 "$out/$c.log" >&2
    exit 1
  }
done
python3 - "$out" "${configs[@]}" <<'EOF'
import re, sys
out, configs = sys.argv[1], sys.argv[2:]
rows = []
for c in configs:
    text = open(f"{out}/{c}.log", encoding="utf-8").read()
    # | stage | offload | offload_param | ranks | dtype | acc. before | acc. after | time | ...
    run = re.search(r"^\| (\d) \| (\w+) \| (\w+) \| (\d+) \| (\w+) \| ([\d.]+)% \| ([\d.]+)% \| ([\d.]+) s \|", text, re.M)
    mem = re.findall(r"^\| (\d+) \| ([\d.]+) MiB \| ([\d.]+) MiB \| ([\d.]+) MiB \|", text, re.M)
    if not run or not mem:
        sys.exit(f"{c}: no result table in its output")
    rows.append((c, run, max(float(m[1]) for m in mem), max(float(m[2]) for m in mem)))
base = float(rows[0][1].group(8))
print("| config | stage | offload | offload_param | dtype | time | vs stage 0 | peak device / rank | peak host / rank | held-out accuracy |")
print("|---|---|---|---|---|---|---|---|---|---|")
for c, r, dev, host in rows:
    t = float(r.group(8))
    print(f"| {c}.json | {r.group(1)} | {r.group(2)} | {r.group(3)} | {r.group(5)} | {t:.1f} s | {t / base:.2f}x | {dev:.1f} MiB | {host:.1f} MiB | {r.group(7)}% |")
EOF
