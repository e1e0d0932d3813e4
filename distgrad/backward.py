"""The backward block: ``with loss.backward(...):`` and ``distgrad.BackwardTracer``.

``patches.install()`` wraps ``torch.Tensor.backward`` so that a call written as the subject of
a ``with`` statement returns a ``BackwardTracer`` instead of running at once; any other call
runs the real backward unchanged, inside a trace or not. If another library replaced
``Tensor.backward`` before (nnsight does, for its own ``with loss.backward():``), every call
outside a distgrad body is that library's. Inside the block the real backward runs as a
coroutine of the body (``run.py``): ``t.grad`` stops it where the gradient of ``t`` is
computed, and what the body puts there flows on upstream.
"""
from __future__ import annotations

import dis
import sys
import types
from typing import Any, Callable

import greenlet
import torch

from .checkpointing import no_grad_message, read_without_grad
from .config import config
from .errors import TraceStateError
from .points import GradPoint
from .session import BODIES, UNSET, Body, Session, current_body
from .torch_internals import TENSOR_MODULE_FILE



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
        **kwargs: passed to ``fn`` (e.g. ``retain_graph=True``).
    """

    def __init__(self, tensor: torch.Tensor, fn: Callable, *args: Any, backend: Any = None,
                 **kwargs: Any):
        self.tensor = tensor
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.backend = backend
        self.session: Session | None = None
        self._body: Body | None = None
        self._own_body = False

    # -- the with-block -------------------------------------------------------------------
    def __enter__(self) -> "BackwardTracer":
        body = current_body()
        if body is not None and body.trace is not None and body.trace.method == "generate":
            raise NotImplementedError(
                "a backward block cannot be opened in a model.generate() trace: generate() runs "
                "under torch.no_grad(), so there is no graph. Use model.trace(...) for gradients.")
        if not self.tensor.requires_grad:
            raise NotImplementedError(
                "`with loss.backward():` over a tensor that does not require grad: the forward "
                "carried no gradient tracking (torch.no_grad(), torch.inference_mode(), or a "
                "frozen model with inputs that need no grad), so there is no graph to walk. Run "
                "the trace with gradients enabled and at least one parameter or input requiring grad.")
        if body is not None and body.block is not None:
            raise TraceStateError("a backward block is already open in this body; close it "
                                  "before opening another.")
        if body is None:  # a block outside any trace
            from .patches import keep_on_top  # (patches imports this module)
            keep_on_top()
            body = Body(None)
            BODIES[greenlet.getcurrent()] = body
            self._own_body = True
        self._body = body
        try:
            if body.trace is not None:
                if self.backend is None:
                    self.backend = body.trace.engine
                if body.scheduler is not None:  # an invoke body: the scheduler runs one backward
                    body.trace.invoke_backward(body, self)
                    body.block = self
                    return self
                body.trace.finish_forward()
            if body.driver is not None:  # a body run as a generator (generator_run.py)
                from .generator_session import GeneratorSession
                self.session = GeneratorSession("backward", self._run, [body], body.driver)
            else:
                self.session = Session("backward", self._run, [body],
                                       threaded=backward_threaded(self.tensor),
                                       views=None if self.backend is None else self.backend.views)
        except BaseException:
            self._leave()
            raise
        body.block = self
        return self

    def __exit__(self, exc_type, exc, tb):
        body = self._body
        try:
            if body.scheduler is not None and self.session is None:
                if exc is None:
                    body.trace.invoke_backward_done(body, self)
            elif exc is None:
                self.session.finish()
            else:
                self.session.abort()
        finally:
            if self.session is not None and body.scheduler is None:
                if not self.session.finished:
                    self.session.abort()
                self.session.close()
            body.block = None
            self._leave()
        return False

    def _leave(self):
        if self._own_body:
            BODIES.pop(greenlet.getcurrent(), None)
            self._own_body = False

    def _run(self):
        if self.backend is not None:
            return self.backend.backward(self.tensor, self.fn, self.args, self.kwargs)
        return self.fn(self.tensor, *self.args, **self.kwargs)

    def execute(self, code: types.CodeType, globals: dict | None = None,
                locals: dict | None = None) -> None:
        """Run ``code`` (a compiled body) as the block's body, with the real backward.

        Equivalent to writing ``with tensor.backward(...):`` around the code; ``globals`` and
        ``locals`` default to the caller's."""
        frame = sys._getframe(1)
        with self:
            exec(code, frame.f_globals if globals is None else globals,
                 frame.f_locals if locals is None else locals)


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
            return real(self, *args, **kwargs)

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


