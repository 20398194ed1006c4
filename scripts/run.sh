#!/usr/bin/env bash
# Sets up and runs the main job: fine-tune a Llama-architecture model on the
# addition task with ZeRO stage 3 and the optimizer state offloaded to host
# memory, 2 ranks under mpirun (installs OpenMPI when missing). Extra
# arguments go to the example, e.g. `bash scripts/run.sh --stage 2 --offload nvme`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --example llama_sft
# scripts/mpirun.sh is mpirun plus --oversubscribe --allow-run-as-root.
bash scripts/mpirun.sh -n 2 cargo run --example llama_sft -- --stage 3 --offload cpu "$@"
