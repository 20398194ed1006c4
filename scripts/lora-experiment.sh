#!/usr/bin/env bash
# The experiment zero comes from, as one command: a LoRA SFT of Qwen2.5-14B
# under the four DeepSpeed configs of tests/fixtures/ds_*.json as they are
# (stage 0, 1, 2 + optimizer offload, 3 + optimizer and parameter offload),
# with the experiment's hyperparameters: LoRA r 8, alpha 64, dropout 0.01 on
# the seven projections; 16 sequences of 51 tokens per rank; activation
# checkpointing; bf16; AdamW lr 1e-4, cosine decay after 3% warmup, weight
# decay 0.1; one epoch of the addition task's 1798 training numbers. The
# configs run one after the other, each with its ranks as threads of one
# llama_sft process; then PyTorch + PEFT on the same shape, batch and device
# (scripts/peft_baseline.py). Prints one table: step time after the warm-up
# step and the epoch's time, the ratio to stage 0, peak device and host
# memory per rank (the engine's tracker; beside it `zero estimate`'s device
# figure), tokens/s, MFU and the final loss; then the issue's targets, met
# or missed.
#
# Usage: bash scripts/lora-experiment.sh [options] [-- llama_sft flags...]
#   --device cpu|cuda     where the model computes (default cpu)
#   --shape small|qwen2.5-14b
#                         the model: Qwen2.5-14B's published shape (48 layers,
#                         hidden 5120, 40 heads, 8 kv heads, intermediate
#                         13824, vocab 152064, q/k/v biases, rope_theta 1e6)
#                         with random weights, or `small`, its structure at
#                         width 160, 4 layers, the byte vocabulary (default:
#                         small on the CPU, qwen2.5-14b on cuda)
#   --model-dir DIR       a Hugging Face checkpoint instead (its weights,
#                         tokenizer and chat template)
#   --steps N             N steps per config instead of the epoch (the epoch's
#                         time is then projected from the step time)
#   --ranks N             ranks per config (default: 2 where `zero estimate`
#                         says two fit the device and the host, else 1)
#   --bin PATH, --zero PATH
#                         prebuilt llama_sft and zero executables (the GPU
#                         kit); default: built with cargo (the dev profile,
#                         `--features cuda` for cuda)
#   --peft / --no-peft    run the PyTorch + PEFT baseline (default: on cuda)
#   --timeout S           stop a config (or the baseline) after S seconds:
#                         it counts as failed, the others still run
#   --out DIR             keep every log, metrics file and the table here
#
# Without --model-dir the token ids are the byte tokenizer's (the task's
# prompt `N=` and answer `王大丫丫的回答是--->a + b` in its chat template:
# at most 47 tokens, padded to 51) inside the 152064-row embedding: no
# Qwen tokenizer is needed offline; the work per step is the experiment's.
# The small shape on 2 cores: about a minute for the four configs.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."

usage() {
  sed -n "/^# Usage:/,/^#$/p" "$0" >&2
  exit 2
}
device=cpu
shape=""
model_dir=""
steps=""
ranks=""
bin=""
zero=""
peft=""
out=""
limit=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:-}; shift ;;
    --shape) shape=${2:-}; shift ;;
    --model-dir) model_dir=${2:-}; shift ;;
    --steps) steps=${2:-}; shift ;;
    --ranks) ranks=${2:-}; shift ;;
    --bin) bin=${2:-}; shift ;;
    --zero) zero=${2:-}; shift ;;
    --peft) peft=1 ;;
    --no-peft) peft=0 ;;
    --out) out=${2:-}; shift ;;
    --timeout) limit=${2:-}; shift ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) usage ;;
    *) echo "lora-experiment: unknown option $1" >&2; usage ;;
  esac
  shift
done
case "$device" in cpu | cuda) ;; *) echo "lora-experiment: --device cpu or cuda, not '$device'" >&2; exit 2 ;; esac
if [ -z "$shape" ]; then
  if [ "$device" = cuda ]; then shape=qwen2.5-14b; else shape=small; fi
fi
case "$shape" in small | qwen2.5-14b) ;; *) echo "lora-experiment: --shape small or qwen2.5-14b, not '$shape'" >&2; exit 2 ;; esac
for n in "$steps" "$ranks" "$limit"; do
  if [ -n "$n" ] && ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
    echo "lora-experiment: --steps, --ranks and --timeout take a whole number of at least 1, not '$n'" >&2
    exit 2
  fi
