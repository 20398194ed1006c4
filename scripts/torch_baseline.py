#!/usr/bin/env python3
"""PyTorch on the same GPU as zero's measurements: the baselines of the CUDA
issue, in the same command as `benches/cuda.rs` and `llama_sft --device cuda`.

| section | measured | baseline / ratio |
|---|---|---|
| `adamw` | `torch.optim.AdamW(fused=True)` (and `foreach=True`, for information) on one fp32 parameter | D2D copy moving the same bytes |
| `fsdp` | FSDP2 `fully_shard` on a `LlamaForCausalLM`, without and with `CPUOffloadPolicy(pin_memory=True)` | offload step ÷ no-offload step |

**adamw** (`--elems N`, default 50M; `--reps R`, default 20): the definitions
of benches/cuda.rs's `adamw` section, so the figures sit next to `GpuAdamW`'s
"fp32 state + fp32 grad" row. One fp32 parameter p of N elements with an fp32
gradient g (p[i] = ((i mod 1000) − 500)·1e-3, g[i] = (i mod 7)·1e-3, as the
Rust bench), lr 1e-3, torch's defaults otherwise (betas 0.9/0.999, eps 1e-8,
weight decay 0.01). An AdamW step reads p, g, m, v and writes p, m, v: 7 × 4 =
28 bytes per element, the traffic T = 28·N. The baseline is a device-to-device
copy `dst.copy_(src)` of T/2 = 14·N bytes (it reads them and writes them: the
same total traffic) on the same stream. Optimizer and copy alternate rep by
rep after 3 warm-ups of each (the warm-ups also create m and v); each sample
is k back-to-back calls of one of them between two CUDA events, the stream
idle before and after, k = ⌈4 GB / T⌉ clamped to 1..200 (3 for 50M), which
spreads one launch latency over the sample. Per-call time = sample ÷ k; the
medians over the reps are compared:

    GB/s     = T / median time / 1e9     (10⁹ bytes per second)
    fraction = copy median ÷ optimizer median   (= the optimizer's GB/s over the copy's)

A fused step is torch's multi-tensor fused kernel plus a one-element
`_foreach_add_` of its step counter; both are in the timed call, as are
torch's host-side costs of `optimizer.step()` (which the back-to-back calls
hide when the kernel is longer than them). The `foreach` row (torch's
default implementation on CUDA: several multi-tensor kernels, more than 28
bytes/element of real traffic) is timed the same way and its GB/s uses the
same T: an effective rate, for information.

**fsdp**: `LlamaForCausalLM(LlamaConfig(...))` from transformers, random
initialisation, no download (default ~1.1 B parameters: hidden 2048, 22
layers, 32 heads, 8 key/value heads, intermediate 5632, vocab 32000,
max_position_embeddings = seq, untied embeddings; every dim is a flag). The
model is built on the GPU in fp32; `fully_shard` is applied to every decoder
layer and then to the root, on a 1-D device mesh of all ranks, with
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: the
sharded parameters, the gradients and AdamW's moments stay fp32 (the master
state), forward and backward run on bf16 copies gathered per layer, and
gradients are reduced in fp32 — the usual FSDP2 recipe, and the state layout
of zero (fp32 master + bf16 compute, fp32 reduction). Two runs, one after the
other in the same process:

* `no offload`: everything on the GPU (`OffloadPolicy()`, FSDP2's default);
* `cpu offload`: `CPUOffloadPolicy(pin_memory=True)`: sharded parameters,
  gradients and optimizer state in pinned host memory, copied to the GPU
  before each all-gather, gradients copied back in backward, the AdamW step
  on the CPU. (That is ZeRO-3 with both `offload_param` and
  `offload_optimizer` to cpu, more than the optimizer offload alone.)

Each step: forward on a random batch of `--batch` × `--seq` token ids per rank
(labels = inputs; transformers shifts them), loss, backward, gradient
clipping to `--clip` (default 1.0 as zero's llama_sft; 0 turns it off),
`AdamW(lr=1e-4)` step, `zero_grad(set_to_none=True)`. The optimizer is
`fused=True` when torch accepts it for these parameters (DTensors, on the GPU
or in host memory); otherwise torch's default implementation, and the report
says which and why. Clipping is `torch.nn.utils.clip_grad_norm_`; where it
fails (with CPU offload some torch versions all-reduce a CPU scalar over NCCL),
a local-shard norm whose square is all-reduced on the GPU, and the report says
so. Activation checkpointing is off unless `--checkpointing` (then
transformers' `gradient_checkpointing_enable`, non-reentrant, per decoder
layer). Step time is wall time from a `torch.cuda.synchronize()` before the
step to one after it (the CPU optimizer's time included), the median of
`--steps` steps after `--warmup` untimed ones; with several ranks the slowest
rank's time per step. Derived figures:

    tokens/s  = batch × seq × world / median step
    FLOPs     = 6 × P_mm × batch × seq  +  12 × layers × seq² × A × batch   per rank and step
    TFLOP/s   = FLOPs × world / median step / 1e12
    MFU       = FLOPs / median step / (--peak-tflops × 1e12)        per GPU

P_mm is the parameters that take part in a matrix product: the weights of
every `nn.Linear` (q, k, v, o, gate, up, down and the LM head; not the
embedding lookup nor the norms); A = heads × head_dim (= hidden). The second
term is attention's two seq × seq products (QKᵀ and PV, 2 × 2·seq²·A FLOPs a
layer forward, × 3 for forward + backward, causal masking not discounted).
This is zero's count (`3 × forward_flops` in examples/llama/src/train.rs), so
the MFUs compare. `--peak-tflops` defaults to 989.4, the dense bf16 datasheet
figure of the H100 SXM and H200 (an H100 PCIe is 756). Memory:
`torch.cuda.max_memory_allocated` (tensors) and `max_memory_reserved`
(the caching allocator's segments; what the device sees of PyTorch, less
the CUDA context), peaks since the reset after set-up (model built, sharded,
optimizer made; the first step allocates the moments), the largest of the
ranks; `memory_allocated` after set-up; the process's peak resident host
memory (`ru_maxrss`, over the process's life so far). The ratio reported is
cpu offload median step ÷ no offload median step.

Several ranks: launch under `torchrun --nproc-per-node G`; every rank runs the
model on its own batch, rank 0 prints and writes the JSON; the `adamw`
section runs on rank 0 only. Alone, the script makes a 1-rank process group
itself (backend nccl, env:// with MASTER_ADDR=127.0.0.1 and a free port).
With several ranks a run that fails on one rank only (out of memory there)
leaves the others waiting in a collective until NCCL's 10-minute timeout.

The default model, checked on the meta device with transformers 5.24:
1,123,117,056 parameters, P_mm = 1,057,488,896, so 6.10e13 FLOPs a step at
batch 4 × seq 2048 (40% MFU of 989.4 TFLOP/s would be 0.154 s a step).
Memory at those settings, estimated: fp32 parameters, gradients and moments
16 B × 1.12 B ≈ 18 GB, bf16 activations without checkpointing roughly 20–25 GB: it
fits an 80 GB H100 without `--checkpointing`.

Output: tables on stdout and every figure in the JSON file (`--json`, default
torch_baseline.json), with torch, CUDA, cuDNN, NCCL and transformers versions,
the GPU's name, memory and compute capability. Without torch or a CUDA device
each section prints one `<section>: skipped: <reason>` line and the script
exits 0. A section (or one fsdp run) that fails — out of memory, an API this
torch lacks — prints `FAILED:` with the error, is recorded in the JSON, and
the script goes on; the exit status is then 1.

Usage: python3 scripts/torch_baseline.py [--only adamw,fsdp] [--json PATH]
    [--elems N] [--reps R] [--batch B] [--seq S] [--steps N] [--warmup N]
    [--hidden-size H] [--num-hidden-layers L] [--num-attention-heads NH]
    [--num-key-value-heads KV] [--intermediate-size I] [--vocab-size V]
    [--tie-embeddings] [--attn IMPL] [--checkpointing] [--clip C] [--lr LR]
    [--peak-tflops T]
  torchrun --nproc-per-node G scripts/torch_baseline.py [same options]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import resource
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import torch

    TORCH_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 (ImportError, or OSError from a broken CUDA library)
    torch = None
    TORCH_ERROR = f"torch is not importable ({type(e).__name__}: {e})"

SECTIONS = ("adamw", "fsdp")
#: Untimed rounds before the timed ones in the adamw section (as benches/cuda.rs).
ADAMW_WARMUP = 3
#: Bytes an fp32 AdamW step reads and writes per element: p, g, m, v read; p, m, v written.
ADAMW_BYTES_PER_ELEM = 28
#: A timed adamw sample moves at least this many bytes (at most MAX_LAUNCHES calls).
SAMPLE_BYTES = 4e9
MAX_LAUNCHES = 200
#: The dense bf16 tensor-core peak of an H100 SXM / H200 (datasheet, no sparsity).
DEFAULT_PEAK_TFLOPS = 989.4
GIB = float(1 << 30)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="PyTorch baselines next to zero's GPU figures: fused AdamW against a "
        "D2D copy, FSDP2 fully_shard on a LlamaForCausalLM with and without CPU offload. "
        "The module docstring defines every figure.",
    )
    p.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help="sections to run, comma-separated: adamw,fsdp (default both)",
    )
    p.add_argument(
        "--json",
        default="torch_baseline.json",
        metavar="PATH",
        help="where the JSON goes (default torch_baseline.json)",
    )
    g = p.add_argument_group("adamw")
    g.add_argument("--elems", type=int, default=50_000_000, help="parameter elements (default 50M)")
    g.add_argument("--reps", type=int, default=20, help="timed samples of each (default 20)")
    g = p.add_argument_group("fsdp")
    g.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    g.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    g.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    g.add_argument("--hidden-size", type=int, default=2048)
    g.add_argument("--num-hidden-layers", type=int, default=22)
    g.add_argument("--num-attention-heads", type=int, default=32)
    g.add_argument("--num-key-value-heads", type=int, default=8)
    g.add_argument("--intermediate-size", type=int, default=5632)
    g.add_argument("--vocab-size", type=int, default=32000)
    g.add_argument(
        "--tie-embeddings", action="store_true", help="tie_word_embeddings (default untied)"
    )
    g.add_argument(
        "--attn",
        default=None,
        metavar="IMPL",
        help="transformers attn_implementation (default: transformers' choice, "
        "sdpa in recent versions)",
    )
    g.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing per decoder layer (default off)",
    )
    g.add_argument(
        "--clip",
        type=float,
        default=1.0,
        help="gradient clipping max norm; 0 turns it off (default 1.0)",
    )
    g.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=DEFAULT_PEAK_TFLOPS,
        help="the GPU's dense bf16 peak for the MFU (default 989.4: H100 SXM, H200)",
    )
    a = p.parse_args(argv)

    sections = [s.strip() for s in a.only.split(",") if s.strip()]
    for s in sections:
        if s not in SECTIONS:
            p.error(f"--only: unknown section `{s}` (known: {', '.join(SECTIONS)})")
    if not sections:
        p.error("--only: no section named")
    a.sections = list(dict.fromkeys(sections))
    positive = (
        "elems",
        "reps",
        "batch",
        "seq",
        "steps",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    )
    for name in positive:
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must not be negative, not {a.warmup}")
    if a.hidden_size % a.num_attention_heads != 0:
        p.error(
            f"--num-attention-heads ({a.num_attention_heads}) must divide "
            f"--hidden-size ({a.hidden_size})"
        )
    if a.num_attention_heads % a.num_key_value_heads != 0:
        p.error(
            f"--num-key-value-heads ({a.num_key_value_heads}) must divide "
            f"--num-attention-heads ({a.num_attention_heads})"
        )
    if a.peak_tflops <= 0:
        p.error(f"--peak-tflops must be positive, not {a.peak_tflops}")
    if a.clip < 0:
        p.error(f"--clip must not be negative, not {a.clip}")
    return a


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


class Skip(Exception):
    """A section that cannot run here (no torch, no GPU): a reason, not a failure."""


@dataclass
class Stats:
    """Median, min and max of durations in seconds (the median as benches/cuda.rs:
    the element at len/2 of the sorted samples)."""

    median: float
    min: float
    max: float

    @staticmethod
    def of(times: list[float]) -> Stats:
        v = sorted(times)
        if not v:
            return Stats(math.nan, math.nan, math.nan)
        return Stats(v[len(v) // 2], v[0], v[-1])

    def json(self) -> dict[str, float]:
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max}


def gbps(nbytes: float, secs: float) -> float:
    """10⁹ bytes per second."""
    return nbytes / secs / 1e9


def launches_for(traffic: int) -> int:
    """Calls per timed sample for work moving `traffic` bytes: enough for 4 GB, 1..200."""
    return int(min(max(math.ceil(SAMPLE_BYTES / max(traffic, 1)), 1), MAX_LAUNCHES))


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def gib(nbytes: float) -> float:
    return nbytes / GIB


def host_maxrss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------


@dataclass
class Ranks:
    """This process's place: under torchrun from its environment, else rank 0 of 1."""

    rank: int
    world: int
    local_rank: int
    launched: bool  # under torchrun (or another env:// launcher)

    @staticmethod
    def from_env() -> Ranks:
        env = os.environ
        if "WORLD_SIZE" in env and "RANK" in env:
            rank = int(env["RANK"])
            return Ranks(rank, int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", rank)), True)
        return Ranks(0, 1, 0, False)

    @property
    def lead(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(r: Ranks) -> None:
    """NCCL over env://: torchrun's variables, or a 1-rank group on a free local port."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if not r.launched:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group(
        backend="nccl",
        init_method="env://",
        rank=r.rank,
        world_size=r.world,
        timeout=datetime.timedelta(minutes=10),
    )


def max_over_ranks(values: list[float], r: Ranks, device: Any) -> list[float]:
    """Element-wise maximum of `values` over the ranks (themselves with one rank)."""
    if r.world == 1 or not values:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


# ---------------------------------------------------------------------------
# The machine and the libraries
# ---------------------------------------------------------------------------


def import_transformers() -> tuple[ModuleType | None, str | None]:
    """transformers, or why it cannot be imported."""
    try:
        import transformers

        return transformers, None
    except Exception as e:  # noqa: BLE001 (any import failure is a reason to skip)
        return None, f"transformers is not importable ({one_line(e)})"


def nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001 (a version unknown is reported, not fatal)
        return f"unknown ({one_line(e)})"
    if isinstance(v, tuple):
        return ".".join(str(x) for x in v)
    if isinstance(v, int):  # older torch: 2.18.3 as 21803
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return str(v)


def environment(r: Ranks) -> dict[str, Any]:
    """Versions, GPUs and host: what the figures were measured on."""
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "ranks": r.world,
        "launched_by": "torchrun (env://)" if r.launched else "this script (1 rank)",
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    try:
        env["host_memory_gib"] = gib(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    if torch is None:
        env["torch"] = TORCH_ERROR
        return env
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception as e:  # noqa: BLE001 (a version unknown is reported, not fatal)
        env["cudnn"] = f"unknown ({one_line(e)})"
    tf, why = import_transformers()
    env["transformers"] = tf.__version__ if tf is not None else why
    if torch.cuda.is_available():
        env["nccl"] = nccl_version()
        gpus = []
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": prop.name,
                    "memory_gib": gib(prop.total_memory),
                    "compute_capability": f"{prop.major}.{prop.minor}",
                    "multiprocessors": prop.multi_processor_count,
                }
            )
        env["gpus"] = gpus
    return env


def cuda_device(r: Ranks) -> Any:
    """This rank's GPU, made current; Skip without torch or CUDA."""
    if torch is None:
        raise Skip(TORCH_ERROR)
    if not torch.cuda.is_available():
        raise Skip(
            f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda})"
        )
    count = torch.cuda.device_count()
    if r.local_rank >= count:
        raise Skip(
            f"rank {r.rank} has local rank {r.local_rank} but only {count} GPU(s) are visible"
        )
    dev = torch.device("cuda", r.local_rank)
    torch.cuda.set_device(dev)
    return dev


