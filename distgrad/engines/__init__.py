"""Engines: one file per way of running a model, behind ``base.Engine`` (and ``base.ShardViews``
where hook values are sharded across ranks); ``select`` picks the one for a wrapped object.

* ``local.py``, ``ddp.py``, ``fsdp1.py``, ``fsdp2.py``, ``deepspeed.py``, ``accelerate.py``,
  ``fabric.py``, ``tensor_parallel.py``: one engine each; ``in_job.py``: a plain module traced
  in a job of several processes (``local.py`` hands its traces there);
* ``ranks/``: what every multi-process engine shares (ranks, failure, the end-of-trace gather);
* ``pipeline/``: pipeline parallelism (torch's schedules and DeepSpeed's pipeline engine).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from ..torch_internals import pipeline_schedule_class
from ..wrappers import compiled_inner
from . import tensor_parallel
from .accelerate import AccelerateEngine, PreparedWithoutAccelerator
from .base import Engine
from .ddp import DDPEngine
from .deepspeed import DeepSpeedEngineAdapter
from .fabric import FabricEngine, forward_module, is_fabric_module
from .fsdp2 import FSDP2Engine, is_fully_sharded
from .local import LocalEngine
from .pipeline import DeepSpeedPipeEngine, PipelineEngine


def select(
    obj, accelerator=None, tp_shards: dict | None = None, full_model=None, *, inner: bool = False
) -> Engine:
    """The engine for what the user wrapped: DDP, FSDP1, FSDP2 (``fully_shard``), a model
    prepared by accelerate (with its ``accelerator``), a module from Lightning Fabric's
    ``setup``, a model split by ``parallelize_module`` (alone or under ``fully_shard``), or a
    plain module. ``inner``: choosing the engine under
    an accelerate engine."""
    if isinstance(obj, Engine):
        return obj
    if _is_pipeline_schedule(obj):
        return PipelineEngine(obj, full_model)
    compiled = compiled_inner(obj)
    if compiled is not None and accelerator is None:
        # torch.compile(DDP(net)) and the like: traces run eager (wrappers.py), so the engine
        # of the wrapper inside drives them; a compiled plain module stays a LocalEngine, so
        # that both model.<path> and model._orig_mod.<path> work.
        engine = select(compiled, None, tp_shards, full_model, inner=inner)
        if type(engine) is not LocalEngine:
            return engine
    if is_fabric_module(obj):  # Lightning Fabric's: the engine of the module it calls
        return FabricEngine(obj, select(forward_module(obj), accelerator, tp_shards, full_model))
    if accelerator is None and not inner and getattr(obj, "_is_accelerate_prepared", False):
        # prepared by accelerate, wrapped without its accelerator (accelerate.py)
        return PreparedWithoutAccelerator(obj, select(obj, inner=True))
    if isinstance(obj, torch.nn.Module) and accelerator is None:
        parallel = tensor_parallel.find_parallel_modules(obj)
        if parallel:
            return tensor_parallel.select_engine(obj, parallel, tp_shards)
    if tp_shards:
        raise ValueError(
            "distgrad.wrap(..., tp_shards=...) is for models split with "
            "parallelize_module, and this one is not."
        )
    if accelerator is not None:
        return AccelerateEngine(obj, accelerator, select(obj, inner=True))
    if type(obj).__name__ == "PipelineEngine" and type(obj).__module__.startswith("deepspeed"):
        return DeepSpeedPipeEngine(obj, full_model)
    if type(obj).__name__ == "DeepSpeedEngine":  # no import: deepspeed is optional and slow
        return DeepSpeedEngineAdapter(obj)
    if isinstance(obj, DistributedDataParallel):
        return DDPEngine(obj)
    # torch.distributed.fsdp takes half a second to import: only when a model may use it
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(obj, FullyShardedDataParallel):
        from .fsdp1 import FSDP1Engine  # (imports torch.distributed.fsdp)

        return FSDP1Engine(obj)
    if is_fully_sharded(obj):
        return FSDP2Engine(obj)
    if isinstance(obj, torch.nn.Module):
        return LocalEngine(obj)
    raise TypeError(f"distgrad.wrap() needs a torch.nn.Module, got {type(obj).__name__}.")


def _is_pipeline_schedule(obj) -> bool:
    schedule_class = pipeline_schedule_class()
    return schedule_class is not None and isinstance(obj, schedule_class)


__all__ = [
    "Engine",
    "LocalEngine",
    "DDPEngine",
    "FSDP2Engine",
    "AccelerateEngine",
    "FabricEngine",
    "DeepSpeedEngineAdapter",
    "PipelineEngine",
    "DeepSpeedPipeEngine",
    "select",
    "is_fully_sharded",
]
