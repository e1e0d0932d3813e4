"""Invokes: several inputs in one batch, each body seeing only its own rows.

    with model.trace() as tr:
        with tr.invoke("The Eiffel Tower is in"):
            a = model.transformer.h[0].output.save()      # rows of this invoke only
        with tr.invoke(["Paris is", "Rome is"]):
            b = model.transformer.h[0].output.save()

Each body is captured (``capture.py``) and run at the end of the trace block as a greenlet. The
scheduler here runs one forward over the joined batch and, at every hook point, serves the bodies
waiting there in invoke order, each with its own rows; their edits are merged back row-wise. If
bodies open backward blocks, one backward runs over the sum of their losses and gradients are
served the same way.
"""
from __future__ import annotations

import sys
import weakref

import greenlet
import torch

from .. import capture
from ..errors import TraceStateError
from . import batching
from .gradients import backward_threaded, grad_passed
from .in_place import InPlace
from .invoke_names import InvokeNames, namespace
from .run import BodyRunners
from .session import BODIES, Body, Session

_BACKWARD = ("backward", "start")
_BACKWARD_DONE = ("backward", "done")


class Invoke:
    def __init__(self, trace, args: tuple, kwargs: dict):
        self.trace = trace
        self.inputs = (args, kwargs)
        self.frame = None
        self.code = None
        self.names: list[str] = []
        self.space: dict | None = None  # the caller's names at enter, for the body to run in

    def __enter__(self) -> "Invoke":
        frame = sys._getframe(1)
        self.code, self.names, first_line = capture.capture(frame)
        self.frame = frame
        self.space = namespace(frame)
        self.trace.invokes.append(self)
        capture.skip(frame, first_line)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not capture.SkipBody:
            return False
        capture.resume_tracing(exc)
        return True


class Invokes(InPlace):
    """The requests of a trace with invokes: one forward over the joined batch, and one
    backward over the sum of the bodies' losses, each body served its own rows."""

    mode = "invokes"
    unscales = False  # one backward for every invoke's block, each with its own arguments

    def __init__(self, trace):
        super().__init__(trace)
        self.backward: Session | None = None  # the batch's backward, once a body opens a block
        self.slices: dict = {}  # id(view) -> (view, full, rows): the bodies' rows of values
        self.hooked: set = set()  # ids of those views whose retained gradient is hooked up

    def forward_session(self) -> Session:
        raise TraceStateError("in a trace with invokes, read model values inside the "
                              "`with tracer.invoke(...):` blocks.")

    def result(self, body):
        raise TraceStateError("tracer.result is not served in a trace with invokes (each "
                              "invoke's rows would have to be cut out of generate's padded ids): "
                              "pass the whole batch to model.generate(...) and read it there.")

    def run_rest(self) -> None:
        trace = self.trace
        invokes = trace.invokes
        frame = invokes[0].frame
        args, kwargs, rows = batching.join([inv.inputs for inv in invokes], trace.tokenizer)
        scheduler = greenlet.getcurrent()
        bodies = [Body(self, rows=r, index=i, scheduler=scheduler) for i, r in enumerate(rows)]
        self.forward = self.open_session(bodies, args, kwargs)
        self.forward.slices = self.slices
        names = InvokeNames([inv.space for inv in invokes],
                            [name for inv in invokes for name in inv.names])
        for inv in invokes:
            inv.space = None  # the bodies hold them now, and nothing after them
        runners = names.runners(bodies, [inv.code for inv in invokes], BODIES)
        try:
            self._schedule(bodies, runners)
        finally:
            runners.close()
            if self.backward is not None:
                if not self.backward.finished:
                    self.backward.abort()
                self.backward.close()
            else:  # a backward after the trace fills them
                fill_retained_grads(self.slices, self.hooked)
            for body in bodies:
                body.requests = None
        saved = {id(entry[0]) for body in bodies for entry in body.saves}
        trace.body.saves.extend(v for body in bodies for v in body.saves)
        capture.write_back(frame, {name: value if id(value) in saved else capture.NotSaved(name)
                                   for name, value in names.bound_values().items()})

    def _schedule(self, bodies: list[Body], runners: BodyRunners) -> None:
        wake = runners.wake
        for body in bodies:
            wake(body)
        while runners.todo:
            waiting = [b for b in bodies if runners.live(b)]
            session = self.backward if self.forward.finished else self.forward
            if session is not None and not session.finished and any(
                    b.pending in session.wanted for b in waiting):
                session.advance()
                served = [b for b in waiting if b.stop is not None and b.pending is not None]
                if session.finished:
                    served = [b for b in waiting if b.pending in session.wanted]
                for body in served:
                    wake(body)
                continue
            if not self.forward.finished:
                self.forward.finish()
                continue
            starting = [b for b in waiting if b.pending == _BACKWARD]
            if starting and self.backward is None:
                self.backward = self._backward_session(bodies)
                for body in starting:
                    wake(body)
                continue
            if self.backward is not None and not self.backward.finished:
                self.backward.finish()
                continue
            done = [b for b in waiting if b.pending == _BACKWARD_DONE]
            for body in (done or waiting):  # a body still waiting now waits for nothing that comes
                wake(body)

    def _backward_session(self, bodies: list[Body]) -> Session:
        blocks = [b.block for b in bodies if b.pending == _BACKWARD]
        first = blocks[0]
        kwargs = _batch_backward_kwargs(blocks)

        def run():
            if all(not b.args for b in blocks):
                total = sum(b.tensor for b in blocks[1:]) + blocks[0].tensor if len(blocks) > 1 \
                    else blocks[0].tensor
                return first.backend.backward(total, first.fn, (), kwargs)
            grads = [b.args[0] if b.args else None for b in blocks]
            return torch.autograd.backward([b.tensor for b in blocks], grads, **kwargs)

        fill_retained_grads(self.slices, self.hooked)
        session = Session("backward", run, bodies, size=self.forward.size,
                          threaded=backward_threaded(first.tensor))
        session.slices = self.slices
        return session

    # -- what an invoke body asks for ------------------------------------------------------
    def open_backward(self, body, block) -> None:
        if block.backend is None:
            block.backend = self.engine
        body.block = block
        _wait(body, _BACKWARD)
        if self.backward is None:
            raise TraceStateError("the batch's backward could not start.")

    def close_backward(self, body, block, error) -> None:
        if error is None:
            _wait(body, _BACKWARD_DONE)

    def grad(self, body, tensor: torch.Tensor):
        session = self.backward
        entry = self.slices.get(id(tensor))
        full, rows = (entry[1], body.rows) if entry is not None and entry[0] is tensor \
            else (tensor, None)
        if not tensor.requires_grad:
            raise ValueError(f"{body.label_of(tensor)}.grad: no gradient flows into it, because "
                             f"it does not require grad.")
        point = session.grad_point(full)
        key = (point, point.calls)
        return session.request(body, key, lambda: grad_passed(body.block.tensor, tensor, body),
                               rows=rows, tensor=tensor)

    def plain_backward(self, body, tensor) -> None:
        """``loss.backward()`` as a plain call in a body: PyTorch's backward runs at once, over
        the batch's graph, so the body's rows that retain their gradient are hooked up first."""
        fill_retained_grads(self.slices, self.hooked)

    def close(self) -> None:
        self.backward = self.slices = self.hooked = None
        super().close()