def free_cuda_memory() -> None:
    """Returns what earlier work left to the allocator and resets its peaks."""
    gc.collect()
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------
# adamw: torch.optim.AdamW against a D2D copy of the same bytes
# ---------------------------------------------------------------------------


def time_each(launches: int, call: Callable[[], None]) -> float:
    """Seconds per call of `launches` back-to-back `call`s on the current stream, between two
    CUDA events (the stream idle before: the previous sample waited for its end event)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / launches


def against_copy(
    reps: int, traffic: int, call: Callable[[], None], dev: Any
) -> tuple[list[float], list[float]]:
    """`call` (moving `traffic` bytes) and a D2D copy of traffic/2 bytes, alternately: ADAMW_WARMUP
    untimed rounds, then `reps` samples of each. Seconds per call, optimizer and copy."""
    src = torch.zeros(traffic // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    launches = launches_for(traffic)
    t_opt: list[float] = []
    t_copy: list[float] = []
    for rep in range(ADAMW_WARMUP + reps):
        k = time_each(launches, call)
        c = time_each(launches, copy)
        if rep >= ADAMW_WARMUP:
            t_opt.append(k)
            t_copy.append(c)
    torch.cuda.synchronize()
    return t_opt, t_copy


def adamw_variant(name: str, a: argparse.Namespace, dev: Any, **impl: bool) -> dict[str, Any]:
    """One torch AdamW implementation (`fused=True` or `foreach=True`) on N fp32 elements."""
    n = a.elems
    idx = torch.arange(n, device=dev, dtype=torch.int64)
    param = torch.nn.Parameter(((idx % 1000).to(torch.float32) - 500.0) * 1e-3)
    param.grad = (idx % 7).to(torch.float32) * 1e-3
    del idx
    opt = torch.optim.AdamW(
        [param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **impl
    )
    traffic = ADAMW_BYTES_PER_ELEM * n
    t_opt, t_copy = against_copy(a.reps, traffic, opt.step, dev)
    so, sc = Stats.of(t_opt), Stats.of(t_copy)
    go, gc_ = gbps(traffic, so.median), gbps(traffic, sc.median)
    fraction = sc.median / so.median
    print(
        f"{name:<28} {ADAMW_BYTES_PER_ELEM:>4} {so.median * 1e3:>8.3f} "
        f"{so.min * 1e3:>7.3f}..{so.max * 1e3:<7.3f} {go:>7.0f} | {sc.median * 1e3:>8.3f} "
        f"{gc_:>7.0f} | {fraction * 100:>6.1f}%"
    )
    row = {
        "variant": name,
        "implementation": ", ".join(f"{k}={v}" for k, v in impl.items()),
        "dtype": "float32 parameter, gradient, moments",
        "elems": n,
        "bytes_read_per_elem": 16,
        "bytes_written_per_elem": 12,
        "bytes": traffic,
        "launches_per_sample": launches_for(traffic),
        "optimizer": so.json(),
        "optimizer_gbps": go,
        "baseline": "dst.copy_(src) of bytes/2 uint8 (read + write = bytes), same stream, interleaved",
        "baseline_copy_bytes": traffic // 2,
        "baseline_time": sc.json(),
        "baseline_gbps": gc_,
        "fraction": fraction,
    }
    del opt, param
    free_cuda_memory()
    return row


def run_adamw(a: argparse.Namespace, r: Ranks, doc: dict[str, Any]) -> None:
    if not r.lead:
        raise Skip(f"rank {r.rank}: the adamw section runs on rank 0 only")
    dev = cuda_device(r)
    free_cuda_memory()
    traffic = ADAMW_BYTES_PER_ELEM * a.elems
    print(
        f"\n== torch.optim.AdamW on {torch.cuda.get_device_name(dev)}: {a.elems} fp32 elements "
        f"({ADAMW_BYTES_PER_ELEM} B/elem: p, g, m, v read; p, m, v written), {a.reps} reps after "
        f"{ADAMW_WARMUP} warm-ups, CUDA events on one stream, {launches_for(traffic)} back-to-back "
        f"step() per sample; baseline: D2D copy of {ADAMW_BYTES_PER_ELEM // 2} B/elem (read + "
        f"write = the same bytes), interleaved"
    )
    print(
        f"{'variant':<28} {'B/el':>4} {'ms med':>8} {'ms min..max':>16} {'GB/s':>7} | "
        f"{'copy ms':>8} {'GB/s':>7} | {'frac':>7}"
    )
    rows = doc.setdefault("adamw", [])
    rows.append(adamw_variant("fused=True", a, dev, fused=True))
    rows.append(adamw_variant("foreach=True (information)", a, dev, foreach=True))
    print(
        "frac: the copy's median time over the optimizer's (its GB/s over the copy's); "
        "compare with GpuAdamW's 'fp32 state + fp32 grad' row of benches/cuda.rs"
    )


# ---------------------------------------------------------------------------
# fsdp: FSDP2 fully_shard on a LlamaForCausalLM
# ---------------------------------------------------------------------------


@dataclass
class Fsdp2:
    """FSDP2's API, from where this torch has it."""

    fully_shard: Callable[..., Any]
    MixedPrecisionPolicy: Any
    OffloadPolicy: Any
    CPUOffloadPolicy: Any
    module: str


