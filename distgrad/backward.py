"""The backward block: ``with loss.backward(...):`` and ``distgrad.BackwardTracer``.

``patches.install()`` wraps ``torch.Tensor.backward`` so that a call written as the subject of
a ``with`` statement returns a ``BackwardTracer`` instead of running at once; any other call
runs the real backward unchanged, inside a trace or not (in a body, the body's requests hear of
it first: an invoke's rows of a value that retain their gradient are hooked up then). If
another library replaced ``Tensor.backward`` before (nnsight does, for its own
``with loss.backward():``), every call outside a distgrad body is that library's. Inside the
block the real backward runs as a coroutine of the body (``interleave/transports.py``): ``t.grad``
pauses it where the gradient of ``t`` is computed, and what the body puts there flows on
upstream.
"""

from __future__ import annotations

import dis
import sys
import types
from collections.abc import Callable
from typing import Any

import greenlet
import torch

from . import patches
from .errors import TraceStateError
from .interleave.gradients import backward_threaded, close_session, grad_pause
from .interleave.requests import Requests
from .interleave.session import BODIES, Body, Session, current_body
from .torch_internals import TENSOR_MODULE_FILE, scaled_by


class BackwardTracer:
    """Read and edit gradients inside ``with loss.backward():``.

    Opened by ``with tensor.backward(*args, **kwargs):``, inside a trace or not. In the block,
    ``t.grad`` is the gradient flowing into ``t`` (request them in reverse-forward order),
    ``t.grad = g`` replaces it for everything upstream, ``t.grad[:] = 0`` edits it in place, and
    ``.save()`` keeps a value for after the block.

    Args:
        tensor: the tensor whose ``.backward(...)`` was invoked.
        fn: the real, unpatched ``Tensor.backward`` to run.
        *args: passed to ``fn`` (e.g. ``gradient``).
        backend: the engine that runs the backward (a ``distgrad.engines.Engine``); by default the
            trace's engine, or plain ``fn`` outside a trace.
        scaler: a ``torch.amp.GradScaler``, for mixed precision: the backward runs on
            ``scaler.scale(tensor)`` (what ``scaler.scale(loss).backward()`` does), and the body
            sees every gradient unscaled; what it writes there is scaled back before it flows on.
        **kwargs: passed to ``fn`` (e.g. ``retain_graph=True``).
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        fn: Callable,
        *args: Any,
        backend: Any = None,
        scaler: Any = None,
        **kwargs: Any,
    ):
        self.tensor = tensor  # the tensor whose backward runs (the scaled loss, with a scaler)
        self.loss = tensor  # as the user wrote it
        self.scaler = scaler
        self.scale: float | None = None  # what the gradients are divided by in the body
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.backend = backend
        self.session: Session | None = None
        self._body: Body | None = None
        self._own_body = False

    # -- the with-block -------------------------------------------------------------------
    def __enter__(self) -> BackwardTracer:
        body = current_body()
        if body is not None and body.requests.backward_refused:
            raise NotImplementedError(body.requests.backward_refused)
        if not self.tensor.requires_grad:
            raise NotImplementedError(
                "`with loss.backward():` over a tensor that does not require grad: the forward "
                "carried no gradient tracking (torch.no_grad(), torch.inference_mode(), or a "
                "frozen model with inputs that need no grad), so there is no graph to walk. Run "
                "the trace with gradients enabled and at least one parameter or input requiring "
                "grad."
            )
        if body is not None and body.block is not None:
            raise TraceStateError(
                "a backward block is already open in this body; close it before opening another."
            )
        if body is None:  # a block outside any trace
            patches.keep_on_top()
            body = Body(NO_TRACE)
            BODIES[greenlet.getcurrent()] = body
            self._own_body = True
        self._body = body
        try:
            if self.scaler is not None:
                self._scale_loss(body)
            body.requests.open_backward(body, self)  # its session shows gradients / self.scale
        except BaseException:
            self._leave()
            raise
        body.block = self
        return self

    def __exit__(self, exc_type, exc, tb):
        body = self._body
        try:
            body.requests.close_backward(body, self, exc)
        finally:
            body.block = None
            self._leave()
        return False

    def _scale_loss(self, body: Body) -> None:
        scaler, loss = self.scaler, self.loss
        label = f"backward(scaler=...) on {body.label_of(loss)}"
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"{label}: scaler= takes a torch.amp.GradScaler (the one whose "
                f"scaler.step(optimizer) follows), not {type(scaler).__name__}."
            )
        if not body.requests.unscales:
            raise NotImplementedError(
                f"{label}: scaler= is served in a trace without invokes and outside a "
                f"pipeline schedule only (this one runs its bodies {body.requests.mode!r}). "
                f"Open `with scaler.scale(loss).backward():` instead; its gradients are scaled "
                f"by scaler.get_scale()."
            )
        engine = body.requests.engine
        if engine is not None and engine.own_backward:
            raise NotImplementedError(
                f"{label}: the {engine.name} engine runs the backward its own way, which scales "
                f"or divides the loss itself (its own loss scaler, gradient accumulation); a "
                f"second scaler would scale it again. Configure mixed precision through "
                f"{engine.name} and open `with loss.backward():`; its gradients are scaled as "
                f"{engine.name} scales them."
            )
        if scaled_by(loss, scaler):
            raise ValueError(
                f"{label}: this scaler has scaled that loss already, so the backward would "
                f"scale it twice. Pass the unscaled loss "
                f"(`with loss.backward(scaler=scaler):`), or drop scaler= to see the scaled "
                f"gradients (`with scaler.scale(loss).backward():`)."
            )
        if scaler.is_enabled():  # a disabled scaler scales nothing: plain gradients
            self.tensor = scaler.scale(loss)
            self.scale = scaler.get_scale()

    def _leave(self):
        if self._own_body:
            BODIES.pop(greenlet.getcurrent(), None)
            self._own_body = False

    def run(self):
        """The backward itself: the engine's, or plain ``fn`` outside a trace."""
        if self.backend is not None:
            return self.backend.backward(self.tensor, self.fn, self.args, self.kwargs)
        return self.fn(self.tensor, *self.args, **self.kwargs)

    def execute(
        self, code: types.CodeType, globals: dict | None = None, locals: dict | None = None
    ) -> None:
        """Run ``code`` (a compiled body) as the block's body, with the real backward.

        Equivalent to writing ``with tensor.backward(...):`` around the code; ``globals`` and
        ``locals`` default to the caller's."""
        frame = sys._getframe(1)
        with self:
            exec(
                code,
                frame.f_globals if globals is None else globals,
                frame.f_locals if locals is None else locals,
            )


