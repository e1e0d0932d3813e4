"""``.grad`` inside a body: the one class attribute distgrad adds, and why nobody else notices.

``patches.install()`` (run at import) puts a property named ``grad`` on ``torch.Tensor`` that first
asks "is the caller a with-block body?" (its greenlet is in ``BODIES``; with no trace open that is
one empty-dict check). Only then, and only for a tensor of the graph that is not an ``nn.Parameter``
and does not ``retain_grad()``, is the read or write served by distgrad. Every other caller - an
optimizer, FSDP's post-backward, DeepSpeed's ZeRO hooks, a ``register_post_accumulate_grad_hook``
- runs on autograd's thread, in the run's greenlet or outside any body, and gets the ``grad``
``torch.Tensor`` had before (PyTorch's own descriptor, or a property another library installed
first), so it sees exactly what it would without distgrad.

Why once at import and not per trace: changing a class attribute of ``torch.Tensor`` resets
CPython's specialised bytecode for every tensor method call site, which makes the next
forward slower, while the property itself adds little to a ``.grad`` access. A trace
installs it again only if another library has put its own ``grad`` over it since
(``patches.keep_on_top``).
"""

from __future__ import annotations

import greenlet
import torch

from . import patches
from .backward import refuse_outside_block, write_grad
from .errors import check_replacement_grad
from .interleave.session import BODIES, UNSET
from .torch_internals import PLAIN_GRAD

_PLAIN = PLAIN_GRAD
_getcurrent = greenlet.getcurrent


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def served(tensor) -> bool:
    # `type(t) is Tensor` first: Parameter's isinstance goes through a Python metaclass hook.
    return (
        tensor.__class__ is _Tensor or not isinstance(tensor, _Parameter)
    ) and not tensor.retains_grad


class BodyGrad(property):
    """The ``grad`` property distgrad puts on ``torch.Tensor`` (a subclass only to be told
    apart from another library's property)."""

    __slots__ = ()


def make_property(previous) -> BodyGrad:
    """The body-aware ``grad`` over ``previous``: the ``grad`` that ``torch.Tensor`` had before
    (PyTorch's own descriptor, or a property another library installed). Every caller that is
    not a distgrad body gets ``previous``, so that library sees exactly what it would without
    distgrad. Made per install: see ``saving.make_tensor_save``."""
    get_previous = previous.__get__
    set_previous = getattr(previous, "__set__", _PLAIN.__set__)
    delete_previous = getattr(previous, "__delete__", _PLAIN.__delete__)

    # get_grad and set_grad are the entry of every `.grad` in a body (three per read+edit), so
    # the common cases are answered here: Pause.value(), served() and Pause.replace() in short.
    def get_grad(tensor):
        if BODIES:
            body = BODIES.get(_getcurrent())
            if body is not None:
                pause = body.pause
                if pause is not None and pause.tensor is tensor:  # the gradient the backward is at
                    value = pause.replacement
                    return pause.view if value is UNSET else value
                if (
                    tensor.__class__ is _Tensor or not isinstance(tensor, _Parameter)
                ) and not tensor.retains_grad:
                    if body.block is not None:
                        pause = body.requests.grad(body, tensor)
                        value = pause.replacement
                        return pause.view if value is UNSET else value
                    refuse_outside_block(body, tensor)
        return get_previous(tensor, tensor.__class__)

    def set_grad(tensor, value):
        if BODIES:
            body = BODIES.get(_getcurrent())
            if body is not None:
                pause = body.pause
                if pause is not None and pause.tensor is tensor:  # `t.grad = t.grad * 2`
                    old = pause.view
                    if not (
                        value.__class__ is _Tensor
                        and value.shape == old.shape
                        and value.dtype == old.dtype
                        and value.device == old.device
                    ):
                        check_replacement_grad(lambda: body.label_of(tensor) + ".grad", old, value)
                    pause.replacement = value
                    return
                if body.block is not None and served(tensor) and tensor.requires_grad:
                    write_grad(body, tensor, value)
                    return
        set_previous(tensor, value)

    return BodyGrad(get_grad, set_grad, delete_previous, _PLAIN.__doc__)


def make_grad(previous):
    """The body-aware ``grad`` property over ``previous`` (PyTorch's, when the class has none)."""
    return make_property(_PLAIN if previous is None else previous)


patches.register("grad", make_grad)
