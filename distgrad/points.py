"""Hook points: the places where a run stops to hand a value to the body.

A point is installed only when the body first asks for it and removed when its session closes,
so a trace that asks for nothing adds no hook. Each point counts how often it has fired in its
session; a request names a point and one of those counts (``key = (point, call)``), and the hook
stops the run only when some body waits for exactly that key.
"""
from __future__ import annotations

import torch

_NO_REPLY = None


class ModulePoint:
    """A module's input (forward pre-hook) or output (forward hook)."""

    def __init__(self, session, module: torch.nn.Module, path: str, kind: str):
        self.session = session
        self.module = module
        self.path = path
        self.kind = kind  # "input" or "output"
        self.calls = 0
        if kind == "output":
            self.handle = module.register_forward_hook(self._on_output)
        else:
            self.handle = module.register_forward_pre_hook(self._on_input, with_kwargs=True)

    @property
    def label(self) -> str:
        return f"{self.path}.{self.kind}"

    # A pipeline run names calls by microbatch (session.microbatch; -1 outside the schedule's
    # chunks, e.g. its shape inference, which no body asks for); otherwise calls are counted.
    # Written out in both hooks: they run on every call of every hooked module.
    def _on_output(self, module, args, output):
        session = self.session
        call = session.microbatch
        if call is None:
            call = self.calls
            self.calls += 1
        key = (self, call)
        if key in session.wanted:
            return session.fire(key, output)
        return _NO_REPLY

    def _on_input(self, module, args, kwargs):
        session = self.session
        call = session.microbatch
        if call is None:
            call = self.calls
            self.calls += 1
        key = (self, call)
        if key in session.wanted:
            return session.fire(key, (args, kwargs))
        return _NO_REPLY

    def remove(self):
        self.handle.remove()


class GradPoint:
    """The gradient flowing into one tensor during a backward block (a tensor hook)."""

    def __init__(self, session, tensor: torch.Tensor):
        self.session = session
        self.calls = 0
        self.split = None  # how the gradient is sharded (tensor parallel), to show it whole
        # A hook on the tensor itself: fires with the gradient w.r.t. exactly this tensor, and
        # what it returns replaces that gradient for everything upstream.
        self.handle = tensor.register_hook(self._on_grad)

    def _on_grad(self, grad):
        call = self.calls
        self.calls += 1
        key = (self, call)
        if key in self.session.wanted:
            return self.session.fire(key, grad)
        return _NO_REPLY

    def remove(self):
        self.handle.remove()