class BackwardAttribute:
    """``torch.Tensor.backward`` as distgrad installs it over ``previous`` (the entry the class
    had: PyTorch's own function, or another library's backward).

    A descriptor rather than a wrapper function, so that where distgrad has no body it hands out
    ``previous`` itself, bound, for the caller to call directly: a library such as nnsight
    finds the ``with`` block of ``with loss.backward():`` by counting frames up from its own
    backward, and a wrapper between the caller and it would shift that count. Over PyTorch's
    own backward there is nobody to hand the call to, and distgrad serves ``with`` blocks
    outside any trace too. ``torch.Tensor.backward`` read off the class is the function
    (``__wrapped__``: the backward it calls)."""

    __slots__ = ("function", "previous", "defers")

    def __init__(self, previous):
        real = previous.__get__(None, torch.Tensor)  # a function: PyTorch's, or another's

        def backward(self, *args, **kwargs):
            if _opens_with(sys._getframe(1)):
                return BackwardTracer(self, real, *args, **kwargs)
            body = current_body()
            if body is None:
                return real(self, *args, **kwargs)
            body.requests.plain_backward(body, self)  # the run may have to prepare
            result = real(self, *args, **kwargs)
            body.requests.backward_done(body, [self])  # (the engine reduces what it must)
            return result

        backward.__doc__ = real.__doc__
        backward.__wrapped__ = real
        self.function = backward
        self.previous = previous
        self.defers = not _is_torch_backward(real)

    def __get__(self, tensor, owner=None):
        if tensor is None:
            return self.function
        if self.defers and (not BODIES or BODIES.get(greenlet.getcurrent()) is None):
            return self.previous.__get__(tensor, owner)
        return types.MethodType(self.function, tensor)


patches.register("backward", BackwardAttribute)


def _is_torch_backward(function) -> bool:
    code = getattr(function, "__code__", None)
    return (
        code is not None and code.co_name == "backward" and code.co_filename == TENSOR_MODULE_FILE
    )


# -- is this call the subject of a `with`? -------------------------------------------------
_WITH_OPS = {"BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH", "LOAD_SPECIAL"}
_sites: dict = {}


def _opens_with(frame) -> bool:
    site = (frame.f_code, frame.f_lasti)
    known = _sites.get(site)
    if known is None:
        known = _sites[site] = _next_op(frame.f_code, frame.f_lasti) in _WITH_OPS
    return known


def _next_op(code, offset: int) -> str | None:
    # f_lasti is the CALL (3.12+) or one of its inline cache slots (3.11): the next real
    # instruction after it tells whether the call's result is entered as a context manager.
    for ins in dis.get_instructions(code):
        if ins.offset > offset and ins.opname not in ("CACHE", "EXTENDED_ARG"):
            return ins.opname
    return None


# -- .grad in a body -----------------------------------------------------------------------
def refuse_outside_block(body: Body, tensor: torch.Tensor) -> None:
    """``tensor.grad`` read in a body with no backward block open: an error for a tensor of the
    graph (its gradient exists only while the backward runs); PyTorch's own value otherwise."""
    if tensor.grad_fn is not None:
        raise TraceStateError(
            f"{body.label_of(tensor)}.grad was read outside a backward block. Gradients "
            f"exist only while the backward runs: read it inside `with loss.backward():`."
        )


def write_grad(body: Body, tensor: torch.Tensor, value) -> None:
    body.requests.grad(body, tensor).replace(value, lambda: body.label_of(tensor) + ".grad")


class NoTraceRequests(Requests):
    """The requests of a backward block opened outside any trace: its gradients only."""

    unscales = True

    def open_backward(self, body, block) -> None:
        block.session = Session(
            "backward",
            block.run,
            [body],
            threaded=backward_threaded(block.tensor),
            scale=block.scale,
        )

    grad = staticmethod(grad_pause)

    def close_backward(self, body, block, error) -> None:
        close_session(block.session, error)


NO_TRACE = NoTraceRequests()