done
# Paths are the caller's: relative ones from where it ran.
absolute() { case "$1" in "" | /*) echo "$1" ;; *) echo "$caller/$1" ;; esac; }
model_dir=$(absolute "$model_dir")
bin=$(absolute "$bin")
zero=$(absolute "$zero")
out=$(absolute "$out")
[ -n "$peft" ] || peft=$([ "$device" = cuda ] && echo 1 || echo 0)
if [ -n "$model_dir" ] && [ ! -f "$model_dir/config.json" ]; then
  echo "lora-experiment: --model-dir $model_dir: no config.json there" >&2
  exit 2
fi

# The executables.
if [ -z "$bin" ] || [ -z "$zero" ]; then
  features=()
  [ "$device" = cuda ] && features=(--no-default-features --features cuda)
  cargo build -q "${features[@]}" --example llama_sft --bin zero
  tgt=${CARGO_TARGET_DIR:-target}
  bin=${bin:-$tgt/debug/examples/llama_sft}
  zero=${zero:-$tgt/debug/zero}
fi
for x in "$bin" "$zero"; do
  [ -x "$x" ] || { echo "lora-experiment: $x is not an executable" >&2; exit 2; }
done

if [ -n "$out" ]; then
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi

# The model: its llama_sft flags and its dims for `zero estimate`.
if [ -n "$model_dir" ]; then
  model=(--model-dir "$model_dir")
  read -r hidden inter layers heads kv vocab < <(python3 - "$model_dir/config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1], encoding="utf-8"))
print(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
      c.get("num_key_value_heads", c["num_attention_heads"]), c["vocab_size"])
EOF
  )
  seq=51
elif [ "$shape" = qwen2.5-14b ]; then
  model=(--model qwen2.5-14b --seq-len 51)
  read -r hidden inter layers heads kv vocab seq <<<"5120 13824 48 40 8 152064 51"
else
  model=(--model qwen2.5-14b --dim 160 --layers 4 --heads 10 --kv-heads 2 --hidden 432 --vocab 261 --seq-len 51)
  read -r hidden inter layers heads kv vocab seq <<<"160 432 4 10 2 261 51"
fi

configs=(ds_stage0 ds_stage1 ds_stage2_offload ds_stage3_offload)
setup_of() {
  case "$1" in
    ds_stage0) echo "--stage 0" ;;
    ds_stage1) echo "--stage 1" ;;
    ds_stage2_offload) echo "--stage 2 --offload cpu" ;;
    ds_stage3_offload) echo "--stage 3 --offload cpu --offload-param cpu" ;;
  esac
}

# `zero estimate`'s per-rank peaks (device, host, GiB) of config $1 on $2 ranks.
estimate() {
  local dev_flag=()
  [ "$device" = cuda ] && dev_flag=(--device)
  # shellcheck disable=SC2046
  "$zero" estimate --config "tests/fixtures/$1.json" $(setup_of "$1") --dtype bf16 \
    --hidden "$hidden" --intermediate "$inter" --layers "$layers" --heads "$heads" --kv-heads "$kv" \
    --vocab "$vocab" --lora-rank 8 --lora-dropout --world "$2" --micro 16 --seq-len "$seq" \
    --activation-checkpointing "${dev_flag[@]}" >"$out/$1.estimate-$2.txt" 2>&1 || {
    echo "lora-experiment: zero estimate failed for $1:" >&2
    cat "$out/$1.estimate-$2.txt" >&2
    return 1
  }
  python3 - "$out/$1.estimate-$2.txt" <<'EOF'
import re, sys
units = {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 1024.0}
peak = {"device": 0.0, "host": 0.0}
for line in open(sys.argv[1], encoding="utf-8"):
    m = re.search(r"\b(device|host)\s+([\d.]+) (B|KiB|MiB|GiB|TiB)\b", line)
    if m:
        peak[m.group(1)] = float(m.group(2)) * units[m.group(3)]
print(f"{peak['device']:.3f} {peak['host']:.3f}")
EOF
}

# The memory there is, GiB: the device's (GPU 0) and the host's available.
host_gib=$(awk '/^MemAvailable:/ { printf "%.1f", $2 / 1048576 }' /proc/meminfo)
gpu_gib=""
if [ "$device" = cuda ] && command -v nvidia-smi >/dev/null; then
  gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null |
    awk '{ printf "%.1f", $1 / 1024 }' || true)
fi
# Whether $1 ranks fit: every config's estimate times the ranks within 92%
# of the GPU and 85% of the host's available memory (on the CPU both tiers
# are host memory).
fits() {
  local c d h est
  for c in "${configs[@]}"; do
    est=$(estimate "$c" "$1") || exit 1
    read -r d h <<<"$est"
    if ! python3 -c "
import sys
n, d, h, host = $1, $d, $h, $host_gib
gpu = '$gpu_gib'
ok = n * h <= 0.85 * host if gpu else n * (d + h) <= 0.85 * host
ok = ok and (not gpu or n * d <= 0.92 * float(gpu))
sys.exit(0 if ok else 1)"; then
      echo "lora-experiment: $c on $1 rank(s): the estimate ($d GiB device, $h GiB host per rank) does not fit" \
        "(${gpu_gib:+GPU $gpu_gib GiB, }host $host_gib GiB available)" >&2
      return 1
    fi
  done
}
if [ -z "$ranks" ]; then
  if [ "$device" = cuda ] && [ -z "$gpu_gib" ]; then
    echo "lora-experiment: nvidia-smi gives no GPU memory: 1 rank" >&2
    ranks=1
  elif fits 2; then
    ranks=2
  elif fits 1; then
    ranks=1
  else
    echo "lora-experiment: not even 1 rank fits this machine by the estimate; --ranks N runs anyway" >&2
    exit 1
  fi
fi
for c in "${configs[@]}"; do
  est=$(estimate "$c" "$ranks") || exit 1
  echo "$est" >"$out/$c.estimate"
done
echo "lora-experiment: $ranks rank(s) per config (GPU ${gpu_gib:--} GiB, host $host_gib GiB available)" >&2

lora=(--lora 8 --lora-alpha 64 --lora-dropout 0.01
  --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)
recipe=(--batch 16 --activation-checkpointing --dtype bf16 --lr 1e-4 --weight-decay 0.1 --epochs 1)
[ -n "$steps" ] && recipe+=(--steps "$steps")
limited=()
[ -n "$limit" ] && limited=(timeout -k 10 "$limit")
failed=0
for c in "${configs[@]}"; do
  args=(--config "tests/fixtures/$c.json" --device "$device" --ranks "$ranks" "${model[@]}" "${lora[@]}"
    "${recipe[@]}" --skip-eval --metrics "$out/$c.jsonl" "${extra[@]}")
  echo "== $c: llama_sft ${args[*]}" >&2
  t0=$(date +%s)
  if "${limited[@]}" "$bin" "${args[@]}" >"$out/$c.log" 2>&1; then
    echo "   done in $(($(date +%s) - t0)) s:" >&2
    # Its own report's rows, before the table (a later config may run out of time).
    grep -E "^device:|^\| [0-3] \||^\| [0-9]+ \| [0-9.]+ MiB" "$out/$c.log" >&2 || true
  else
    echo "   FAILED (exit $?) after $(($(date +%s) - t0)) s; its last lines:" >&2
    tail -15 "$out/$c.log" >&2
    failed=1
  fi
done
if [ "$peft" = 1 ]; then
  pargs=(--device "$device" --batch 16 --seq "$seq" --json "$out/peft.json")
  if [ -n "$model_dir" ]; then pargs+=(--model-dir "$model_dir"); else pargs+=(--shape "$shape"); fi
  echo "== PyTorch + PEFT: python3 scripts/peft_baseline.py ${pargs[*]}" >&2
  "${limited[@]}" python3 scripts/peft_baseline.py "${pargs[@]}" >"$out/peft.log" 2>&1 || {
    rc=$?
    failed=1
    tail -15 "$out/peft.log" >&2
    # No result of its own: say why in the table.
    [ -s "$out/peft.json" ] || printf '{"failed": "exit %s%s (see peft.log)"}\n' "$rc" \
      "$([ "$rc" = 124 ] && echo ": stopped by --timeout $limit s")" >"$out/peft.json"
  }
  grep -E "^peft: (skipped|FAILED)" "$out/peft.log" >&2 || true
fi

python3 - "$out" "$device" "$shape" "${model_dir:--}" "${steps:-}" "${configs[@]}" <<'EOF' | tee "$out/table.md"
import json, os, re, sys

out, device, shape, model_dir, steps_flag, configs = (
    sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:])
GIB = 1024.0


def parse(c):
    """One config's figures from its log and metrics, or None when it failed."""
    log = open(f"{out}/{c}.log", encoding="utf-8").read()
    run = re.search(r"^\| (\d) \| (\w+) \| (\w+) \| (\d+) \| (\w+) \| [^|]+ \| [^|]+ \| ([\d.]+) s \| "
                    r"([\d.]+) \| ([\d.]+) \| ([\d.]+|NaN|inf)%", log, re.M)
    if not run:
        return None
    data = re.search(r"^data: (\d+) training samples.*; (\d+) steps of (\d+) samples", log, re.M)
    mem = re.findall(r"^\| (\d+) \| ([\d.]+) MiB \| ([\d.]+) MiB \| [\d.]+ MiB \| [\d.]+ MiB \| "
                     r"([\d.]+ MiB|-) \|", log, re.M)
    coll = re.search(r"device collectives (.*)$", log, re.M)
    gpus = re.search(r"^device: GPU \d+ of (\d+)", log, re.M)
    steps = [json.loads(l) for l in open(f"{out}/{c}.jsonl", encoding="utf-8")]
    steps = [s for s in steps if "step_time_s" in s]
    timed = steps[1:] if len(steps) > 1 else steps
    step = sum(s["step_time_s"] for s in timed) / len(timed)
    tokens = sum(s["tokens_per_s"] * s["step_time_s"] for s in timed) / (step * len(timed))
    train_time = float(run.group(6))
    mfu = float(run.group(9)) / 100 if run.group(9) not in ("NaN", "inf") else float("nan")
    # The report's MFU is over every step; the flops of a step over its time
    # after the warm-up step.
    mfu = mfu * train_time / len(steps) / step
    samples, per_step = int(data.group(1)), int(data.group(3))
    epoch_steps = samples // per_step
    driver = [float(m[3].split()[0]) for m in mem if m[3] != "-"]
    est_dev, est_host = (float(x) for x in open(f"{out}/{c}.estimate").read().split())
    return {
        "stage": run.group(1), "offload": run.group(2), "offload_param": run.group(3),
        "ranks": int(run.group(4)), "dtype": run.group(5), "steps": len(steps),
        "epoch_steps": epoch_steps, "step": step,
        "epoch": train_time if len(steps) >= epoch_steps else step * epoch_steps,
        "measured": len(steps) >= epoch_steps, "tokens": tokens, "mfu": mfu,
        "dev": max(float(m[1]) for m in mem) / GIB, "host": max(float(m[2]) for m in mem) / GIB,
        "driver": max(driver) / GIB if driver else None, "est_dev": est_dev,
        "loss": steps[-1]["loss"], "collectives": coll.group(1) if coll else None,
        "micro": per_step // int(run.group(4)),
        # Ranks on one device: the GPUs in turn, or the host's cores.
        "sharing": -(-int(run.group(4)) // int(gpus.group(1))) if gpus else int(run.group(4)),
    }


rows = {c: parse(c) for c in configs}
peft = None
if os.path.exists(f"{out}/peft.json"):
    peft = json.load(open(f"{out}/peft.json", encoding="utf-8"))
ok = [r for r in rows.values() if r]
first = ok[0] if ok else None
if first:
    what = (f"--model-dir {model_dir}" if model_dir != "-" else
            "Qwen2.5-14B's published shape, random weights" if shape == "qwen2.5-14b" else
            "Qwen2.5-14B's structure at width 160, 4 layers, byte vocabulary (the small shape)")
    print(f"LoRA experiment on {device}: {what}; {first['ranks']} rank(s) as threads of one process"
          + (f", device collectives {first['collectives']}" if first["collectives"] else "")
          + (" (the ranks share one GPU)" if first["collectives"] and "host" in first["collectives"] else ""))
    if model_dir == "-":
        print("token ids: the byte tokenizer's (the task in its chat template, padded to 51 tokens)"
              + (" inside the 152064-row embedding" if shape == "qwen2.5-14b" else ""))
    if not first["measured"]:
        print(f"steps cut: {first['steps']} per config of the epoch's {first['epoch_steps']}; "
              "the epoch's time is projected from the step time after the warm-up step")
    print()


def gib(x):
    if x is None:
        return "-"
    return f"{x:.2f} GiB" if x >= 1 else f"{x * 1024:.1f} MiB"



# The driver's figure (all ranks' processes on the GPU) where there is one.
driver = any(r["driver"] is not None for r in ok) or (peft and "device_peak_reserved_bytes" in peft)


def cells(*xs):
    """A table row; the driver's column (the 11th) only where there is one."""
    xs = list(xs)
    if not driver:
        del xs[10]
    return "| " + " | ".join(str(x) for x in xs) + " |"


print(cells("config", "stage", "offload", "offload_param", "steps", "step (after step 1)", "epoch",
            "vs stage 0", "peak device / rank", "estimate", "GPU in use (driver)", "peak host / rank",
            "tokens/s", "MFU", "final loss"))
print(cells(*["---"] * 15))
base = rows[configs[0]]
for c in configs:
    r = rows[c]
    if not r:
        print(cells(f"{c}.json", f"FAILED (see {c}.log)", *[""] * 13))
        continue
    ratio = f"{r['step'] / base['step']:.2f}x" if base else "-"
    epoch = f"{r['epoch']:.1f} s" + ("" if r["measured"] else " (projected)")
    print(cells(f"{c}.json", r["stage"], r["offload"], r["offload_param"], r["steps"],
                f"{r['step']:.3f} s", epoch, ratio, gib(r["dev"]), gib(r["est_dev"]), gib(r["driver"]),
                gib(r["host"]), f"{r['tokens']:.0f}", f"{100 * r['mfu']:.1f}%", f"{r['loss']:.4f}"))
if peft and "step_s" in peft:
    mfu = f"{100 * peft['mfu']:.1f}%" if peft.get("mfu") is not None else "-"
    dev = peft.get("device_peak_allocated_bytes")
    res = peft.get("device_peak_reserved_bytes")
    print(cells(f"PyTorch + PEFT (1 process, {peft['batch']} sequences)", "-", "-", "-",
                len(peft["step_times_s"]), f"{peft['step_s']:.3f} s", "-", "-",
                gib(dev / 2**30 if dev else None), "-",
                gib(res / 2**30 if res else None) + (" (reserved)" if res else ""),
                gib(peft["host_peak_bytes"] / 2**30), f"{peft['tokens_per_s']:.0f}", mfu,
                f"{peft['final_loss']:.4f}"))
elif peft:
    print(f"\nPyTorch + PEFT: {peft.get('skipped') and 'skipped: ' + peft['skipped'] or 'FAILED: ' + str(peft.get('failed'))}")
print()
print("DeepSpeed in the experiment (2 GPUs, Qwen2.5-14B-Instruct): 1 min 54 s at stages 0, 1 and 2, "
      "12 min at stage 3 with optimizer and parameter offload (6.3x).")
s0, s2, s3 = (rows.get(c) for c in ("ds_stage0", "ds_stage2_offload", "ds_stage3_offload"))
where = "" if device == "cuda" else " (the targets are the GPU's; this run is on the CPU)"
print(f"targets{where}:")


def target(name, ok, detail):
    print(f"  {name}: {'-' if ok is None else 'met' if ok else 'MISSED'} ({detail})")


if s0 and s3:
    target("stage 3 + optimizer and parameter offload <= 1.3x stage 0", s3["step"] <= 1.3 * s0["step"],
           f"{s3['step'] / s0['step']:.2f}x")
else:
    target("stage 3 + optimizer and parameter offload <= 1.3x stage 0", None, "a config failed")
if s2 and s3:
    target("stage 3's peak device memory per rank <= stage 2's", s3["dev"] <= s2["dev"],
           f"{gib(s3['dev'])} vs {gib(s2['dev'])}")
else:
    target("stage 3's peak device memory per rank <= stage 2's", None, "a config failed")
if s0 and peft and "step_s" in peft:
    # Per `batch` sequences on one device: a step of each rank sharing it.
    mine = s0["step"] * peft["batch"] / (s0["micro"] * s0["sharing"])
    target("zero's LoRA step <= PyTorch + PEFT's", mine <= peft["step_s"],
           f"stage 0: {mine:.3f} s per {peft['batch']} sequences on the device vs {peft['step_s']:.3f} s")
else:
    target("zero's LoRA step <= PyTorch + PEFT's", None, "PyTorch + PEFT did not run")
EOF
exit "$failed"
