"""Module values inside gradient-checkpointed blocks (``torch.utils.checkpoint``).

A checkpointed block keeps none of its activations: the backward runs the block's forward
again (the *recompute*) to rebuild the tensors autograd saved. distgrad's point fires in the
recompute too, but the body is long past that value, so without help the recompute would run
without the body's edits, and its rebuilt activations would not be those of the forward the body
saw: wrong parameter gradients, silently. The points call ``hand`` instead of ``session.hand``
whenever a value is produced under saved-tensor hooks or with gradients off, and this module
keeps the recompute faithful:

* ``use_reentrant=False`` (the forward runs with gradients, under the checkpoint's saved-tensor
  hooks; the recompute only rebuilds the saved tensors of the original graph, in order). While
  the body runs inside such a block its own operations save their tensors as usual rather than
  through the checkpoint, so the block's saved tensors are the same in the forward and in the
  recompute. An edited value is kept (a copy, with no graph) and handed back by a hook when the
  recompute reaches the same call, found by the number of tensors the block had saved when the
  call returned. That hook lives exactly as long as the block's checkpoint record, which the
  graph holds, so a backward after the trace gets it too.
* ``use_reentrant=True`` (the forward runs under ``torch.no_grad()`` and the recompute builds
  the graph the gradient flows through). A kept value would cut the gradient to the block's
  parameters and the body's edit cannot be run again, so an edit there raises; so does ``.grad``
  of a value read there (it has no gradient), with a message that says so.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict

import torch
from torch.utils import checkpoint as _torch_checkpoint

from ..torch_internals import (
    closure_cells,
    grad_enabled,
    new_hook_id,
    pre_hooks_with_kwargs,
    top_saved_tensor_hooks,
)
from .kinds import KINDS

_REENTRANT_FORWARD = _torch_checkpoint.CheckpointFunction.forward.__code__
_FORWARD_PACK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_RECOMPUTE_PACK = "_recomputation_hook.__init__.<locals>.pack_hook"
_USE_NON_REENTRANT = (
    "net.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{'use_reentrant': False}) for a transformers model (under Trainer: "
    "TrainingArguments(gradient_checkpointing_kwargs={'use_reentrant': "
    "False})), or torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
)

# Tensors handed to a body from inside a use_reentrant=True block, by id: `.grad` of them
# explains why there is no gradient. Weak values, so nothing here keeps a tensor alive.
_NO_GRAD_INSIDE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _closure(fn, name: str):
    return closure_cells(fn)[name]


def _forward_frame(pack):
    """The checkpoint record of the non-reentrant block whose forward is running, or None."""
    if getattr(pack, "__qualname__", None) == _FORWARD_PACK:
        return _closure(pack, "frame")
    return None


def _recompute_target(pack):
    """(checkpoint record, backward id) of the recompute that is running, or None."""
    inner = getattr(pack, "__wrapped__", pack)
    if getattr(inner, "__qualname__", None) == _RECOMPUTE_PACK:
        return _closure(inner, "target_frame_ref")(), _closure(inner, "gid")
    return None


def _reentrant_forward_args():
    """The tensor arguments of the use_reentrant=True block whose forward is running, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return frame.f_locals.get("args", ())
        frame = frame.f_back
    return None


def hand(point, key, value):
    """``point.session.hand(key, value)`` for a value produced under saved-tensor hooks or with
    gradients off: inside a checkpointed block, keep the backward's recompute faithful."""
    session = point.session
    hooks = top_saved_tensor_hooks(True)
    frame = _forward_frame(hooks[0]) if hooks is not None else None
    if frame is not None:
        position = len(frame.weak_holders)  # tensors the block has saved so far
        # The body's own operations save their tensors as usual, not as the block's.
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            reply = session.hand(key, value)
        if reply is not None:
            Replay(point, frame, position, reply)
        return reply
    if grad_enabled():
        return session.hand(key, value)
    inputs = _reentrant_forward_args()
    if inputs is None:
        return session.hand(key, value)
    _mark_no_grad(value)
    reply = session.hand(key, value)
    if reply is not None and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        raise NotImplementedError(
            f"{point.label} was edited inside a block under gradient checkpointing with "
            f"use_reentrant=True. That block's forward runs without gradients and the backward "
            f"runs it again to build the graph, without your edit, so the parameter gradients "
            f"would not be those of the edited forward. Use non-reentrant checkpointing "
            f"({_USE_NON_REENTRANT}), or turn gradient checkpointing off."
        )
    return reply


