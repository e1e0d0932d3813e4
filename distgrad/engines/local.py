"""One process, plain PyTorch: the module is its own wrapper.

A plain module may still run in a job of several processes (``self.net`` of a LightningModule
under its DDP strategy, a module wrapped before ``init_process_group``): each trace checks, and
where it does, ``in_job.ModuleInJob`` serves the trace (saves gathered to rank 0 as the global
batch, parameter gradients checked, the library's backward required).
"""

from __future__ import annotations

import torch

from .base import Engine
from .in_job import ModuleInJob, job_world


class LocalEngine(Engine):
    name = "local"

    def __init__(self, wrapped):
        super().__init__(wrapped)
        self.in_job: ModuleInJob | None = None  # made at the first trace in such a job

    @property
    def model(self) -> torch.nn.Module:
        return self.wrapped

    def forward(self, args, kwargs):
        return self.wrapped(*args, **kwargs)

    def begin_trace(self) -> None:
        if self.in_job is None and job_world() > 1:
            self.in_job = ModuleInJob(self.wrapped)
        if self.in_job is not None:
            self.in_job.begin_trace()

    def end_trace(self, saves, error):
        return None if self.in_job is None else self.in_job.end_trace(saves, error)

    def backward(self, tensor, fn, args, kwargs):
        if self.in_job is not None:
            return self.in_job.backward(tensor, fn, args, kwargs)
        return fn(tensor, *args, **kwargs)

    def plain_backward(self) -> None:
        if self.in_job is not None:
            self.in_job.plain_backward()

    def param(self, param, path):
        return param if self.in_job is None else self.in_job.param(param, path)

    @property
    def rank(self) -> int:
        return 0 if self.in_job is None else self.in_job.rank

    @property
    def world_size(self) -> int:
        return 1 if self.in_job is None else self.in_job.world_size
