"""What finding and averaging the parameters beside the model costs a traced backward at the
size users run (``realistic.py``'s 12-layer GPT-2, 4 x 128 tokens per rank): the walk of the
backward's graph that every multi-process engine makes after each backward (``params_beside``,
whether or not the body brought a parameter in), and under torchrun the all-reduce of a
steering vector's and a rank-4 LoReFT module's gradients (``mean_over``), against the step.

    python benchmarks/diagnostics/beside_walk.py [--steps 20]
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/diagnostics/beside_walk.py

Prints the graph's node count, the median us of the walk and of the reduction, the median ms
of a plain forward and backward with the two interventions applied by forward hooks, and the
walk's and the reduction's share of that step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from realistic import build  # noqa: E402

from distgrad.engines.ranks.beside import OwnedLeaves, mean_over, params_beside  # noqa: E402


def nodes(loss) -> int:
    seen, todo = {loss.grad_fn}, [loss.grad_fn]
    while todo:
        for node, _ in todo.pop().next_functions:
            if node is not None and node not in seen:
                seen.add(node)
                todo.append(node)
    return len(seen)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    net = build()
    torch.manual_seed(1)
    steer = torch.nn.Parameter(torch.randn(256) * 0.01)
    low = torch.nn.Linear(256, 4)
    rotate = torch.nn.Parameter(torch.randn(4, 256) * 0.1)
    net.transformer.h[0].register_forward_hook(lambda m, a, out: out + steer)
    net.transformer.h[6].register_forward_hook(
        lambda m, a, out: out + (low(out) - out @ rotate.T) @ rotate
    )
    owned = OwnedLeaves(net.parameters)
    ids = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(2))
    steps, walks, reduces = [], [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = net(ids).logits.sum() * 1e-3
        loss.backward()
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = params_beside([loss], owned)
        walks.append(time.perf_counter() - start)
        assert len(found) == 4, found  # the vector, the rotation, the Linear's weight and bias
        if world > 1:
            dist.barrier()  # (else the wait for the slower rank's backward is timed too)
            start = time.perf_counter()
            mean_over(found, dist.group.WORLD, lambda work, group: work.wait())
            reduces.append(time.perf_counter() - start)
        net.zero_grad()
        for p in found:
            p.grad = None
    step, walk = statistics.median(steps), statistics.median(walks)
    if world == 1 or dist.get_rank() == 0:
        print(f"graph: {nodes(loss)} nodes; {world} rank(s), median of {args.steps} steps")
        print(f"forward+backward  {step * 1e3:9.1f} ms")
        print(f"walk              {walk * 1e6:9.1f} us  ({walk / step * 100:.2f}% of the step)")
        if reduces:
            reduce = statistics.median(reduces)
            share = reduce / step * 100
            print(f"all-reduce        {reduce * 1e6:9.1f} us  ({share:.2f}% of the step)")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