def import_fsdp2() -> Fsdp2:
    """torch.distributed.fsdp (torch >= 2.6), else torch.distributed._composable.fsdp (2.4, 2.5)."""
    try:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        return Fsdp2(
            fully_shard,
            MixedPrecisionPolicy,
            OffloadPolicy,
            CPUOffloadPolicy,
            "torch.distributed.fsdp",
        )
    except ImportError as first:
        try:
            from torch.distributed._composable.fsdp import (
                CPUOffloadPolicy,
                MixedPrecisionPolicy,
                OffloadPolicy,
                fully_shard,
            )

            return Fsdp2(
                fully_shard,
                MixedPrecisionPolicy,
                OffloadPolicy,
                CPUOffloadPolicy,
                "torch.distributed._composable.fsdp",
            )
        except ImportError:
            raise RuntimeError(
                f"torch {torch.__version__} has no FSDP2 fully_shard "
                f"(torch.distributed.fsdp: {one_line(first)}; torch >= 2.6 needed, "
                f"2.4 has it under torch.distributed._composable.fsdp)"
            ) from first


def llama_config(a: argparse.Namespace, tf: ModuleType) -> Any:
    kwargs: dict[str, Any] = {
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "max_position_embeddings": a.seq,
        "tie_word_embeddings": a.tie_embeddings,
        "use_cache": False,
    }
    if a.attn:
        kwargs["attn_implementation"] = a.attn
    return tf.LlamaConfig(**kwargs)


