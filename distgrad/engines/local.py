"""One process, plain PyTorch: the module is its own wrapper.

A plain module may still run in a job of several processes (``self.net`` of a LightningModule
under its DDP strategy, a module wrapped before ``init_process_group``): each trace checks, and
where it does, ``in_job.ModuleInJob`` serves the trace (saves gathered to rank 0 as the global
batch, parameter gradients checked, the library's backward required). On one process, a module
that Lightning or Fabric holds (``owners.py``) refuses a plain backward as on several, so that
a script does not change behaviour from one device to two: under automatic optimization it
would be a second backward, under Fabric or manual optimization it bypasses the library's.
"""

from __future__ import annotations

import torch

from .base import Engine
from .in_job import ModuleInJob, engine_for_job
from .owners import (
    called_by_library_backward,
    enclosing_modules,
    library_holding,
    library_imported,
    library_refusal,
)


class LocalEngine(Engine):
    name = "local"

    def __init__(self, wrapped):
        super().__init__(wrapped)
        self.in_job: ModuleInJob | None = None  # made at the first trace in such a job
        self.owners: list | None = None  # the module and its parents, once Lightning is imported
        self.library = None  # the LightningModule or Fabric module holding it, this trace

    @property
    def model(self) -> torch.nn.Module:
        return self.wrapped

    def forward(self, args, kwargs, call=None):
        if self.in_job is not None:  # (its forward keeps what its end-of-trace checks read)
            return self.in_job.forward(args, kwargs, call)
        return (call or self.wrapped)(*args, **kwargs)

    def after_backward(self, roots) -> None:
        if self.in_job is not None:  # parameters beside the model, averaged over the job
            self.in_job.after_backward(roots)

    def begin_trace(self) -> None:
        self.in_job = engine_for_job(self.in_job, self.wrapped)
        if self.in_job is not None:
            self.in_job.begin_trace()
        elif library_imported():
            if self.owners is None:
                self.owners = [self.wrapped, *enclosing_modules(self.wrapped)]
            self.library = library_holding(self.owners)  # (attached to a Trainer: per trace)

    def end_trace(self, saves, error):
        return None if self.in_job is None else self.in_job.end_trace(saves, error)

    def backward(self, tensor, fn, args, kwargs):
        if self.in_job is not None:
            return self.in_job.backward(tensor, fn, args, kwargs)
        self.refuse_plain_backward("a `with loss.backward():` block")
        return fn(tensor, *args, **kwargs)

    def plain_backward(self) -> None:
        if self.in_job is not None:
            self.in_job.plain_backward()
        elif self.library is not None and not called_by_library_backward():
            self.refuse_plain_backward("a plain `.backward()` in the trace's body")

    def refuse_plain_backward(self, what: str) -> None:
        if self.library is not None:
            raise library_refusal(what, self.wrapped, self.library, 1)

    def param(self, param, path):
        return param if self.in_job is None else self.in_job.param(param, path)

    @property
    def rank(self) -> int:
        return 0 if self.in_job is None else self.in_job.rank

    @property
    def world_size(self) -> int:
        return 1 if self.in_job is None else self.in_job.world_size
