#!/usr/bin/env bash
# mpirun with the flags this project's runs need on a single machine:
# more ranks than cores, running as root (containers, CI).
set -euo pipefail
exec mpirun --oversubscribe --allow-run-as-root "$@"