def _batch_backward_kwargs(blocks) -> dict:
    """The keyword arguments of the batch's one backward. ``retain_graph`` may differ between
    the blocks (nnsight's pattern passes it to every block but the last, since each of its
    blocks would free the graph): the graph is kept if any block asks for it, which every
    block's later use of the graph needs. Other arguments must agree."""
    def others(kwargs):
        return {k: v for k, v in kwargs.items() if k != "retain_graph"}

    kwargs = others(blocks[0].kwargs)
    if any(others(b.kwargs) != kwargs for b in blocks):
        raise TraceStateError("the invokes' backward blocks pass different keyword arguments "
                              "to backward(); one backward runs for the whole batch.")
    if any(b.kwargs.get("retain_graph") for b in blocks):
        kwargs["retain_graph"] = True
    return kwargs


def fill_retained_grads(slices: dict, hooked: set) -> None:
    """``retain_grad()`` on an invoke's rows of a value: the batch's graph goes on from the full
    tensor, not from the body's slice of it, so the slice's own retained gradient would hold at
    most what the body itself computed from it. A hook on the full tensor gives the slice its
    rows of the full gradient, as ``retain_grad()`` on the whole batch and slicing would.
    ``hooked``: the slices hooked up already, by an earlier backward of the trace."""
    for key, (view, full, rows) in slices.items():
        if key not in hooked and view.retains_grad and full.requires_grad:
            full.register_hook(_RowsOfGrad(view, rows))
            hooked.add(key)


class _RowsOfGrad:
    """The hook: writes ``grad[rows]`` into the slice's ``.grad``, accumulated over backwards
    as retain_grad() does. It holds the slice weakly: the full tensor holds the hook, and the
    slice holds the full tensor (its base)."""

    def __init__(self, view, rows: slice):
        self.view = weakref.ref(view)
        self.rows = rows
        self.before = view.grad  # what the slice had accumulated before these backwards

    def __call__(self, grad):
        view = self.view()
        if view is not None:
            rows = grad[self.rows]
            # Set, not added to view.grad: the slice's own retain_grad hook has already put
            # there what the body computed from it, which these rows include.
            total = rows.clone() if self.before is None else self.before + rows
            view.grad = self.before = total


def _wait(body: Body, key) -> None:
    body.pending = key
    try:
        body.scheduler.switch()
    finally:
        body.pending = None


__all__ = ["Invoke", "Invokes"]
