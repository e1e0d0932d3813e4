"""The main job under a launcher: a few fine-tuning steps with a gradient intervention.

    torchrun --nproc_per_node 2 -m distgrad.demo --engine ddp --check

Each rank takes its slice of a fixed global batch; every step the body saves the gradient
reaching each block and halves the gradient reaching ``h[0]`` before the engine reduces, then
SGD steps. Rank 0 prints a per-layer table of saved gradient norms (global batch). With
``--check`` rank 0 replays the same steps on one process with plain autograd on the global
batch and exits non-zero on any mismatch (fp32, atol 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import distgrad

from .models import build_gpt2
from .ranks import device, end_job, start_process_group, wrap_with_engine

SCALE = 1e-3  # gradients of order 1 (see tests/dist/job.py)


def batches(steps: int, world: int):
    """A fixed global batch per step: two rows per rank."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 384, (2 * world, 8), generator=g) for _ in range(steps)]


def run(engine: str, steps: int, check: bool, ds_config: str | None = None) -> int:
    start_process_group(engine)
    wrapped, options = wrap_with_engine(engine, build_gpt2(), ds_config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model = distgrad.wrap(wrapped, accelerator=options.get("accelerator"))
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        step_batches = batches(steps, world)
        tables = []
        for ids in step_batches:
            local = ids[2 * rank : 2 * rank + 2].to(device())
            with model.trace(local):
                acts = [model.transformer.h[i].output for i in range(len(model.transformer.h))]
                loss = model.output.logits.sum() * SCALE
                with loss.backward():
                    grads = [a.grad.save() for a in reversed(acts)][::-1]
                    acts[0].grad = acts[0].grad * 0.5
            if options.get("deepspeed"):
                wrapped.step()  # DeepSpeed's own optimizer step (and gradient reset)
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            tables.append([g.norm().item() for g in grads])  # .item(): tables live on the CPU
        if rank == 0:
            print(
                f"engine {engine}, {world} ranks, {steps} steps; "
                "saved gradient norms (global batch):"
            )
            print("step " + "".join(f"{f'h[{i}]':>12}" for i in range(len(tables[0]))))
            for s, row in enumerate(tables):
                print(f"{s:4} " + "".join(f"{v:12.6f}" for v in row))
        bad = 0
        if check:
            weight = model.transformer.h[0].mlp.c_fc.weight  # full values: collective on FSDP/ZeRO
            full = full_weight(wrapped, weight).cpu()  # the reference runs on the CPU
            if rank == 0:
                ref_tables, ref_weight = reference(step_batches, world)
                ok = all(
                    torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
                    for a, b in zip(tables, ref_tables)
                )
                ok = (
                    ok
                    and full.numel() == ref_weight.numel()
                    and torch.allclose(
                        full.reshape(ref_weight.shape), ref_weight, atol=1e-5, rtol=0
                    )
                )
                print(
                    "check against one process, plain autograd, global batch:",
                    "OK" if ok else "MISMATCH",
                )
                bad = 0 if ok else 1
        return bad
    finally:
        # Drop the wrapper first (a DDP module keeps the process group alive), so that the
        # group's threads end here rather than while the interpreter exits, where gloo has been
        # seen to abort ("terminate called without an active exception") now and then.
        wrapped = model = opt = options = None
        end_job()


def full_weight(wrapped, weight):
    """``weight``'s whole values (a collective: every rank calls it). FSDP2's DTensor gathers
    itself and FSDP1 summons its full parameters; other engines hand the weight as read."""
    if hasattr(weight, "full_tensor"):
        return weight.full_tensor()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # slow: FSDP1 only

    if isinstance(wrapped, FSDP):
        with FSDP.summon_full_params(wrapped):
            return weight.param.detach().clone()
    return weight.detach().clone()


def reference(step_batches, world):
    """One process: the same steps on the global batch. DDP and FSDP average over ranks, so the
    global loss is divided by the world size."""
    net = build_gpt2()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tables = []
    for ids in step_batches:
        acts = []

        def keep(mod, args, out):
            out.retain_grad()
            acts.append(out)
            if mod is net.transformer.h[0]:
                out.register_hook(lambda g: g * 0.5)

        hooks = [b.register_forward_hook(keep) for b in net.transformer.h]
        loss = net(ids).logits.sum() * SCALE
        for h in hooks:
            h.remove()
        (loss / world).backward()
        # the body saw each rank's own gradient (of its own loss): world x the averaged one;
        # retain_grad on h[0] shows the gradient after the halving hook, the body saw it before
        norms = [a.grad.mul(world).norm().item() for a in acts]
        norms[0] = acts[0].grad.mul(world * 2).norm().item()
        tables.append(norms)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tables, net.transformer.h[0].mlp.c_fc.weight.detach().clone()
