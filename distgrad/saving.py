"""``.save()``: keeping values for after the trace.

``tensor.save()`` (added to ``torch.Tensor`` at import) and ``distgrad.save(obj)`` mark a value
as a result of the trace and return it unchanged. Outside a distgrad body ``tensor.save()`` is
whatever it would be without distgrad: another library's ``save`` (nnsight mounts one on every
object), or with none distgrad's error.
In a body written directly under ``with model.trace(...)`` every name is an ordinary Python name,
so an unsaved value is still there afterwards; saving is what makes a value reach the code after
an invoke block, and what a parallel engine gathers to rank 0.
"""

from __future__ import annotations

import weakref

import greenlet
import torch

from . import patches
from .errors import TraceUsageError
from .interleave.session import BODIES, current_body
from .torch_internals import view_base

_getcurrent = greenlet.getcurrent


GATHER_MODES = ("rank0", "all", "none")


def save(obj, *, gather: str = "rank0", dim: int = 0):
    """Keep ``obj`` (a tensor or any object) for use after the trace; returns ``obj``.

    Under a parallel engine the saved tensors are gathered when the trace ends, after the
    backward has finished on every rank:

    * ``gather="rank0"`` (default): on rank 0 the tensor becomes the global-batch view, the
      ranks' tensors concatenated along ``dim`` in rank order (a 0-dim tensor is stacked to
      shape ``[world_size]``); on other ranks it keeps the rank-local value.
    * ``gather="all"``: every rank gets the global view.
    * ``gather="none"``: every rank keeps its own value; nothing is sent.

    Where the ranks' tensors differ in a dim other than ``dim`` too (each rank's batch padded
    to its own length), the global value is padded to the largest rank's size with NaN and
    ``distgrad.rank_parts(value)`` gives each rank's tensor; a ragged save of a dtype without
    NaN (integers, bool) raises. Tensors inside a saved dict, tuple or model output are
    gathered the same way. On one process all modes keep the value as it is.
    """
    if gather not in GATHER_MODES:
        raise ValueError(f".save(gather={gather!r}): use one of {', '.join(GATHER_MODES)}.")
    body = current_body()
    if body is None:
        raise TraceUsageError(
            ".save() was called outside a trace. Values exist only while a trace runs: call "
            ".save() inside `with model.trace(...):` (or a backward block), e.g. "
            "`h = model.transformer.h[0].output.save()`."
        )
    body.saves.append((obj, gather, dim))
    return obj


def make_tensor_save(previous):
    """``Tensor.save`` as distgrad installs it over ``previous``, the ``save`` that
    ``torch.Tensor`` itself had (another library's, or None).

    In a distgrad body it keeps the tensor. Anywhere else it hands the call to the ``save`` the
    tensor would have without distgrad: ``previous``, or else one a base class has (nnsight
    mounts its ``save`` on ``object``), looked up at each call so that a library imported after
    distgrad is found too. With neither, distgrad's error for a save outside any trace. Made
    per install (a closure, not a module global) so that a library that wrapped an earlier
    install and was then wrapped in turn (``keep_on_top``) makes a chain, never a loop."""

    def tensor_save(self, *args, **kwargs):
        """distgrad: keep this tensor for use after the trace (see ``distgrad.save``)."""
        if not args and not kwargs and BODIES:  # `t.save()` in a body, the common case
            body = BODIES.get(_getcurrent())
            if body is not None:
                body.saves.append((self, "rank0", 0))
                return self
        if current_body() is None:  # not in a distgrad body: e.g. in nnsight's own trace
            if previous is not None:
                return bound(previous, self)(*args, **kwargs)
            inherited = getattr(super(torch.Tensor, self), "save", None)
            if inherited is not None:
                return inherited(*args, **kwargs)
        return save(self, *args, **kwargs)

    return tensor_save


def bound(attribute, tensor):
    """``attribute`` (an entry of a class's dict) as ``tensor.<name>`` would give it."""
    get = getattr(type(attribute), "__get__", None)
    return attribute if get is None else get(attribute, tensor, type(tensor))


class LabelledSaves(list):
    """A body's list of saves that also names each saved gradient, for a multi-process engine
    that checks the ranks saved the same values (``engines/ranks/gather.py``).

    Forward values are named in ``body.labels`` as the body receives them; a gradient is a
    fresh copy the body gets at the backward's pause, named nowhere. So when the body saves the
    very gradient it is at (``a1.grad.save()``, on every body path: each appends here), the
    copy is named after its tensor (``model.transformer.h[0].output.grad``). The body is held
    by a weak reference: the body holds this list, and a cycle would outlive the trace."""

    __slots__ = ("body", "labels")

    def __init__(self, body):
        super().__init__()
        self.body = weakref.ref(body)
        self.labels = body.labels

    def append(self, entry) -> None:
        list.append(self, entry)
        body = self.body()
        pause = body.pause if body is not None else None
        if pause is None or pause.tensor is None:
            return
        saved = entry[0]
        if saved is pause.view or saved is pause.replacement:
            labels, tensor = self.labels, pause.tensor
            named = labels.get(id(tensor))
            if named is not None and named[0] is tensor:
                labels[id(saved)] = (saved, named[1], named[2] + ".grad")
            else:
                labels[id(saved)] = (saved, "the gradient of " + COMPUTED, "")


COMPUTED = "a tensor computed in the body"  # the name of a value that is no module's value


def owned_tensors(module: torch.nn.Module) -> dict:
    """``id -> (tensor, name, what)`` for every tensor ``module`` owns: its parameters, their
    ``.grad`` and its buffers, which the optimizer or the next forward reads (so neither a
    gather may rebind them nor a record keep them as they will change)."""
    own = {}
    for name, p in module.named_parameters():
        own[id(p)] = (p, name, "parameter")
        if p.grad is not None:
            own[id(p.grad)] = (p.grad, name + ".grad", "parameter gradient")
    for name, b in module.named_buffers():
        own[id(b)] = (b, name, "buffer")
    return own


def saved_label(tensor: torch.Tensor, labels: dict) -> tuple:
    """``(path, kind)`` naming a saved tensor by the model value it is, or a view of one;
    ``(COMPUTED, "")`` for anything else (a loss the body computed)."""
    named = labels.get(id(tensor))
    if named is not None and named[0] is tensor:
        return named[1], named[2]
    base = view_base(tensor)
    if base is not None:
        named = labels.get(id(base))
        if named is not None and named[0] is base:
            return "a view of " + named[1], named[2]
    return COMPUTED, ""


patches.register("save", make_tensor_save)
