"""What the multi-process demos (and tests/dist/job.py) share: this rank's device, starting the
process group for a data-parallel engine, the tiny GPT-2 under that engine, and the end of a job.

Imported in the functions, for the engines that use them only: accelerate and
deepspeed (optional), torch.distributed.fsdp (about half a second) and transformers' GPT2Block.
"""

from __future__ import annotations

import gc
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

# launch/zero{1,2,3}.json, beside the package in a source checkout
LAUNCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch")


def device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK) where CUDA is available, else the CPU.
    ``DISTGRAD_DEVICE=cpu`` keeps a GPU machine on the CPU path."""
    if torch.cuda.is_available() and os.environ.get("DISTGRAD_DEVICE", "") != "cpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def start_process_group(engine: str) -> None:
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


def wrap_with_engine(engine: str, net, lr: float = 0.1, ds_config: str | None = None):
    """``net`` (the tiny GPT-2) under one engine, the way the demo, launch scripts and tests use
    it. Returns what the user would hand to ``distgrad.wrap`` and the keyword arguments for it."""
    here = device()
    if engine == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=here.type == "cpu")
        return accelerator.prepare(net), {"accelerator": accelerator}
    world = dist.get_world_size()
    net = net.to(here)
    if engine.startswith("zero"):
        import deepspeed

        with open(ds_config or os.path.join(LAUNCH_DIR, f"{engine}.json")) as f:
            config = json.load(f)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        ds_engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
        return ds_engine, {"deepspeed": True}
    if engine == "ddp":
        return DistributedDataParallel(
            net, device_ids=None if here.type == "cpu" else [here.index]
        ), {}
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(here.type, (world,))
        for block in net.transformer.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(net, mesh=mesh), {}
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return FullyShardedDataParallel(
            net,
            use_orig_params=True,
            device_id=here,
            auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
        ), {}
    raise SystemExit(
        f"--engine {engine}: use ddp, fsdp1, fsdp2, accelerate, zero1, zero2 or zero3."
    )


def end_job() -> None:
    """The end of every demo: collect what the caller dropped (the engine and its wrapper keep
    process groups, receive buffers and pooled greenlets alive), then destroy the groups, so that
    their threads end here rather than while the interpreter exits."""
    gc.collect()
    if dist.is_initialized():  # distgrad destroys it on every rank after a failure
        dist.destroy_process_group()
