#!/usr/bin/env python3
"""PyTorch + PEFT on the LoRA experiment's shape, batch and GPU: the baseline
beside zero's figures in `scripts/lora-experiment.sh`.

The model is `Qwen2ForCausalLM(Qwen2Config(...))` from transformers with
random weights (no download), built on the device in bf16: by default
Qwen2.5-14B's published shape (48 layers, hidden 5120, 40 heads, 8 key/value
heads, intermediate 13824, vocab 152064, q/k/v biases, rope_theta 1e6,
rms_norm_eps 1e-6, untied LM head), `--shape small` the experiment's CI shape
(zero's `--shape small`), `--model-dir DIR` a real checkpoint
(`from_pretrained`, bf16). Then as the experiment ran it: gradient
checkpointing (transformers' `gradient_checkpointing_enable`, non-reentrant),
PEFT `LoraConfig(r=8, lora_alpha=64, lora_dropout=0.01)` on the seven
projections (q, k, v, o, gate, up, down) with PEFT's defaults otherwise
(adapters in fp32, the base frozen in bf16), `torch.optim.AdamW` on the
adapters (lr 1e-4, weight decay 0.1; fused on a GPU), gradient clipping to
1.0.

A step: forward of `--batch` (16) sequences of `--seq` (51) token ids drawn
at random below 261 (zero's byte tokenizer; the values change no work), the
labels the inputs, loss, backward, clipping, the AdamW step,
`zero_grad(set_to_none=True)`. `--warmup` (1) untimed steps, then `--steps`
(5) timed ones, each between two CUDA events (wall clock on the CPU); the
median is the step time. Figures:

    tokens/s = batch × seq / median step
    MFU      = 3 × F / median step / (--peak-tflops × 1e12)

F is zero's forward count (`forward_flops` in examples/llama/src/train.rs,
every row a loss row): 2 FLOPs per multiply-add of the projections, the
attention scores and values in full, and the LM head; 3 × F is what
`llama_sft` counts for a step, so the MFUs compare. Memory:
`torch.cuda.max_memory_allocated` and `max_memory_reserved` since the model
was built (the steps' peak, model included), and the process's peak
resident host memory (`ru_maxrss`).

Without torch, transformers or peft, or (with `--device cuda`) without a
CUDA device, it prints one `peft: skipped: <reason>` line and exits 0; a run
that fails (out of memory) prints `peft: FAILED: <error>` and exits 1.
`--device cpu` runs the same on the host (a smoke test at `--shape small`).

Usage: python3 scripts/peft_baseline.py [--shape qwen2.5-14b|small]
    [--model-dir DIR] [--device cuda|cpu] [--batch 16] [--seq 51] [--steps 5]
    [--warmup 1] [--peak-tflops T] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

#: Qwen2.5-14B's config.json (the fields that shape the model).
QWEN2_5_14B = dict(
    vocab_size=152064,
    hidden_size=5120,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    intermediate_size=13824,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
#: scripts/lora-experiment.sh --shape small: the same structure, small.
SMALL = dict(
    QWEN2_5_14B,
    vocab_size=261,
    hidden_size=160,
    num_hidden_layers=4,
    num_attention_heads=10,
    num_key_value_heads=2,
    intermediate_size=432,
)
SHAPES = {"qwen2.5-14b": QWEN2_5_14B, "small": SMALL}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: zero's byte tokenizer: the ids the batches draw from.
BYTE_VOCAB = 261
GIB = float(1 << 30)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-14b")
    p.add_argument("--model-dir", help="a Hugging Face checkpoint instead of random weights")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq", type=int, default=51, help="tokens per sequence (default 51)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.4,
        help="the device's dense bf16 peak for the MFU (default 989.4: H100 SXM / H200)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    a = p.parse_args(argv)
    for k in ("batch", "seq", "steps"):
        if getattr(a, k) < 1:
            p.error(f"--{k} must be at least 1")
    if a.warmup < 0:
        p.error("--warmup must be at least 0")
    return a


def forward_flops(c: dict[str, Any], batch: int, seq: int) -> float:
    """zero's `forward_flops` with every row a loss row."""
    d, h = c["hidden_size"], c["intermediate_size"]
    hd = d // c["num_attention_heads"]
    qd, kd = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_token_block = 2.0 * (d * qd + 2 * d * kd + qd * d + 3 * d * h)
    attn = 2.0 * 2.0 * seq * seq * qd
    blocks = c["num_hidden_layers"] * (per_token_block * seq + attn)
    return batch * blocks + 2.0 * batch * seq * d * c["vocab_size"]


