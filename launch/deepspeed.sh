#!/usr/bin/env bash
# The main job under the deepspeed launcher on 2 CPU processes with ZeRO stage 1, 2 or 3
# (launch/zero{1,2,3}.json), or DeepSpeed's pipeline engine (`pipe`: a PipelineModule of 2
# stages run by train_batch, distgrad/demo/pipeline.py), checked against one process.
#   launch/deepspeed.sh [1|2|3|pipe]
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:-2}"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# the launcher runs `python -u -m distgrad.demo ... --local_rank=N` in each process
if [ "$stage" = pipe ]; then
    exec .venv/bin/deepspeed --num_gpus 2 --master_port "${MASTER_PORT:-29519}" \
        --module distgrad.demo --engine deepspeed-pipe --check
fi
exec .venv/bin/deepspeed --num_gpus 2 --master_port "${MASTER_PORT:-29519}" --module distgrad.demo \
    --engine "zero$stage" --ds-config "launch/zero$stage.json" --check
