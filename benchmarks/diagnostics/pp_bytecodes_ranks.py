"""Python bytecodes one pipeline step runs on each of two ranks: ``pp_bytecodes.py``'s count,
on ``pp_overhead.py``'s set-up (2 stages, Schedule1F1B, 4 microbatches), where the values really
travel: stage 0 packs and sends them, stage 1 receives and unpacks them.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 \
        benchmarks/diagnostics/pp_bytecodes_ranks.py [--top 25]

Rank 0 prints both ranks' totals and, per rank, the functions that make the differences. A
count includes waits that poll (how often depends on timing), so it moves by a few hundred
bytecodes between runs; the rest does not drift the way a timing does.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks this one builds on

from bytecodes import count
from pp_steps import pipeline_steps

import distgrad
import distgrad.interleave.transports
from distgrad.demo.models import Blocks, Net


def main() -> int:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25, help="functions to list per difference")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("pp_bytecodes_ranks.py runs on 2 ranks: torchrun --nproc_per_node 2")
    torch.manual_seed(0)
    net = Net(width=256)
    per = len(net.layers) // world
    stage = PipelineStage(
        Blocks(net.layers[rank * per : (rank + 1) * per]), rank, world, torch.device("cpu")
    )
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.MSELoss())
    model = distgrad.wrap(schedule, full_model=net)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 256, generator=g), torch.randn(32, 256, generator=g)

    def step():
        schedule.step(*((x,) if stage.is_first else ()), **({"target": y} if stage.is_last else {}))

    counts = {}
    send_to = {"group": dist.new_group(backend="gloo"), "owner": 0, "n": 4, "peers": [1]}
    steps = pipeline_steps(model, net, x, y, step, owns_layer1=rank == 0, send_to=send_to)
    for name, fn in steps.items():
        for _ in range(3):  # warm: the schedule's shape inference, parsed bodies, cached keys
            dist.barrier()
            fn()
            net.zero_grad(set_to_none=True)
        # pooled greenlets made untraced would not be counted
        distgrad.interleave.transports._idle.runners = []
        dist.barrier()
        counts[name] = count(fn)
        net.zero_grad(set_to_none=True)
    lines = [f"\n### rank {rank}\n", "| step | bytecodes |", "|---|---:|"]
    lines += [f"| {name} | {sum(found.values())} |" for name, found in counts.items()]
    empty, full = "distgrad, a body that reads nothing", "distgrad"
    for more, less in ((empty, "raw hooks"), (full, empty)):
        diff = collections.Counter(counts[more])
        diff.subtract(counts[less])
        lines.append(f"\n{more} minus {less}: {sum(diff.values())}, top {args.top}\n")
        lines += [f"{n:8d}  {where}" for where, n in diff.most_common(args.top)]
    every = [None] * world
    dist.all_gather_object(every, "\n".join(lines))
    if rank == 0:
        print("\n".join(every))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
