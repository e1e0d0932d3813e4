#!/usr/bin/env bash
# One process, no launcher: the main job with its parity check against plain autograd.
# (torchrun / accelerate / deepspeed scripts for the parallel engines live beside this one.)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m distgrad.demo --check "$@"
