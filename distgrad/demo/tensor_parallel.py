"""The main job under tensor parallelism:
``torchrun --nproc_per_node 2 -m distgrad.demo --engine tp``.

A tiny Llama (HF's GPT-2 uses Conv1D, which torch's tensor parallel styles do not split) is
split over all ranks with ``models.parallelize_llama``: attention and MLP projections column- then
row-wise. Every rank feeds the same batch; the body saves the gradient reaching each decoder
layer and the (column-sharded) output of layer 0's ``up_proj`` seen whole, and halves the gradient
reaching layer 0; SGD steps. ``--check`` replays the steps on one process, unsplit, and compares
the saved gradients and the trained weights (fp32, atol 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import distgrad

from .models import build_llama, parallelize_llama
from .ranks import end_job

SCALE = 1e-3  # gradients of order 1 (see tests/dist/job.py)


def batches(steps: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 384, (2, 8), generator=g) for _ in range(steps)]


def traced_steps(model, ids_list, opt):
    tables = []
    for ids in ids_list:
        with model.trace(ids):
            layers = model.model.layers
            up = layers[0].mlp.up_proj.output.save()  # column-sharded: gathered whole
            acts = [layers[i].output for i in range(len(layers))]
            acts = [a[0] if isinstance(a, tuple) else a for a in acts]
            loss = model.output.logits.sum() * SCALE
            with loss.backward():
                grads = [a.grad.save() for a in reversed(acts)][::-1]
                acts[0].grad = acts[0].grad * 0.5
        opt.step()
        opt.zero_grad(set_to_none=True)
        tables.append([up.norm().item()] + [g.norm().item() for g in grads])
    return tables


def reference_steps(ids_list):
    net = build_llama()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tables = []
    for ids in ids_list:
        acts = []

        def keep(mod, args, out):
            out = out[0] if isinstance(out, tuple) else out
            acts.append(out)
            out.retain_grad()
            if mod is net.model.layers[0]:
                out.register_hook(lambda g: g * 0.5)

        ups = []
        hooks = [layer.register_forward_hook(keep) for layer in net.model.layers]
        hooks.append(
            net.model.layers[0].mlp.up_proj.register_forward_hook(
                lambda m, a, out: ups.append(out.detach())
            )
        )
        loss = net(ids).logits.sum() * SCALE
        for h in hooks:
            h.remove()
        loss.backward()
        norms = [a.grad.norm().item() for a in acts]
        norms[0] = (acts[0].grad * 2).norm().item()  # retain_grad shows it after the halving
        tables.append([ups[0].norm().item()] + norms)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tables, net


def run(steps: int, check: bool) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        net = parallelize_llama(build_llama(), mesh)
        model = distgrad.wrap(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ids_list = batches(steps)
        tables = traced_steps(model, ids_list, opt)
        weight = model.model.layers[0].mlp.up_proj.weight.full_tensor()  # every rank gathers
        if rank == 0:
            print(f"engine tp, {world} ranks, {steps} steps; norms of the saved values:")
            print(
                "step "
                + f"{'up_proj out':>12}"
                + "".join(f"{f'grad l[{i}]':>12}" for i in range(len(tables[0]) - 1))
            )
            for s, row in enumerate(tables):
                print(f"{s:4} " + "".join(f"{v:12.6f}" for v in row))
        if not check or rank != 0:
            return 0
        ref_tables, ref = reference_steps(ids_list)
        ok = all(
            torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
            for a, b in zip(tables, ref_tables)
        )
        ok = ok and torch.allclose(
            weight, ref.model.layers[0].mlp.up_proj.weight, atol=1e-5, rtol=0
        )
        print("check against one process, unsplit, plain autograd:", "OK" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        model = net = opt = mesh = weight = None  # (see end_job)
        end_job()