def count_params(model: Any) -> tuple[int, int]:
    """All parameters (a tied one once) and those in matrix products (every nn.Linear's)."""
    total = sum(p.numel() for p in model.parameters())
    matmul = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            matmul += m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
    return total, matmul


def train_flops(matmul_params: int, layers: int, attn_width: int, batch: int, seq: int) -> float:
    """Training FLOPs per rank and step: 6·P_mm·tokens + 12·layers·seq²·A·batch (see the docstring)."""
    return 6.0 * matmul_params * batch * seq + 12.0 * layers * seq * seq * attn_width * batch


class AdamWStepper:
    """torch AdamW, fused when torch accepts it for these parameters; if the fused
    constructor or first step refuses, torch's default implementation, and why."""

    def __init__(self, params: list[Any], lr: float) -> None:
        self.params = params
        self.lr = lr
        self.first = True
        try:
            self.opt = torch.optim.AdamW(params, lr=lr, fused=True)
            self.implementation = "fused"
        except (RuntimeError, ValueError, TypeError) as e:
            self.opt = torch.optim.AdamW(params, lr=lr)
            self.implementation = f"default (fused=True refused: {one_line(e)})"

    def step(self) -> None:
        first, self.first = self.first, False
        if not first or self.implementation != "fused":
            self.opt.step()
            return
        try:
            self.opt.step()
        except (RuntimeError, ValueError, TypeError) as e:
            self.opt = torch.optim.AdamW(self.params, lr=self.lr)
            self.implementation = f"default (the fused step failed: {one_line(e)})"
            self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)


