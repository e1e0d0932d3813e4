"""Engines: one file per way of running a model. ``select`` picks the one for a wrapped object."""
from __future__ import annotations

import torch

from .base import Engine
from .local import LocalEngine


def select(obj) -> Engine:
    if isinstance(obj, Engine):
        return obj
    if isinstance(obj, torch.nn.Module):
        return LocalEngine(obj)
    raise TypeError(f"distgrad.wrap() needs a torch.nn.Module, got {type(obj).__name__}.")


__all__ = ["Engine", "LocalEngine", "select"]
