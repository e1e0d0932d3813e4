"""``.grad`` inside a body: the one class attribute distgrad swaps, and why nobody else notices.

While a trace or a backward block is open, ``torch.Tensor.grad`` is a property that first asks
"is the caller a with-block body?" (its greenlet is in ``BODIES``). Only then, and only for a tensor
of the graph that is not an ``nn.Parameter`` and does not ``retain_grad()``, is the read or write
served by distgrad. Every other caller - an optimizer, FSDP's post-backward, DeepSpeed's ZeRO
hooks, a ``register_post_accumulate_grad_hook`` - runs on autograd's thread, in the run's greenlet
or outside any body, and gets PyTorch's own descriptor. When the last trace closes the class
attribute is deleted again, so outside traces ``Tensor.grad`` is untouched C code.
"""
from __future__ import annotations

import threading

import greenlet
import torch

from .session import BODIES

_PLAIN = torch._C.TensorBase.__dict__["grad"]
_getcurrent = greenlet.getcurrent
_lock = threading.Lock()
_depth = 0


def _served(tensor) -> bool:
    return not isinstance(tensor, torch.nn.Parameter) and not tensor.retains_grad


def _get(tensor):
    if BODIES:
        body = BODIES.get(_getcurrent())
        if body is not None and _served(tensor):
            from .backward import read_grad
            value = read_grad(body, tensor)
            if value is not _PLAIN_MARK:
                return value
    return _PLAIN.__get__(tensor, type(tensor))


def _set(tensor, value):
    if BODIES:
        body = BODIES.get(_getcurrent())
        if body is not None and body.block is not None and _served(tensor) and tensor.requires_grad:
            from .backward import write_grad
            write_grad(body, tensor, value)
            return
    _PLAIN.__set__(tensor, value)


def _delete(tensor):
    _PLAIN.__delete__(tensor)


_PLAIN_MARK = object()
_PROPERTY = property(_get, _set, _delete, _PLAIN.__doc__)


def acquire() -> None:
    global _depth
    with _lock:
        if _depth == 0:
            torch.Tensor.grad = _PROPERTY
        _depth += 1


def release() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0 and torch.Tensor.__dict__.get("grad") is _PROPERTY:
            del torch.Tensor.grad


def is_patched() -> bool:
    return "grad" in torch.Tensor.__dict__
