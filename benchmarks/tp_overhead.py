"""Tensor parallel on 2 ranks: a traced step against the same step with raw hooks.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/tp_overhead.py [--steps 200]

Tiny Llama (2 layers, d_model 64) split with parallelize_llama (Colwise/Rowwise projections).
The step: read layer 0's q_proj output (a column shard) whole, and in the backward read its
gradient whole and double it. Raw hooks do the same by hand: a forward hook that all-gathers the
shard and registers a tensor hook that all-gathers the gradient and returns it doubled. Both
ranks run the same interleaved sequence; rank 0 prints medians and the ratio.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from ranks import print_ratios, time_in_turns

import distgrad
from distgrad.demo.models import build_llama, parallelize_llama


def gather_last(t, world):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    net = parallelize_llama(build_llama(), mesh)
    model = distgrad.wrap(net)
    ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(0))
    q_proj = net.model.layers[0].self_attn.q_proj

    def raw():
        saved = {}

        def on_grad(g):
            saved["g"] = gather_last(g, world)
            return g * 2

        def on_output(module, inputs, out):
            saved["q"] = gather_last(out.detach(), world)
            out.register_hook(on_grad)

        handle = q_proj.register_forward_hook(on_output)
        out = net(ids)
        handle.remove()
        out.logits.sum().backward()
        return saved["q"], saved["g"]

    def traced():
        with model.trace(ids):
            q = model.model.layers[0].self_attn.q_proj.output.save()
            loss = model.output.logits.sum()
            with loss.backward():
                g = q.grad.save()
                q.grad = q.grad * 2
        return q, g

    a, b = raw(), traced()
    net.zero_grad(set_to_none=True)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b)), "raw and traced differ"
    fns = {"raw hooks + manual all_gathers": raw, "distgrad": traced}
    times = time_in_turns(fns, args.steps, after=lambda: net.zero_grad(set_to_none=True))
    if rank == 0:
        print(
            f"torch {torch.__version__}, tensor parallel over {world} ranks, gloo, "
            f"median of {args.steps}"
        )
        print_ratios(times, "raw hooks + manual all_gathers")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
