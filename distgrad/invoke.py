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

from . import batching, capture
from .errors import OutOfOrderError, TraceStateError
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

    def __enter__(self) -> "Invoke":
        frame = sys._getframe(1)
        self.code, self.names, first_line = capture.capture(frame)
        self.frame = frame
        self.trace.invokes.append(self)
        capture.skip(frame, first_line)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not capture.SkipBody:
            return False
        capture.resume_tracing(exc)
        return True


def run_invokes(trace) -> None:
    invokes = trace.invokes
    frame = invokes[0].frame
    args, kwargs, rows = batching.join([inv.inputs for inv in invokes], trace.model._tokenizer)
    scheduler = greenlet.getcurrent()
    bodies = [Body(trace, rows=r, index=i, scheduler=scheduler) for i, r in enumerate(rows)]
    trace.forward = trace.open_session(bodies, args, kwargs)
    trace.forward.slices = trace.slices = {}
    trace.backward = None
    namespace = {**frame.f_globals, **frame.f_locals}
    runners = BodyRunners({body: (lambda code=inv.code: exec(code, namespace))
                           for inv, body in zip(invokes, bodies)}, BODIES)
    try:
        _schedule(trace, bodies, runners)
    finally:
        runners.close()
        if trace.backward is not None:
            if not trace.backward.finished:
                trace.backward.abort()
            trace.backward.close()
        else:  # a backward after the trace fills them
            fill_retained_grads(trace.slices)
    saved = {id(entry[0]) for body in bodies for entry in body.saves}
    trace.body.saves.extend(v for body in bodies for v in body.saves)
    names = {}
    for inv in invokes:
        for name in inv.names:
            if name in namespace:
                value = namespace[name]
                names[name] = value if id(value) in saved else capture.NotSaved(name)
    capture.write_back(frame, names)


def _schedule(trace, bodies: list[Body], runners: BodyRunners) -> None:
    wake = runners.wake
    for body in bodies:
        wake(body)
    while runners.todo:
        waiting = [b for b in bodies if runners.live(b)]
        session = trace.backward if trace.forward.finished else trace.forward
        if session is not None and not session.finished and any(
                b.pending in session.wanted for b in waiting):
            session.advance()
            served = [b for b in waiting if b.stop is not None and b.pending is not None]
            if session.finished:
                served = [b for b in waiting if b.pending in session.wanted]
            for body in served:
                wake(body)
            continue
        if not trace.forward.finished:
            trace.forward.finish()
            continue
        starting = [b for b in waiting if b.pending == _BACKWARD]
        if starting and trace.backward is None:
            trace.backward = _backward_session(trace, bodies)
            for body in starting:
                wake(body)
            continue
        if trace.backward is not None and not trace.backward.finished:
            trace.backward.finish()
            continue
        done = [b for b in waiting if b.pending == _BACKWARD_DONE]
        for body in (done or waiting):  # a body still waiting now waits for nothing that comes
            wake(body)


def _backward_session(trace, bodies: list[Body]) -> Session:
    blocks = [b.block for b in bodies if b.pending == _BACKWARD]
    first = blocks[0]
    if any(b.kwargs != first.kwargs for b in blocks):
        raise TraceStateError("the invokes' backward blocks pass different keyword arguments "
                              "to backward(); one backward runs for the whole batch.")

    def run():
        if all(not b.args for b in blocks):
            total = sum(b.tensor for b in blocks[1:]) + blocks[0].tensor if len(blocks) > 1 \
                else blocks[0].tensor
            return first.backend.backward(total, first.fn, (), first.kwargs)
        grads = [b.args[0] if b.args else None for b in blocks]
        return torch.autograd.backward([b.tensor for b in blocks], grads, **first.kwargs)

    from .backward import backward_threaded
    fill_retained_grads(trace.slices)
    session = Session("backward", run, bodies, size=trace.forward.size,
                      threaded=backward_threaded(first.tensor))
    session.slices = trace.slices
    return session


def fill_retained_grads(slices: dict) -> None:
    """``retain_grad()`` on an invoke's rows of a value: the batch's graph goes on from the full
    tensor, not from the body's slice of it, so the slice's own retained gradient would hold at
    most what the body itself computed from it. A hook on the full tensor gives the slice its
    rows of the full gradient, as ``retain_grad()`` on the whole batch and slicing would."""
    for view, full, rows in slices.values():
        if view.retains_grad and full.requires_grad:
            full.register_hook(_RowsOfGrad(view, rows))


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


def invoke_backward(trace, body: Body, block) -> None:
    body.block = block
    _wait(body, _BACKWARD)
    if trace.backward is None:
        raise TraceStateError("the batch's backward could not start.")


def invoke_backward_done(trace, body: Body, block) -> None:
    _wait(body, _BACKWARD_DONE)


def invoke_grad(trace, body: Body, tensor: torch.Tensor):
    from .backward import grad_passed
    session = trace.backward
    entry = trace.slices.get(id(tensor))
    full, rows = (entry[1], body.rows) if entry is not None and entry[0] is tensor else (tensor, None)
    if not tensor.requires_grad:
        raise ValueError(f"{body.label_of(tensor)}.grad: no gradient flows into it, because it "
                         f"does not require grad.")
    point = session.grad_point(full)
    key = (point, point.calls)
    return session.request(body, key, lambda: grad_passed(body.block.tensor, tensor, body),
                           rows=rows, tensor=tensor)


__all__ = ["Invoke", "run_invokes", "OutOfOrderError"]