class GradClipper:
    """`torch.nn.utils.clip_grad_norm_`; if its first call fails (CPU-offloaded DTensor
    gradients in some torch versions), the same clipping by hand: squares of the local
    shards summed, all-reduced on the GPU, one scale per gradient."""

    def __init__(self, params: list[Any], max_norm: float, dev: Any, world: int) -> None:
        self.params = params
        self.max_norm = max_norm
        self.dev = dev
        self.world = world
        self.method = "off" if max_norm <= 0 else "torch.nn.utils.clip_grad_norm_"
        self.first = True
        self.by_hand = False

    def clip(self) -> None:
        if self.max_norm <= 0:
            return
        if self.by_hand:
            self.clip_local()
            return
        if not self.first:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
            return
        self.first = False
        try:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        except (RuntimeError, ValueError, TypeError) as e:
            self.method = (
                f"local shards' norm all-reduced on the GPU (clip_grad_norm_ failed: {one_line(e)})"
            )
            self.by_hand = True
            self.clip_local()

    def clip_local(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = torch.zeros((), dtype=torch.float32, device=self.dev)
        for t in local:
            sq += torch.linalg.vector_norm(t, dtype=torch.float32).square().to(self.dev)
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(sq)
        coef = (self.max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        coefs = {self.dev: coef}
        for t in local:
            if t.device not in coefs:
                coefs[t.device] = coef.to(t.device)
            t.mul_(coefs[t.device])


@dataclass
class Model:
    """The sharded model and what the report needs of it."""

    model: Any
    total_params: int
    matmul_params: int
    attn_implementation: str
    build_s: float


def build_model(
    a: argparse.Namespace, tf: ModuleType, api: Fsdp2, dev: Any, world: int, offload: bool
) -> Model:
    """LlamaForCausalLM in fp32 on the GPU, fully_shard on every decoder layer and the root."""
    from torch.distributed.device_mesh import init_device_mesh

    t0 = time.perf_counter()
    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = llama_config(a, tf)
    with dev:
        model = tf.LlamaForCausalLM(cfg)
    model.to(torch.float32)
    total, matmul = count_params(model)
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    mesh = init_device_mesh("cuda", (world,))
    policy = {
        "mesh": mesh,
        "mp_policy": api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        ),
        "offload_policy": api.CPUOffloadPolicy(pin_memory=True) if offload else api.OffloadPolicy(),
    }
    for layer in model.model.layers:
        api.fully_shard(layer, **policy)
    api.fully_shard(model, **policy)
    attn = getattr(model.config, "_attn_implementation", None) or "unknown"
    torch.cuda.synchronize(dev)
    return Model(model, total, matmul, str(attn), time.perf_counter() - t0)


def fsdp_run(
    a: argparse.Namespace, tf: ModuleType, api: Fsdp2, r: Ranks, dev: Any, name: str, offload: bool
) -> dict[str, Any]:
    """One training run; its figures (the slowest rank's times, the largest rank's memory)."""
    m = build_model(a, tf, api, dev, r.world, offload)
    params = list(m.model.parameters())
    opt = AdamWStepper(params, a.lr)
    clipper = GradClipper(params, a.clip, dev, r.world)
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + r.rank)
    batches = [
        torch.randint(0, a.vocab_size, (a.batch, a.seq), device=dev, generator=gen)
        for _ in range(a.warmup + a.steps)
    ]
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    after_setup = torch.cuda.memory_allocated(dev)

    times: list[float] = []
    losses: list[Any] = []
    for i, ids in enumerate(batches):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        loss = m.model(input_ids=ids, labels=ids).loss
        loss.backward()
        clipper.clip()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t
        if i >= a.warmup:
            times.append(dt)
        losses.append(loss.detach())
    peak_alloc = torch.cuda.max_memory_allocated(dev)
    peak_reserved = torch.cuda.max_memory_reserved(dev)

    times = max_over_ranks(times, r, dev)
    peak_alloc, peak_reserved, after_setup = max_over_ranks(
        [float(peak_alloc), float(peak_reserved), float(after_setup)], r, dev
    )
    st = Stats.of(times)
    tokens_rank = a.batch * a.seq
    attn_width = a.num_attention_heads * (a.hidden_size // a.num_attention_heads)
    flops = train_flops(m.matmul_params, a.num_hidden_layers, attn_width, a.batch, a.seq)
    loss_values = [float(x) for x in torch.stack(losses).float().cpu().tolist()]
    result = {
        "run": name,
        "offload_policy": "CPUOffloadPolicy(pin_memory=True)"
        if offload
        else "OffloadPolicy() (none)",
        "optimizer": opt.implementation,
        "clipping": clipper.method,
        "attn_implementation": m.attn_implementation,
        "parameters": m.total_params,
        "matmul_parameters": m.matmul_params,
        "build_and_shard_s": m.build_s,
        "step": st.json(),
        "step_times_s": times,
        "tokens_per_step": tokens_rank * r.world,
        "tokens_per_s": tokens_rank * r.world / st.median,
        "flops_per_step_per_rank": flops,
        "tflops_per_s": flops * r.world / st.median / 1e12,
        "tflops_per_s_per_gpu": flops / st.median / 1e12,
        "mfu": flops / st.median / (a.peak_tflops * 1e12),
        "memory_allocated_after_setup_gib": gib(after_setup),
        "max_memory_allocated_gib": gib(peak_alloc),
        "max_memory_reserved_gib": gib(peak_reserved),
        "host_maxrss_gib_so_far": gib(host_maxrss_bytes()),
        "losses": loss_values,
    }
    return result


def fsdp_header(a: argparse.Namespace, r: Ranks, api: Fsdp2, dev: Any) -> None:
    print(
        f"\n== FSDP2 fully_shard ({api.module}) on {torch.cuda.get_device_name(dev)}: "
        f"LlamaForCausalLM hidden {a.hidden_size}, {a.num_hidden_layers} layers, "
        f"{a.num_attention_heads} heads ({a.num_key_value_heads} kv), intermediate "
        f"{a.intermediate_size}, vocab {a.vocab_size}{', tied' if a.tie_embeddings else ''}; "
        f"batch {a.batch} x seq {a.seq} per rank, {r.world} rank(s); fp32 sharded master + bf16 "
        f"compute (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); activation "
        f"checkpointing {'on' if a.checkpointing else 'off'}; {a.steps} steps after "
        f"{a.warmup} warm-ups; MFU against {a.peak_tflops} TFLOP/s"
    )
    print(
        f"{'run':<12} {'params':>7} {'step ms':>9} {'min..max':>17} {'tokens/s':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'peak alloc':>10} {'peak resv':>9} {'loss first..last':>17}  "
        f"optimizer"
    )


def params_text(n: int) -> str:
    """A parameter count as 1.10B or 106.8M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def fsdp_row(res: dict[str, Any]) -> None:
    st = res["step"]
    losses = res["losses"]
    print(
        f"{res['run']:<12} {params_text(res['parameters']):>7} {st['median_s'] * 1e3:>9.1f} "
        f"{st['min_s'] * 1e3:>8.1f}..{st['max_s'] * 1e3:<8.1f} {res['tokens_per_s']:>9.0f} "
        f"{res['tflops_per_s']:>8.1f} {res['mfu'] * 100:>5.1f}% "
        f"{res['max_memory_allocated_gib']:>7.2f}GiB {res['max_memory_reserved_gib']:>6.2f}GiB "
        f"{losses[0]:>8.3f}..{losses[-1]:<8.3f}  {res['optimizer']}"
    )


def run_fsdp(a: argparse.Namespace, r: Ranks, doc: dict[str, Any]) -> None:
    """Both runs; a failing run is recorded and the next one still runs. Raises (a section
    failure) when any run failed, after both."""
    dev = cuda_device(r)
    tf, why = import_transformers()
    if tf is None:
        raise Skip(why)
    api = import_fsdp2()
    init_process_group(r)
    free_cuda_memory()
    section: dict[str, Any] = {
        "fsdp2_module": api.module,
        "config": {
            k: getattr(a, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
                "tie_embeddings",
                "attn",
                "checkpointing",
                "clip",
                "lr",
                "batch",
                "seq",
                "steps",
                "warmup",
                "peak_tflops",
            )
        },
        "max_position_embeddings": a.seq,
        "world_size": r.world,
        "mixed_precision": "MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32) over fp32 sharded parameters",
        "sharding": "fully_shard on every decoder layer, then the root; 1-D mesh of all ranks",
        "flops_formula": "6 * matmul_parameters * batch * seq + 12 * layers * seq^2 * "
        "(heads * head_dim) * batch, per rank and step (fwd + bwd)",
        "step_time": "wall time between torch.cuda.synchronize() before and after the step "
        "(forward, backward, clipping, optimizer step, zero_grad); the slowest rank",
        "memory": "peaks since the reset after set-up; the largest rank's",
        "runs": [],
    }
    doc["fsdp"] = section
    if r.lead:
        fsdp_header(a, r, api, dev)
    failures: list[str] = []
    by_name: dict[str, dict[str, Any]] = {}
    for name, offload in (("no offload", False), ("cpu offload", True)):
        try:
            res = fsdp_run(a, tf, api, r, dev, name, offload)
        except Exception as e:  # noqa: BLE001 (a failed run is reported; the next one runs)
            res = {
                "run": name,
                "error": one_line(e),
                "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
            }
            failures.append(f"{name}: {one_line(e)}")
            if r.lead:
                print(f"{name:<12} FAILED: {one_line(e)}")
            print(res["traceback"], file=sys.stderr)
        free_cuda_memory()
        section["runs"].append(res)
        if "error" not in res:
            by_name[name] = res
            if r.lead:
                fsdp_row(res)
    if "no offload" in by_name and "cpu offload" in by_name:
        ratio = (
            by_name["cpu offload"]["step"]["median_s"] / by_name["no offload"]["step"]["median_s"]
        )
        section["offload_over_no_offload_step"] = ratio
        if r.lead:
            print(f"cpu offload / no offload median step: {ratio:.2f}x")
    if r.lead:
        print(
            "FLOPs per rank and step: 6 x P_mm x batch x seq + 12 x layers x seq^2 x hidden x "
            "batch (P_mm: nn.Linear weights, LM head included); MFU per GPU; peaks: "
            "max_memory_allocated / max_memory_reserved after set-up"
        )
    if failures:
        raise RuntimeError("; ".join(failures))


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


RUNNERS: dict[str, Callable[[argparse.Namespace, Ranks, dict[str, Any]], None]] = {
    "adamw": run_adamw,
    "fsdp": run_fsdp,
}


def write_json(path: Path, doc: dict[str, Any]) -> None:
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def banner(meta: dict[str, Any]) -> str:
    """One line of what runs here: the libraries' versions and the first GPU."""
    if torch is None:
        return str(meta["torch"])
    gpus = meta.get("gpus") or []
    gpu = f"{gpus[0]['name']} ({gpus[0]['memory_gib']:.1f} GiB)" if gpus else "no CUDA device"
    nccl = f", NCCL {meta['nccl']}" if "nccl" in meta else ""
    return (
        f"torch {meta['torch']} (CUDA {meta.get('torch_cuda')}{nccl}), "
        f"transformers {meta.get('transformers')}; {gpu}"
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    r = Ranks.from_env()
    t0 = time.perf_counter()
    meta = environment(r)
    meta["args"] = {k: v for k, v in vars(a).items() if k != "only"}
    doc: dict[str, Any] = {"meta": meta, "skipped": {}, "failed": {}}
    if r.lead:
        print(f"torch baseline: {banner(meta)}; {r.world} rank(s)")
    failed = False
    for name in a.sections:
        try:
            RUNNERS[name](a, r, doc)
        except Skip as why:
            doc["skipped"][name] = str(why)
            if r.lead:
                print(f"{name}: skipped: {why}")
        except Exception as e:  # noqa: BLE001 (a failed section is reported; the next runs)
            failed = True
            doc["failed"][name] = one_line(e)
            if r.lead:
                print(f"{name}: FAILED: {one_line(e)}")
                traceback.print_exc(file=sys.stderr)
        free_cuda_memory()
    meta["wall_s"] = time.perf_counter() - t0
    if torch is not None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if r.lead:
        path = Path(a.json)
        try:
            write_json(path, doc)
            print(f"\nwrote {path}")
        except OSError as e:
            print(f"torch baseline: writing {path}: {e}", file=sys.stderr)
            failed = True
        print(f"total {meta['wall_s']:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