def skip(why: str, a: argparse.Namespace) -> int:
    print(f"peft: skipped: {why}")
    write_json(a, {"skipped": why})
    return 0


def write_json(a: argparse.Namespace, doc: dict[str, Any]) -> None:
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)


def build(a: argparse.Namespace, torch: Any, transformers: Any) -> tuple[Any, dict[str, Any]]:
    """The bf16 model on the device and the dims it has."""
    dtype = torch.bfloat16
    if a.model_dir:
        # `dtype` since transformers 4.56, `torch_dtype` before.
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, **{kw: dtype})
        model.to(a.device)
        cfg = model.config
        dims = {k: getattr(cfg, k) for k in QWEN2_5_14B if hasattr(cfg, k)}
        return model, dims
    dims = dict(SHAPES[a.shape])
    cfg = transformers.Qwen2Config(
        **dims, max_position_embeddings=max(a.seq, 128), use_cache=False
    )
    torch.manual_seed(a.seed)
    # Built where it runs, in bf16 from the start (14.8 B fp32 parameters
    # would not fit first).
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(a.device):
            model = transformers.Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model, dims


def run(a: argparse.Namespace, torch: Any, transformers: Any, peft: Any) -> dict[str, Any]:
    cuda = a.device == "cuda"
    t0 = time.perf_counter()
    model, dims = build(a, torch, transformers)
    model.config.use_cache = False
    # The name every transformers version has (5.x warns that it is renamed).
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = peft.LoraConfig(
        r=8, lora_alpha=64, lora_dropout=0.01, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(model, lcfg)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    n_all = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1, fused=cuda)
    build_s = time.perf_counter() - t0
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    ids = torch.randint(0, BYTE_VOCAB, (a.batch, a.seq), generator=g).to(a.device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    times, losses = [], []
    for i in range(a.warmup + a.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            loss = step()
            dt = time.perf_counter() - t
        losses.append(loss)
        if i >= a.warmup:
            times.append(dt)
        print(f"peft: step {i + 1}/{a.warmup + a.steps} {dt:.3f} s loss {loss:.4f}"
              + (" (warm-up)" if i < a.warmup else ""), flush=True)
    median = statistics.median(times)
    flops = 3.0 * forward_flops(dims, a.batch, a.seq)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "shape": a.model_dir or a.shape,
        "dims": dims,
        "parameters": n_all,
        "trainable": n_train,
        "batch": a.batch,
        "seq": a.seq,
        "warmup": a.warmup,
        "step_times_s": times,
        "step_s": median,
        "tokens_per_s": a.batch * a.seq / median,
        "tflops": flops / median / 1e12,
        "mfu": flops / median / (a.peak_tflops * 1e12) if cuda else None,
        "final_loss": losses[-1],
        "build_s": build_s,
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if cuda:
        out["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["device_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        import torch
    except Exception as e:  # noqa: BLE001 (ImportError, or OSError from a CUDA library)
        return skip(f"torch is not importable ({type(e).__name__}: {e})", a)
    if a.device == "cuda" and not torch.cuda.is_available():
        return skip("no CUDA device", a)
    try:
        import peft
        import transformers
    except Exception as e:  # noqa: BLE001
        return skip(f"transformers or peft is not importable ({type(e).__name__}: {e})", a)
    try:
        r = run(a, torch, transformers, peft)
    except Exception as e:  # noqa: BLE001 (out of memory, an API this version lacks)
        traceback.print_exc()
        print(f"peft: FAILED: {type(e).__name__}: {e}")
        write_json(a, {"failed": f"{type(e).__name__}: {e}"})
        return 1
    mem = ""
    if "device_peak_allocated_bytes" in r:
        mem = (f", peak device {r['device_peak_allocated_bytes'] / GIB:.2f} GiB allocated"
               f" / {r['device_peak_reserved_bytes'] / GIB:.2f} GiB reserved")
    mfu = f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
    print(
        f"peft: {r['device']}, {r['parameters']} parameters ({r['trainable']} trainable), "
        f"batch {a.batch} x {a.seq}: step {r['step_s']:.3f} s (median of {a.steps} after "
        f"{a.warmup} warm-up), {r['tokens_per_s']:.0f} tokens/s{mfu}{mem}, peak host "
        f"{r['host_peak_bytes'] / GIB:.2f} GiB, final loss {r['final_loss']:.4f}"
    )
    write_json(a, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