def _same(tensor):
    return tensor


def _mark_no_grad(value) -> None:
    for tensor in _tensors(value):
        _NO_GRAD_INSIDE[id(tensor)] = tensor


def read_without_grad(tensor) -> bool:
    """Whether ``tensor`` was handed to a body from inside a use_reentrant=True block."""
    return _NO_GRAD_INSIDE.get(id(tensor)) is tensor


def no_grad_message(label: str) -> str:
    return (
        f"{label}.grad: no gradient flows into it, because it was computed inside a block "
        f"under gradient checkpointing with use_reentrant=True, whose forward runs under "
        f"torch.no_grad() (the backward computes the block's gradients from a second run "
        f"that the body does not see). Use non-reentrant checkpointing "
        f"({_USE_NON_REENTRANT}), or turn gradient checkpointing off."
    )


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _copy(value):
    """A copy of ``value`` with fresh tensors that carry no graph but ask for gradients as the
    originals did, so that the recompute saves the same tensors after them."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_copy(item) for item in value)
    if isinstance(value, list):
        return [_copy(item) for item in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: _copy(item) for k, item in value.items()}
    return value


class Replay:
    """Hands the body's edit of one call back to the recompute of its checkpointed block.

    Its hook sits in the module's hook dict right after the point's (hooks registered later
    see the edited value, as in the forward) and leaves when the block's checkpoint record is
    freed, that is when the graph that needs the recompute is."""

    __slots__ = ("label", "frame", "position", "value", "served", "__weakref__")

    def __init__(self, point, frame, position: int, reply):
        self.label = point.label
        self.frame = weakref.ref(frame)
        self.position = position
        self.value = _copy(reply)
        self.served: set = set()  # backward ids whose recompute got the value
        module, hid, kind = point.module, new_hook_id(), KINDS[point.kind]
        hooks = kind.hooks(module)
        if kind.with_kwargs:
            pre_hooks_with_kwargs(module)[hid] = True
        hooks[hid] = self._fire
        _place_after(hooks, point.hid, hid)
        weakref.finalize(frame, _remove, hooks, pre_hooks_with_kwargs(module), hid)

    def _matches(self) -> bool:
        hooks = top_saved_tensor_hooks(True)
        target = _recompute_target(hooks[0]) if hooks is not None else None
        if target is None or target[0] is not self.frame():
            return False  # not the recompute of this block (a forward, another block)
        frame, gid = target
        if frame.recomp_counter.get(gid, 0) != self.position:
            return False
        if gid in self.served:  # two calls of the module at one place: no way to tell them apart
            raise NotImplementedError(
                f"{self.label} was edited inside a block under gradient checkpointing, and the "
                f"block calls that module more than once with nothing saved for the backward in "
                f"between, so distgrad cannot tell which call to repeat the edit on when the "
                f"backward runs the block again. Edit a module called once in the block, or turn "
                f"gradient checkpointing off for it."
            )
        self.served.add(gid)
        return True

    def _fire(self, module, *args):
        """The hook: the edited value, in the recompute of this block at this call only."""
        return _copy(self.value) if self._matches() else None


def _place_after(hooks: OrderedDict, before, hid) -> None:
    """Move ``hid`` (just added, last) to right after ``before``: the hooks after it keep
    their order behind it."""
    keys = list(hooks)
    if before not in hooks:
        return
    for key in keys[keys.index(before) + 1 :]:
        if key != hid:
            hooks.move_to_end(key)


def _remove(hooks, with_kwargs, hid) -> None:
    hooks.pop(hid, None)
    with_kwargs.pop(hid, None)
