"""What a traced training step of a library keeps (``trainer.py``, ``lightning.py``): one
``TracedStep`` per micro-batch, holding what the user's intervention returned, saved."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .interleave.session import current_body
from .saving import owned_tensors, save


class TracedStep(NamedTuple):
    """One traced micro-batch: ``step`` optimizer steps had been taken before it,
    ``micro_batch`` is its index among that step's accumulated micro-batches (0 without
    gradient accumulation), ``value`` what the intervention returned, saved."""

    step: int
    micro_batch: int
    value: Any


def copies_of_model_state(value, module):
    """``value`` with copies of the tensors the model owns (a parameter, its ``.grad``, a
    buffer): the next micro-batch accumulates into ``.grad`` in place and the optimizer
    changes the parameters, so a record must hold their values as they were."""
    own = owned_tensors(module)

    def copy(obj):
        if isinstance(obj, torch.Tensor):
            return obj.detach().clone() if id(obj) in own else obj
        if isinstance(obj, dict):
            return {key: copy(item) for key, item in obj.items()}
        if type(obj) in (tuple, list):  # (a named tuple's fields stay as they are)
            return type(obj)(copy(item) for item in obj)
        return obj

    return copy(value)


def save_unsaved(value) -> None:
    """Save what the intervention returned, leaving out tensors it saved itself."""
    kept = {id(obj) for obj, _, _ in current_body().saves}

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            if id(obj) not in kept:
                save(obj)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item)

    walk(value)
