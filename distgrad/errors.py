"""The errors distgrad raises, and the helpers that word them.

Every message names what the user wrote (``model.transformer.h[0].output``, ``a1.grad``) and
says what to do; docs/errors.rst has a page for each.
"""

from __future__ import annotations

import os

import torch

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class OutOfOrderError(RuntimeError):
    """A value was requested after the run had already passed it.

    The forward serves ``.output``/``.input`` in forward order; a backward block serves ``.grad``
    in reverse-forward order (later layers first).
    """


class StepsEnded(OutOfOrderError):
    """A ``tracer.iter[...]`` / ``tracer.all()`` loop asked for a step the run did not make.
    distgrad ends the body there with a warning (``steps.py``), as nnsight does; the values saved
    in the steps made are kept."""


class NotSavedError(NameError):
    """A name bound inside an invoke body was used after the trace without having been saved."""


class TraceStateError(RuntimeError):
    """An operation was used where it has no meaning: ``.save()`` outside a trace, ``.grad`` of a
    traced activation outside a backward block, a forward value after the forward ended."""


class TraceUsageError(TraceStateError, ValueError):
    """A trace or invoke block written so that it cannot run, where nnsight raises
    ``ValueError``: a trace with no inputs, an invoke inside an invoke (or beside inputs, or
    after the body read a value), a module value read or ``.save()`` called outside the block
    that serves it. Both ``except TraceStateError`` and ``except ValueError`` catch it."""


class GradientError(ValueError, RuntimeError):
    """A gradient that cannot be read or replaced as written: ``.grad`` of a tensor that does
    not require grad, a replacement of another shape, dtype or device. A ``ValueError``, and a
    ``RuntimeError`` as PyTorch's own hook error for the same mistake is (what nnsight raises)."""


class ModuleIndexError(IndexError, AttributeError):
    """``model.transformer.h[7]`` past the end of a ``ModuleList`` (or a missing key of a
    ``ModuleDict``). An ``IndexError``, and an ``AttributeError`` as nnsight's error for the
    same path is."""


def describe_tensor(t: torch.Tensor) -> str:
    """A short human label for a tensor that distgrad did not name itself."""
    fn = type(t.grad_fn).__name__ if t.grad_fn is not None else "leaf"
    return f"tensor of shape {list(t.shape)} ({fn}, {t.dtype}, {t.device})"


def check_replacement_grad(label, old: torch.Tensor, new) -> None:
    """Refuse a replacement gradient that autograd would reject later with a vaguer message.
    ``label`` is the name the user wrote (``a1.grad``), or a function that words it."""
    if (
        isinstance(new, torch.Tensor)
        and new.shape == old.shape
        and new.dtype == old.dtype
        and new.device == old.device
    ):
        return
    if callable(label):
        label = label()
    if not isinstance(new, torch.Tensor):
        raise TypeError(
            f"{label} = ... needs a torch.Tensor, got {type(new).__name__}. "
            f"Build the replacement from the gradient, e.g. {label} = {label} * 2."
        )
    problems = []
    if new.shape != old.shape:
        problems.append(f"shape {list(new.shape)} instead of {list(old.shape)}")
    if new.dtype != old.dtype:
        problems.append(f"dtype {new.dtype} instead of {old.dtype}")
    if new.device != old.device:
        problems.append(f"device {new.device} instead of {old.device}")
    if problems:
        raise GradientError(
            f"{label} = ... : the replacement gradient has "
            + ", ".join(problems)
            + f". A replacement must match the gradient it replaces; build it from "
            f"{label} (e.g. {label} * 2, torch.zeros_like({label}))."
        )


class RankFailedError(RuntimeError):
    """Another rank of a distributed job failed during the trace (its message is included), or
    stopped answering. Raised on every rank but the one that failed."""


def _chain(exc):
    """``exc`` and every exception in its cause and context chains, once each."""
    seen, todo = set(), [exc]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        todo.append(exc.__cause__)
        todo.append(exc.__context__)


def forget_frames(exc: BaseException) -> None:
    """Clear the locals of distgrad's own finished frames in the tracebacks of ``exc``.

    Those frames hold the run's objects (an outcome, a driver, a session) that hold the
    exception again, so each would be a reference cycle through the traceback, keeping the
    step's tensors alive until the cycle collector runs. The user's frames keep their locals
    (post-mortem debugging); distgrad's own lose them once the exception leaves the trace."""
    for found in _chain(exc):
        tb = found.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.startswith(_PACKAGE):
                try:
                    frame.clear()
                except RuntimeError:  # still running: the frame that is handling it
                    pass
            tb = tb.tb_next


def drop_context(exc: BaseException, internal: BaseException) -> None:
    """Unlink ``internal`` (an exception distgrad raised and handled itself) from the context
    chain of ``exc``, which Python set only because ``exc`` was raised while ``internal`` was
    being handled. The user's traceback then shows their own exception, as it was raised:
    the link goes to what was being handled when ``internal`` was raised (the user's own
    exception, when the trace runs in an ``except`` block), as plain Python would have it."""
    outer = internal.__context__
    for found in _chain(exc):
        if found.__context__ is internal:
            found.__context__ = outer if outer is not found else None  # (never a cycle)
