#!/usr/bin/env bash
# Sets up and runs the main job. Until the llama_sft example lands, that is
# the collective benchmark: first the threads backend (ranks as threads of
# one process), then the MPI backend with 2 processes under mpirun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo bench --bench collectives --no-run
cargo bench -q --bench collectives -- "$@"
bash scripts/mpirun.sh -n 2 cargo bench -q --bench collectives -- "$@"
