"""The main job: ``python -m distgrad.demo [--engine E] [--check]``.

One process (``--engine local``, the default): the README program on a tiny GPT-2 (``local.py``).
Under a launcher (``launch/*.sh``): a few fine-tuning steps with a gradient edit under a
data-parallel engine (``data_parallel.py``), tensor parallelism (``tensor_parallel.py``) or a
pipeline schedule (``pipeline.py``). ``--check`` compares every number with plain autograd on
one process and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

from . import data_parallel, local, pipeline, tensor_parallel

DATA_PARALLEL = ("ddp", "fsdp1", "fsdp2", "accelerate", "zero1", "zero2", "zero3")
PIPELINE = ("pp-gpipe", "pp-1f1b", "pp-interleaved", "deepspeed-pipe")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distgrad.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="compare with plain autograd")
    parser.add_argument(
        "--engine",
        default="local",
        choices=("local",) + DATA_PARALLEL + ("tp",) + PIPELINE,
        help="local (one process); under a launcher: the others",
    )
    parser.add_argument("--steps", type=int, default=3, help="fine-tuning steps (parallel engines)")
    parser.add_argument("--ds-config", default=None, help="DeepSpeed JSON (zero1/2/3 engines)")
    args, _ = parser.parse_known_args(argv)  # launchers may add their own flags
    if args.engine in PIPELINE:
        return pipeline.run(args.engine, args.steps, args.check)
    if args.engine == "tp":
        return tensor_parallel.run(args.steps, args.check)
    if args.engine in DATA_PARALLEL:
        return data_parallel.run(args.engine, args.steps, args.check, args.ds_config)
    return local.run(args.check)


if __name__ == "__main__":
    sys.exit(main())
