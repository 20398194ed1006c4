#!/usr/bin/env bash
# Sets up and runs every test: the whole workspace (unit, integration and doc
# tests) with the default features, which include MPI. The MPI integration
# test (zero-comm/tests/mpi.rs) starts itself under `mpirun -n 2`, `-n 3` and
# 4 ranks as two simulated nodes; missing MPI is a failure, not a skip.
# Then the aarch64 NEON kernels under qemu-user (scripts/test-neon.sh), the
# `cuda` feature's tests with NVRTC from PyPI (scripts/test-cuda.sh: every
# CUDA source must compile without a warning; GPU tests skip without one), and
# the main example end to end (the README's command under mpirun, and a
# second stage/offload mode with the ranks as threads), each required to
# reach 95% held-out accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --workspace
# Say which SIMD paths the CPU AdamW tests ran here (AVX-512 runs only where
# the CPU has it). `--workspace`, not `-p zero-core`: the same features as
# the run above, so nothing is rebuilt.
isa_log=$(mktemp)
cargo test -q --workspace --test cpu_adam every_path -- --nocapture >"$isa_log" 2>&1
grep -m1 "instruction sets checked" "$isa_log" || true
rm -f "$isa_log"
# The NEON kernels, cross-compiled and run under qemu-user.
bash scripts/test-neon.sh
# The CUDA kernels through NVRTC (no GPU needed) and the cuda feature's tests.
bash scripts/test-cuda.sh
# The main example, as the README runs it, then stage 2 with the optimizer
# state on nvme and activation checkpointing, ranks as threads.
cargo build --example llama_sft
bash scripts/mpirun.sh -n 2 cargo run -q --example llama_sft -- --stage 3 --offload cpu --min-accuracy 95
cargo run -q --example llama_sft -- --stage 2 --offload nvme --activation-checkpointing --min-accuracy 95
# The device trainer (what --device cuda runs, op for op: bf16 activations in
# backend buffers, every op on the compute stream) on the CPU backend under
# its hazard checker, stage 3 with optimizer offload, 2 ranks as threads.
cargo run -q --example llama_sft -- --device cpu-checked --stage 3 --offload cpu --min-accuracy 95
# ZeRO-Infinity: stage 3 with every model state on nvme (the optimizer
# state, the parameter shards and the swapped gradients), 2 ranks as threads.
inf_dir=$(mktemp -d)
cargo run -q --example llama_sft -- --config tests/fixtures/ds_infinity.json --nvme-path "$inf_dir" --min-accuracy 95
rm -rf "$inf_dir"
# A Hugging Face directory in and out: the Qwen2 fixture (q/k/v biases, tied
# embeddings, sharded BF16, its tokenizer and chat template), trained briefly
# under stage 3 with optimizer offload and exported.
hf_out=$(mktemp -d)
cargo run -q --example llama_sft -- --model-dir examples/llama/tests/fixtures/qwen2 --stage 3 --offload cpu --steps 20 --lr 1e-2 --export "$hf_out/qwen2"
# The same on the device trainer (q/k/v biases, tied embeddings, bf16
# activations) under the hazard checker.
cargo run -q --example llama_sft -- --device cpu-checked --model-dir examples/llama/tests/fixtures/qwen2 --stage 3 --offload cpu --steps 20 --lr 1e-2 --export "$hf_out/qwen2-device"
# LoRA on it under the experiment's stage-3 DeepSpeed config as it is (2
# ranks, optimizer and parameter offload), its adapter exported in PEFT's
# layout, then loaded back and merged into a Hugging Face export.
bash scripts/mpirun.sh -n 2 cargo run -q --example llama_sft -- --model-dir examples/llama/tests/fixtures/qwen2 --config tests/fixtures/ds_stage3_offload.json --lora 8 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --steps 10 --lr 1e-2 --export-adapter "$hf_out/adapter"
cargo run -q --example llama_sft -- --model-dir examples/llama/tests/fixtures/qwen2 --adapter "$hf_out/adapter" --steps 0 --merge-lora --export "$hf_out/merged"
# Chat data in every layout (messages with a system and two assistant turns,
# Alpaca, prompt/response and prompt/completion, JSON Lines) in the Qwen2
# fixture's ChatML template: memorised, then judged by exact match, with the
# validation loss each epoch and answers to --prompts.
chat=examples/llama/tests/fixtures/chat/sample.jsonl
cargo run -q --example llama_sft -- --model-dir examples/llama/tests/fixtures/qwen2 --data "$chat" --val-data "$chat" --eval-data "$chat" --prompts "$chat" --steps 300 --batch 3 --lr 3e-2 --dtype fp32 --max-new-tokens 8 --min-accuracy 90
rm -rf "$hf_out"
# --- The LoRA experiment (issue 31) at its small shape on the CPU ---------
# The motivating experiment as one command: the four DeepSpeed configs of
# tests/fixtures/ds_*.json as they are, the experiment's recipe (LoRA r 8 on
# the seven projections, 16 x 51 tokens per rank, checkpointing, bf16), one
# epoch each, 2 ranks as threads, on the dev build above (~1 minute on 2
# cores); fails if a config fails or its table cannot be read.
bash scripts/lora-experiment.sh --device cpu --shape small
# ---------------------------------------------------------------------------
