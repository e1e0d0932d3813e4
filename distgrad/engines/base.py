"""The one interface between the tracing core and a parallel engine.

The core (trace, sessions, backward blocks) uses only these attributes and methods; each engine (DDP, FSDP,
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
    # How hook values are shown to the body: None shows them as they are. Tensor parallelism
    # sets a ``TensorParallelViews`` (whole values in, shards out); see tensor_parallel.py.
    views = None
    # Whether a trace body may run as a generator resumed by the run's hooks (the core's fast
    # path, generator_run.py): only where the forward and backward are plain calls on one thread.
    generator_bodies = False
    # Whether the engine runs the trace body itself, once per piece of the step (pipeline
    # parallelism: once per microbatch). The core then captures the body's code when the trace
    # opens, skips it where the user wrote it, and hands it to ``run_captured``.
    captures_body = False

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

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The user's module behind an engine's per-module wrapper (FSDP1 wraps submodules)."""
        return module

    def param(self, param: torch.nn.Parameter, path: str):
        """What ``model.<path>`` gives for a parameter: one whose ``.grad`` is the full,
        reduced gradient (a collective on sharded engines) and can be assigned."""
        return param

    def begin_trace(self) -> None:
        """Called on every rank when a trace opens (multi-process engines start watching for
        a peer's failure)."""

    def end_trace(self, saves: list, error: BaseException | None):
        """Called on every rank when a trace ends, after its forward and backward finished.

        ``saves`` holds ``(value, gather, dim)`` per ``.save()``. Without ``error``: make the saved
        values global (one process: nothing to do). With ``error``: tell the other ranks. Returns
        an exception to raise instead of ``error``, or None."""
        return None

    def run_captured(self, trace, code, names: tuple, frame) -> None:
        """Run the captured trace body (``code``, compiled from the user's block; ``names``: the
        locals it binds; ``frame``: the user's frame, to give those names back). Called when the
        block ends, by engines with ``captures_body`` only."""
        raise NotImplementedError(f"{type(self).__name__} does not capture trace bodies")

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1