def _is_torch_backward(function) -> bool:
    code = getattr(function, "__code__", None)
    return (code is not None and code.co_name == "backward"
            and code.co_filename == TENSOR_MODULE_FILE)


def backward_threaded(tensor) -> bool:
    mode = config.backward_mode
    if mode == "auto":
        return tensor.device.type != "cpu" or torch.cuda.is_initialized()
    return step_threaded()


def step_threaded() -> bool:
    """Whether a run that contains a backward (a pipeline step) needs a worker thread."""
    mode = config.backward_mode
    if mode == "auto":
        return torch.cuda.is_initialized()
    if mode not in ("greenlet", "thread"):
        raise ValueError(f"distgrad.config.backward_mode must be 'auto', 'greenlet' or 'thread', "
                         f"not {mode!r}.")
    return mode == "thread"


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
            f"exist only while the backward runs: read it inside `with loss.backward():`.")


def write_grad(body: Body, tensor: torch.Tensor, value) -> None:
    grad_stop(body, tensor).replace(value, lambda: body.label_of(tensor) + ".grad")


def grad_stop(body: Body, tensor: torch.Tensor):
    """Where the body reads or writes ``tensor.grad``: stop the backward there. The callers
    (the ``.grad`` property) have found that the body is not already at that gradient."""
    block = body.block
    session = block.session
    if session is None:
        return body.trace.invoke_grad(body, tensor)
    if session.solo:  # one body, whole values: the rest of this function, short
        if not tensor.requires_grad:
            raise _no_grad_flows(body, tensor)
        # No lookup of an earlier point for this tensor: its gradient arrives once per
        # backward, so a second request of it is out of order with a new point as with the old.
        point = GradPoint(session, tensor)
        return session.request_solo(body, (point, 0),
                                    lambda: grad_passed(block.tensor, tensor, body), tensor)
    target, split = tensor, None
    if session.views is not None:  # a value shown whole: hook the shard that flows on
        found = session.views.source(tensor)
        if found is not None:
            target, split = found
    if not target.requires_grad:
        raise _no_grad_flows(body, tensor)
    point = session.points.get(id(target))
    if point is None or point.tensor is not target:
        point = session.grad_point(target, new=True)
    if split is not None:
        point.split = split
    passed = lambda: grad_passed(block.tensor, tensor, body, target)  # noqa: E731
    return session.request(body, (point, point.calls), passed, UNSET, tensor)


def _no_grad_flows(body: Body, tensor) -> ValueError:
    if read_without_grad(tensor):  # read inside a use_reentrant=True checkpointed block
        return ValueError(no_grad_message(body.label_of(tensor)))
    return ValueError(f"{body.label_of(tensor)}.grad: no gradient flows into it, because it does "
                      f"not require grad (computed under torch.no_grad() or from frozen inputs "
                      f"only).")


def grad_passed(root: torch.Tensor, tensor: torch.Tensor, body: Body, target=None):
    label = body.label_of(tensor)  # worded only on this error path: naming is dear
    if not _reaches(root.grad_fn, tensor if target is None else target):
        return ValueError(f"{label}.grad: the backward of {body.label_of(root)} finished without a "
                f"gradient reaching {label}; it is not on the path from that tensor to the "
                f"inputs. Open the backward block on a tensor computed from {label}.")
    earlier = _read_before(body, tensor)
    example = f" ({label}.grad before {earlier}.grad)" if earlier else ""
    return (f"{label}.grad was requested after the backward had passed it. Gradients arrive in "
            f"reverse-forward order: request the .grad of values computed later in the forward "
            f"first{example}.")


def _read_before(body: Body, tensor) -> str | None:
    """The label of the value the body read last before ``tensor`` in the forward, among those
    a gradient can reach: a real path for the error's example."""
    earlier = None
    for value, path, kind in body.labels.values():
        if value is tensor:
            return earlier
        if value.requires_grad:
            earlier = path + kind
    return None


def _reaches(start, tensor) -> bool:
    """Whether the graph from ``start`` leads to ``tensor`` (its grad_fn, or for a leaf its
    AccumulateGrad node). Only used to word an error, so a full walk is fine."""
    target = tensor.grad_fn
    seen, todo = set(), [start]
    while todo:
        fn = todo.pop()
        if fn is None:
            continue
        if fn is target or (target is None and getattr(fn, "variable", None) is tensor):
            return True
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        todo.extend(f for f, _ in fn.next_functions)
    return False
