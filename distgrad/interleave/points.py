"""Hook points: the places where a run stops to hand a value to the body.

A point is installed only when the body first asks for it and removed when its session closes,
so a trace that asks for nothing adds no hook. Each point counts how often it has fired in its
session; a request names a point and one of those counts (``key = (point, call)``), and the hook
stops the run only when some body waits for exactly that key.
"""

from __future__ import annotations

import torch

from ..torch_internals import add_tensor_hook, new_hook_id
from . import checkpointing
from .kinds import KINDS

_NO_REPLY = None
_top_saved_tensor_hooks = checkpointing.top_saved_tensor_hooks
_grad_enabled = checkpointing.grad_enabled


# Why not register_forward_hook / register_hook: each builds a RemovableHandle (a weakref per
# dict, an id, a closure) and removing it walks those again, a large share of what one
# `.output` or `.grad` read costs. A point needs only its entry in the hook dict PyTorch reads,
# so it writes that entry itself (as those methods do) and deletes it when its session closes.


class ModulePoint:
    """A module's value of one kind (``kinds.py``): its output (a forward hook) or its call's
    arguments (a forward pre-hook)."""

    __slots__ = (
        "session",
        "module",
        "path",
        "kind",
        "calls",
        "hid",
        "hooks",
        "hooks_of",
        "key",
        "value_of",
        "with_kwargs",
    )

    def __init__(self, session, module: torch.nn.Module, path: str, kind: str):
        self.module = module
        self.path = path
        self.kind = kind  # a name in kinds.KINDS
        declared = KINDS[kind]
        self.value_of = declared.value
        self.with_kwargs = declared.with_kwargs
        self.hooks_of = declared.hooks
        self.key = (id(module), kind)  # its key in a session's points
        self.hid = new_hook_id()
        self.arm(session)

    def arm(self, session) -> None:
        """Install the hook for ``session`` and enter the point in the session's tables. An
        envoy keeps its points between traces and arms them again, because making a point is a
        large share of what a plain ``.output`` read costs."""
        self.session = session
        self.calls = 0
        hid = self.hid
        if self.with_kwargs:
            # torch_internals.pre_hooks_with_kwargs, inline: this runs for every point armed
            self.module._forward_pre_hooks_with_kwargs[hid] = True
        # The hook dict is looked up at every arm, as PyTorch's register_*_hook does: a library
        # may have given the module a new one since the point was made. The bound method lives
        # only in that dict, so that remove() leaves no point -> method -> point cycle for the
        # cycle collector.
        self.hooks = hooks = self.hooks_of(self.module)
        hooks[hid] = self._fire
        session.points[self.key] = self
        session.installed.append(self)

    @property
    def label(self) -> str:
        return f"{self.path}.{self.kind}"

    def passed(self) -> str:
        """The message for a request of this point after the run went past it."""
        return (
            f"{self.path}.{self.kind} was requested after the run had passed it: the forward "
            f"finished without another call of {self.path} after the point where you asked "
            f"(it ran {self.calls} time(s) since the trace first named it). Read module "
            f"values in the order the forward computes them, or use {self.path}.call(i) for "
            f"the i-th call."
        )

    def _fire(self, module, *args):
        """The hook, on every call of the module: hand the value over if a body waits for this
        call. A pipeline run names calls by microbatch (``session.microbatch``; -1 outside the
        schedule's chunks, e.g. its shape inference, which no body asks for); otherwise calls
        are counted."""
        session = self.session
        call = session.microbatch
        if call is None:
            call = self.calls
            self.calls = call + 1
        key = (self, call)
        if key in session.wanted:
            value = self.value_of(*args)
            if _top_saved_tensor_hooks(True) is None and _grad_enabled():
                return session.hand(key, value)
            return checkpointing.hand(self, key, value)  # perhaps a checkpointed block
        return _NO_REPLY

    def remove(self):
        self.hooks.pop(self.hid, None)
        if self.with_kwargs:
            # torch_internals.pre_hooks_with_kwargs, inline: this runs for every point removed
            self.module._forward_pre_hooks_with_kwargs.pop(self.hid, None)
        self.session = None  # free to be armed again


class GradPoint:
    """The gradient flowing into one tensor during a backward block (a tensor hook)."""

    kind = "grad"
    __slots__ = ("session", "tensor", "calls", "split", "hooks", "hid", "handle")

    def __init__(self, session, tensor: torch.Tensor):
        self.session = session
        self.tensor = tensor
        self.calls = 0
        self.split = None  # how the gradient is sharded (tensor parallel), to show it whole
        # A hook on the tensor itself: fires with the gradient w.r.t. exactly this tensor, and
        # what it returns replaces that gradient for everything upstream. A plain tensor gets
        # the entry Tensor.register_hook would write; a subclass (DTensor) its own method.
        self.hooks, found = add_tensor_hook(tensor, self._on_grad)
        if self.hooks is None:
            self.handle = found
        else:
            self.hid, self.handle = found, None
        session.installed.append(self)  # Session.grad_point also enters it in session.points

    def _on_grad(self, grad):
        call = self.calls
        self.calls = call + 1
        key = (self, call)
        session = self.session
        if key in session.wanted:
            return session.hand(key, grad)
        return _NO_REPLY

    def remove(self):
        if self.hooks is not None:
            self.hooks.pop(self.hid, None)
        else:
            self.handle.remove()
