"""Pipeline parallel, 2 stages, Schedule1F1B with 4 microbatches: a traced step against the same
step with raw hooks.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/pp_overhead.py [--steps 200]
        [--width 256] [--schedule 1f1b|interleaved]

The 4-block MLP of distgrad/demo/models.py (widened to 256 so that a step is not all Python). The
step: save layers[1]'s output (stage 0) and its gradient, and double that gradient. Raw hooks
do it on the owning stage only: a forward hook that keeps the output and registers a tensor hook
that keeps the gradient and returns it doubled. distgrad also sends the values to the other
stage (every rank ends with them) and joins the microbatches; so does the variant "raw hooks,
values sent by hand" (``pp_steps._raw_sent``), the like-for-like baseline, and the variant in
which every other rank then tells the owner it has them: the round trip distgrad's end-of-step
check needs, the floor of what its semantics cost. Rank 0 prints medians and the ratios.
``--schedule interleaved``: ScheduleInterleaved1F1B over one block per stage, two stages per rank
(layers[1] is then rank 1's).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from pp_steps import pipeline_steps
from ranks import print_ratios, time_in_turns
from torch import nn

import distgrad
from distgrad.demo.models import Blocks, Net, interleaved_stages, layers_of


def setup(argv=None) -> tuple:
    """``(args, net, {name: step function})`` on this rank, the process group started."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "interleaved"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net(width=args.width)
    interleaved = args.schedule == "interleaved"
    if interleaved:
        stages = interleaved_stages(net, rank, world)
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=nn.MSELoss())
    else:
        per = len(net.layers) // world
        stages = [
            PipelineStage(
                Blocks(net.layers[rank * per : (rank + 1) * per]), rank, world, torch.device("cpu")
            )
        ]
        schedule = Schedule1F1B(stages[0], n_microbatches=4, loss_fn=nn.MSELoss())
    model = distgrad.wrap(schedule, full_model=net)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, args.width, generator=g), torch.randn(32, args.width, generator=g)

    def step():
        first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
        schedule.step(*((x,) if first else ()), **({"target": y} if last else {}))

    owns = 1 in layers_of(net, rank, world, interleaved)
    owner = next(r for r in range(world) if 1 in layers_of(net, r, world, interleaved))
    send_to = {
        "group": dist.new_group(backend="gloo"),
        "owner": owner,
        "n": 4,
        "peers": [r for r in range(world) if r != owner],
    }
    fns = pipeline_steps(model, net, x, y, step, owns_layer1=owns, send_to=send_to)
    for fn in fns.values():
        fn()
    net.zero_grad(set_to_none=True)
    args.stages = len(stages) * world
    return args, net, fns


def main():
    args, net, fns = setup()
    times = time_in_turns(fns, args.steps, after=lambda: net.zero_grad(set_to_none=True))
    if dist.get_rank() == 0:
        print(
            f"torch {torch.__version__}, {args.schedule} over {args.stages} stages on "
            f"{dist.get_world_size()} ranks, 4 microbatches, width "
            f"{args.width}, gloo, median of {args.steps}"
        )
        print_ratios(times, "raw hooks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
