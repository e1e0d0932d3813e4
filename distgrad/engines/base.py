"""The one interface between the tracing core and a parallel engine.

The core (trace, sessions, backward blocks) calls only these methods; each engine (DDP, FSDP,
DeepSpeed, accelerate, tensor and pipeline parallel) is one file that implements them. The
single-process engine is ``local.py``.
"""
from __future__ import annotations

from typing import Any

import torch


class Engine:
    """How distgrad drives one wrapped object.

    * ``model`` is the user's own module tree: paths such as ``model.transformer.h[0]`` are
      looked up in it, so wrapper prefixes (``module.``, ``_fsdp_wrapped_module.``) never show.
    * ``forward`` calls the wrapper, so the engine's own forward hooks run.
    * ``root`` is the module whose output is ``model.output``.
    """

    name = "base"

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    @property
    def model(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def root(self) -> torch.nn.Module:
        return self.model

    def forward(self, args: tuple, kwargs: dict):
        raise NotImplementedError

    def generate(self, args: tuple, kwargs: dict):
        return self.model.generate(*args, **kwargs)

    def backward(self, tensor: torch.Tensor, fn, args: tuple, kwargs: dict):
        """Run the real backward of ``tensor`` (``fn`` is the unpatched ``Tensor.backward``)."""
        return fn(tensor, *args, **kwargs)

    def owns(self, module: torch.nn.Module) -> bool:
        """Whether this process runs ``module`` (False on pipeline stages that do not)."""
        return True

    def gather(self, saves: list) -> list:
        """Saved values as rank 0 should see them after the trace; one process: unchanged."""
        return saves

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1
