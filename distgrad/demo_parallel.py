"""The main job under a launcher: a few fine-tuning steps with a gradient intervention.

    torchrun --nproc_per_node 2 -m distgrad.demo --engine ddp --check

Each rank takes its slice of a fixed global batch; every step the body saves the gradient
reaching each block and halves the gradient reaching ``h[0]`` before the engine reduces, then
SGD steps. Rank 0 prints a per-layer table of saved gradient norms (global batch). With
``--check`` rank 0 replays the same steps on one process with plain autograd on the global
batch and exits non-zero on any mismatch (fp32, atol 1e-5).
"""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

import distgrad

SCALE = 1e-3  # gradients of order 1 (see tests/dist/job.py)


def _net():
    from .demo import build
    net, _ = build()
    return net


def device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK) where CUDA is available, else the CPU.
    ``DISTGRAD_DEVICE=cpu`` keeps a GPU machine on the CPU path."""
    if torch.cuda.is_available() and os.environ.get("DISTGRAD_DEVICE", "") != "cpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _batch(steps: int, world: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 384, (2 * world, 8), generator=g) for _ in range(steps)]


def wrap_with_engine(engine: str, net, lr: float = 0.1, ds_config: str | None = None):
    """The tiny GPT-2 under one engine, the way the demo, launch scripts and tests use it.
    Returns what the user would hand to ``distgrad.wrap`` and the keyword arguments for it."""
    here = device()
    if engine == "accelerate":
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=here.type == "cpu")
        return accelerator.prepare(net), {"accelerator": accelerator}
    world = dist.get_world_size()
    net = net.to(here)
    if engine.startswith("zero"):
        import deepspeed
        import json
        path = ds_config or os.path.join(os.path.dirname(__file__), "..", "launch", f"{engine}.json")
        with open(path) as f:
            config = json.load(f)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        ds_engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
        return ds_engine, {"deepspeed": True}
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(
            net, device_ids=None if here.type == "cpu" else [here.index]), {}
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(here.type, (world,))
        for block in net.transformer.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(net, mesh=mesh), {}
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        return FullyShardedDataParallel(net, use_orig_params=True, device_id=here,
                                        auto_wrap_policy=ModuleWrapPolicy({GPT2Block})), {}
    raise SystemExit(f"--engine {engine}: use ddp, fsdp1, fsdp2 or accelerate "
                     "(DeepSpeed is not wired yet).")


def run(engine: str, steps: int, check: bool, ds_config: str | None = None) -> int:
    _init(engine)
    wrapped, options = wrap_with_engine(engine, _net(), ds_config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model = distgrad.wrap(wrapped, accelerator=options.get("accelerator"))
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        batches = _batch(steps, world)
        tables = []
        for ids in batches:
            local = ids[2 * rank: 2 * rank + 2].to(device())
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
            print(f"engine {engine}, {world} ranks, {steps} steps; saved gradient norms (global batch):")
            print("step " + "".join(f"{'h[%d]' % i:>12}" for i in range(len(tables[0]))))
            for s, row in enumerate(tables):
                print(f"{s:4} " + "".join(f"{v:12.6f}" for v in row))
        bad = 0
        if check:
            weight = model.transformer.h[0].mlp.c_fc.weight  # full values: collective on FSDP/ZeRO
            full = weight.full_tensor() if hasattr(weight, "full_tensor") else _full(wrapped, weight)
            full = full.cpu()  # the reference runs on the CPU
            if rank == 0:
                ref_tables, ref_weight = _reference(batches, world)
                ok = all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
                         for a, b in zip(tables, ref_tables))
                ok = ok and full.numel() == ref_weight.numel() and torch.allclose(
                    full.reshape(ref_weight.shape), ref_weight, atol=1e-5, rtol=0)
                print("check against one process, plain autograd, global batch:",
                      "OK" if ok else "MISMATCH")
                bad = 0 if ok else 1
        return bad
    finally:
        # Drop the wrapper first (a DDP module keeps the process group alive), so that the
        # group's threads end here rather than while the interpreter exits, where gloo has been
        # seen to abort ("terminate called without an active exception") now and then.
        wrapped = model = opt = options = None
        end_job()


def end_job() -> None:
    """The end of every demo: collect what the caller dropped (the engine and its wrapper keep
    process groups, receive buffers and pooled greenlets alive), then destroy the groups, so that
    their threads end here rather than while the interpreter exits."""
    gc.collect()
    if dist.is_initialized():  # distgrad destroys it on every rank after a failure
        dist.destroy_process_group()


def _init(engine: str) -> None:
    """Start the process group (accelerate's Accelerator starts its own): gloo on the CPU,
    nccl where each rank has a GPU."""
    if engine == "accelerate":
        return
    here = device()
    backend = "gloo" if here.type == "cpu" else "nccl"
    if here.type == "cuda":
        torch.cuda.set_device(here)
    dist.init_process_group(backend)
    if engine.startswith("zero"):
        import deepspeed
        deepspeed.init_distributed(dist_backend=backend)


def _full(wrapped, weight):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    if isinstance(wrapped, FSDP):
        with FSDP.summon_full_params(wrapped):
            return weight.param.detach().clone()
    return weight.detach().clone()


def _reference(batches, world):
    """One process: the same steps on the global batch. DDP and FSDP average over ranks, so the
    global loss is divided by the world size."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tables = []
    for ids in batches:
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


def launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
