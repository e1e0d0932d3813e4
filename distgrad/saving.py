"""``.save()``: keeping values for after the trace.

``tensor.save()`` (added to ``torch.Tensor`` at import; a new name, so no existing behaviour
changes) and ``distgrad.save(obj)`` mark a value as a result of the trace and return it unchanged.
In a body written directly under ``with model.trace(...)`` every name is an ordinary Python name,
so an unsaved value is still there afterwards; saving is what makes a value reach the code after
an invoke block, and what a parallel engine gathers to rank 0.
"""
from __future__ import annotations

import torch

from .errors import TraceStateError
from .session import current_body


def save(obj):
    """Keep ``obj`` (a tensor or any object) for use after the trace; returns ``obj``."""
    body = current_body()
    if body is None:
        raise TraceStateError(
            ".save() was called outside a trace. Values exist only while a trace runs: call "
            ".save() inside `with model.trace(...):` (or a backward block), e.g. "
            "`h = model.transformer.h[0].output.save()`.")
    body.saves.append(obj)
    return obj


def _tensor_save(self: torch.Tensor) -> torch.Tensor:
    """distgrad: keep this tensor for use after the trace (see ``distgrad.save``)."""
    return save(self)


def install() -> None:
    existing = getattr(torch.Tensor, "save", None)
    if existing is None:
        torch.Tensor.save = _tensor_save
    elif existing is not _tensor_save:
        raise RuntimeError("torch.Tensor.save is already defined by another library; distgrad "
                           "cannot add its .save(). Use distgrad.save(x) instead.")
