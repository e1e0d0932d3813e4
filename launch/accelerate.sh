#!/usr/bin/env bash
# The main job under `accelerate launch` on 2 CPU processes, checked against one process.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/accelerate launch --config_file launch/accelerate_cpu.yaml \
    -m distgrad.demo --engine accelerate --check "$@"
