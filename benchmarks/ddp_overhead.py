"""DDP on 2 ranks: what distgrad's rank-aware trace costs over hand-written hooks + all_gather.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/ddp_overhead.py [--steps 200]

Part A: one traced step (save h[0]'s gradient, double it, gather the save to rank 0) against
the same step with raw hooks and one manual all_gather. Part B: gathering S saved tensors with
distgrad's end-of-trace gather (``SavesGather``) against one raw all_gather of the same bytes.
Both ranks run the same interleaved sequence (the collectives must match); rank 0 prints medians
and ratios.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.distributed as dist
from ranks import print_ratios, time_in_turns
from torch.nn.parallel import DistributedDataParallel

import distgrad
from distgrad.demo.models import build_gpt2
from distgrad.engines.ranks import gather

logging.getLogger("transformers").setLevel(logging.ERROR)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = build_gpt2()
    ddp = DistributedDataParallel(net)
    model = distgrad.wrap(ddp)
    ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(rank))

    def raw():
        saved = []

        def on_grad(g):
            saved.append(g.clone())
            return g * 2

        def on_output(module, args, out):
            out.register_hook(on_grad)

        handle = ddp.module.transformer.h[0].register_forward_hook(on_output)
        out = ddp(ids)
        handle.remove()
        torch.autograd.backward(out.logits.sum())
        parts = [torch.empty_like(saved[0]) for _ in range(world)]
        dist.all_gather(parts, saved[0])
        return torch.cat(parts) if rank == 0 else saved[0]

    def traced():
        with model.trace(ids):
            a1 = model.transformer.h[0].output
            loss = model.output.logits.sum()
            with loss.backward():
                g = a1.grad.save()
                a1.grad = a1.grad * 2
        return g

    a, b = raw(), traced()
    ddp.zero_grad(set_to_none=True)
    assert torch.allclose(a, b, atol=1e-5), "raw and traced gathers differ"
    fns = {"raw hooks + all_gather": raw, "distgrad": traced}
    times = time_in_turns(fns, args.steps, after=lambda: ddp.zero_grad(set_to_none=True))

    by_count = {}
    for s in (1, 4, 16, 64):
        tensors = [torch.randn(2, 8, 64) for _ in range(s)]
        originals = [t.clone() for t in tensors]
        saves = [(t, "rank0", 0) for t in tensors]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        parts = [torch.empty_like(flat) for _ in range(world)]
        saves_gather = gather.SavesGather(dist.group.WORLD, rank, world)
        # the first call agrees on the layouts; later ones send header and payload at once
        saves_gather(saves)
        for tensor, original in zip(tensors, originals):
            tensor.data = original
        one, ours = [], []
        for _ in range(args.steps // 10):
            for _ in range(10):
                dist.barrier()
                t = time.perf_counter_ns()
                dist.all_gather(parts, flat)
                one.append(time.perf_counter_ns() - t)
            for _ in range(10):
                dist.barrier()
                t = time.perf_counter_ns()
                saves_gather(saves)  # as end_trace does: rebinds each saved tensor to its result
                ours.append(time.perf_counter_ns() - t)
                for tensor, original in zip(tensors, originals):
                    tensor.data = original
        by_count[s] = (statistics.median(one) / 1e3, statistics.median(ours) / 1e3)

    if rank == 0:
        print(
            f"torch {torch.__version__}, {world} ranks, gloo, 1 thread each, median of {args.steps}"
        )
        print_ratios(times, "raw hooks + all_gather")
        print(
            "\n| saved tensors S | one raw all_gather us | distgrad gather us | ratio |"
            "\n|---:|---:|---:|---:|"
        )
        for s, (one, ours) in by_count.items():
            print(f"| {s} | {one:.1f} | {ours:.1f} | {ours / one:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
