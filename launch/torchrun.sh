#!/usr/bin/env bash
# The main job on 2 CPU processes (gloo) under torchrun, with its check against one process.
#   launch/torchrun.sh [ddp|fsdp1|fsdp2|accelerate|zero1|zero2|zero3|tp|pp-gpipe|pp-1f1b|pp-interleaved] [--steps N]
# tp splits a tiny Llama over all processes (tensor parallel; distgrad/demo/tensor_parallel.py);
# pp-* split a 4-block MLP into one pipeline stage per process (distgrad/demo/pipeline.py;
# NPROC 1, 2 or 4); pp-interleaved into one stage per block, two per process (NPROC 2).
# NPROC sets the number of processes (default 2). Where CUDA is available the data-parallel
# engines put each process on its GPU (LOCAL_RANK) and use nccl; for zero* also set
# DS_ACCELERATOR=cuda. DISTGRAD_DEVICE=cpu keeps them on the CPU. tp and pp-* run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
engine="${1:-ddp}"
shift || true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec .venv/bin/torchrun --nproc_per_node "${NPROC:-2}" --master_port "${MASTER_PORT:-29500}" -m distgrad.demo --engine "$engine" --check "$@"
