"""``.grad`` inside a body: the one class attribute distgrad adds, and why nobody else notices.

``install()`` (run at import) puts a property named ``grad`` on ``torch.Tensor`` that first asks
"is the caller a with-block body?" (its greenlet is in ``BODIES``; with no trace open that is one
empty-dict check). Only then, and only for a tensor of the graph that is not an ``nn.Parameter``
and does not ``retain_grad()``, is the read or write served by distgrad. Every other caller - an
optimizer, FSDP's post-backward, DeepSpeed's ZeRO hooks, a ``register_post_accumulate_grad_hook``
- runs on autograd's thread, in the run's greenlet or outside any body, and gets PyTorch's own
descriptor, so it sees exactly what it would without distgrad.

Why once at import and not per trace: changing a class attribute of ``torch.Tensor`` resets
CPython's specialised bytecode for every tensor method call site, which cost ~80 us on the next
forward of a tiny GPT-2 (measured: ``benchmarks/overhead.py`` history in docs/performance.rst);
the property itself costs ~0.1 us per ``.grad`` access.
"""
from __future__ import annotations

import greenlet
import torch

from .backward import grad_stop, refuse_outside_block, write_grad
from .errors import check_replacement_grad
from .session import _UNSET, BODIES

_PLAIN = torch._C.TensorBase.__dict__["grad"]
_getcurrent = greenlet.getcurrent


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def _served(tensor) -> bool:
    # `type(t) is Tensor` first: Parameter's isinstance goes through a Python metaclass hook.
    return ((tensor.__class__ is _Tensor or not isinstance(tensor, _Parameter))
            and not tensor.retains_grad)


# _get and _set run for every `.grad` in a body (three times per read+edit), so the common
# cases are written out here rather than called: Stop.value(), _served(), Stop.replace().
def _get(tensor):
    if BODIES:
        body = BODIES.get(_getcurrent())
        if body is not None:
            stop = body.stop
            if stop is not None and stop.tensor is tensor:  # the gradient the backward is at
                value = stop.replacement
                return stop.view if value is _UNSET else value
            if ((tensor.__class__ is _Tensor or not isinstance(tensor, _Parameter))
                    and not tensor.retains_grad):
                if body.block is not None:
                    stop = grad_stop(body, tensor)
                    value = stop.replacement
                    return stop.view if value is _UNSET else value
                refuse_outside_block(body, tensor)
    return _PLAIN.__get__(tensor, tensor.__class__)


def _set(tensor, value):
    if BODIES:
        body = BODIES.get(_getcurrent())
        if body is not None:
            stop = body.stop
            if stop is not None and stop.tensor is tensor:  # `t.grad = t.grad * 2`
                old = stop.view
                if not (value.__class__ is _Tensor and value.shape == old.shape
                        and value.dtype == old.dtype and value.device == old.device):
                    check_replacement_grad(lambda: body.label_of(tensor) + ".grad", old, value)
                stop.replacement = value
                return
            if body.block is not None and _served(tensor) and tensor.requires_grad:
                write_grad(body, tensor, value)
                return
    _PLAIN.__set__(tensor, value)


def _delete(tensor):
    _PLAIN.__delete__(tensor)


_PROPERTY = property(_get, _set, _delete, _PLAIN.__doc__)


def install() -> None:
    """Add the body-aware ``grad`` property to ``torch.Tensor``. Idempotent."""
    if torch.Tensor.__dict__.get("grad") is not _PROPERTY:
        torch.Tensor.grad = _PROPERTY


def is_installed() -> bool:
    return torch.Tensor.__dict__.get("grad") is _PROPERTY
