"""Invokes: several inputs in one batch, each body seeing only its own rows.

    with model.trace() as tr:
        with tr.invoke("The Eiffel Tower is in"):
            a = model.transformer.h[0].output.save()      # rows of this invoke only
        with tr.invoke(["Paris is", "Rome is"]):
            b = model.transformer.h[0].output.save()

An empty ``tr.invoke()`` runs over the whole batch (``in_order.py``); token ids of different
lengths are padded (``token_ids.py``). Each body is captured (``capture.py``) and run at the end
of the trace block as a greenlet. The
scheduler here runs one forward over the joined batch and, at every hook point, serves the bodies
waiting there in invoke order, each with its own rows; their edits are merged back row-wise. If
bodies open backward blocks, one backward runs over the sum of their losses and gradients are
served the same way.
"""

from __future__ import annotations

import sys

import greenlet
import torch

from .. import capture
from ..errors import GradientError, TraceStateError, TraceUsageError
from . import autograd_calls, batching
from .forward_requests import ForwardRequests
from .gradients import backward_threaded, grad_passed
from .in_order import InOrderSession
from .invoke_names import InvokeNames, namespace
from .requests import Requests
from .retained_grads import fill_retained_grads
from .session import BODIES, UNSET, Body, Session
from .transports import BodyRunners

_BACKWARD = ("backward", "start")
_BACKWARD_DONE = ("backward", "done")
_RESULT = ("result",)  # waiting for generate() to return (tracer.result)


class Invoke:
    """One ``with tracer.invoke(...) as invoker:`` block. ``args``/``kwargs``: what it was
    given; ``inputs``: its rows of what the model is called with (see ``inputs``)."""

    def __init__(self, trace, args: tuple, kwargs: dict):
        self.trace = trace
        self.args, self.kwargs = args, kwargs
        self.empty = not args and not kwargs  # sees the whole batch of the other invokes
        self.rows: slice | None = None
        self.prepared = None  # (args, kwargs): its rows of the batch's inputs, once joined
        self.frame = None
        self.code = None
        self.names: list[str] = []
        self.space: dict | None = None  # the caller's names as its block ended, for the body

    @property
    def inputs(self) -> tuple[tuple, dict]:
        """This invoke's rows of the model inputs the batch runs with, as ``(args, kwargs)``:
        text tokenized, token ids padded to the batch's length, with the attention mask
        (call options such as ``max_new_tokens`` left out). An empty invoke's are the whole
        batch's. Known once the batch is joined: in the invoke's body, or after the trace."""
        if self.prepared is None:
            raise TraceStateError(
                "invoker.inputs is known once the invokes' inputs are joined into one batch, "
                "when the invoke bodies run: read it inside the `with tracer.invoke(...) as "
                "invoker:` block or after the trace, not between the invoke blocks."
            )
        return self.prepared

    def __enter__(self) -> Invoke:
        frame = sys._getframe(1)
        self.code, self.names, first_line = capture.capture(frame)
        self.frame = frame
        self.trace.invokes.append(self)
        capture.skip(frame, first_line)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and exc_type is not capture.SkipBody:
            return False
        # the caller's names once the body was skipped: `as invoker` is bound by now, and the
        # loop around the invoke is still at this invoke's step
        self.space = namespace(self.frame)
        if exc_type is None:  # (a body skipped without raising)
            return False
        capture.resume_tracing(exc)
        return True


class Invokes(ForwardRequests):
    """The requests of a trace with invokes: one forward over the joined batch, and one
    backward over the sum of the bodies' losses, each body served its own rows."""

    mode = "invokes"
    unscales = False  # one backward for every invoke's block, each with its own arguments

    def __init__(self, trace):
        super().__init__(trace)
        self.backward: Session | None = None  # the batch's backward, once a body opens a block
        self.slices: dict = {}  # id(view) -> (view, full, rows): the bodies' rows of values
        self.round: list = []  # the blocks the current backward serves
        self.hooked: set = set()  # ids of those views whose retained gradient is hooked up

    def forward_session(self) -> Session:
        raise TraceUsageError(
            "in a trace with invokes, read model values inside the "
            "`with tracer.invoke(...):` blocks."
        )

    def result(self, body):
        """``tracer.result`` in an invoke of a generate trace: this invoke's rows of the ids
        generate() returned, once it has returned (the other bodies' values come first)."""
        if self.trace.method != "generate":
            Requests.result(self, body)  # raises: a forward trace has model.output
        if body.scheduler is None:  # the trace's own body: the invokes run after it
            raise TraceStateError(
                "tracer.result was read in the body of a model.generate() trace with invokes, "
                "outside them: generate() runs the invokes' batch after the trace's own body, "
                "and each invoke's rows of the ids are its own. Read it inside an invoke: "
                "`with tracer.invoke(...): ids = tracer.result.save()`."
            )
        _wait(body, _RESULT)
        if self.generated is UNSET:
            raise TraceStateError("tracer.result: generate() did not return.")
        ids = batching.narrow(self.generated, body.rows, self.forward.size)
        body.remember(ids, "tracer", ".result")
        return ids

    def run_rest(self) -> None:
        trace = self.trace
        invokes = trace.invokes
        args, kwargs = self._join(invokes)
        scheduler = greenlet.getcurrent()
        bodies = [
            Body(self, rows=inv.rows, index=i, scheduler=scheduler) for i, inv in enumerate(invokes)
        ]
        if len(bodies) > 1 and any(inv.empty for inv in invokes):
            self.session_type = InOrderSession  # rows overlap: bodies served one by one
        self.forward = self.open_session(bodies, args, kwargs)
        self.forward.slices = self.slices
        names = InvokeNames(
            [inv.space for inv in invokes],
            [inv.names for inv in invokes],
            [inv.frame for inv in invokes],
        )
        for inv in invokes:
            inv.space = None  # the bodies hold them now, and nothing after them
        runners = names.runners(bodies, [inv.code for inv in invokes], BODIES)
        try:
            with autograd_calls.serving():  # torch.autograd's functions called in the bodies
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
                body.release_held()
        saved = {id(entry[0]) for body in bodies for entry in body.saves}
        trace.body.saves.extend(v for body in bodies for v in body.saves)
        live = _frames_on_stack()
        for frame, values in names.bound_values():
            if id(frame) in live:  # (a helper that opened invokes and has returned: no one)
                capture.write_back(
                    frame,
                    {
                        name: value if id(value) in saved else capture.NotSaved(name)
                        for name, value in values.items()
                    },
                )

    def _join(self, invokes: list[Invoke]) -> tuple[tuple, dict]:
        """The batch's (args, kwargs); sets each invoke's rows and inputs. An empty invoke
        takes the whole batch: the other invokes' inputs, or else the trace's own."""
        trace = self.trace
        given = [inv for inv in invokes if not inv.empty]
        if given:
            args, kwargs, rows = batching.join(
                [(i.args, i.kwargs) for i in given], trace.tokenizer, self.engine.model
            )
            for inv, r in zip(given, rows):
                inv.rows = r
            inputs = (args, kwargs)
            kwargs = batching.with_call_options(kwargs, batching.call_options(trace.raw_inputs[1]))
        elif trace.has_inputs():
            args, kwargs = batching.prepare(*trace.raw_inputs, trace.tokenizer, self.engine.model)
            inputs = (args, {k: v for k, v in kwargs.items() if batching.is_input(k, v)})
        else:
            raise TraceStateError(
                "an empty tracer.invoke() sees the batch of the other invokes, and this trace "
                "has none: give an invoke inputs (tracer.invoke(text)) or pass them to "
                "model.trace(inputs)."
            )
        if trace.method == "generate":
            batching.check_rows_kept(kwargs, self.engine.model)
        size = batching.batch_size(args, kwargs)
        for inv in invokes:
            if inv.empty:
                inv.rows = slice(0, size)
            inv.prepared = batching.narrow(inputs, inv.rows, size)
        return args, kwargs

    def _schedule(self, bodies: list[Body], runners: BodyRunners) -> None:
        wake = runners.wake
        for body in bodies:
            wake(body)
        while runners.todo:
            waiting = [b for b in bodies if runners.live(b)]
            session = self.backward if self.forward.finished else self.forward
            following = session.serve_next() if session is not None else None
            if following is not None:  # rows overlap: the next body at this value, in order
                wake(following)
                continue
            if (
                session is not None
                and not session.finished
                and any(b.pending in session.wanted for b in waiting)
            ):
                session.advance()
                served = [b for b in waiting if b.pause is not None and b.pending is not None]
                if session.finished:
                    served = [b for b in waiting if b.pending in session.wanted]
                for body in served:
                    wake(body)
                continue
            if not self.forward.finished:
                self.forward.finish()
                continue
            if self.backward is not None and not self.backward.finished:
                self.backward.finish()
                continue
            # The round's backward has ended: its bodies leave their blocks before the next
            # round starts, so that each body's next block joins a backward of its own.
            done = [b for b in waiting if b.pending == _BACKWARD_DONE]
            if done:
                for body in done:
                    wake(body)
                continue
            starting = [b for b in waiting if b.pending == _BACKWARD]
            if starting:
                if self.backward is not None:
                    self.backward.close()
                self.backward = self._backward_session(bodies, starting)
                for body in starting:
                    wake(body)
                continue
            for body in waiting:  # a body still waiting now waits for nothing that comes
                wake(body)

    def _backward_session(self, bodies: list[Body], starting: list[Body]) -> Session:
        """One round of backward blocks: the next block of each body that opens one. Their
        backward is one, over the sum of their losses (the k-th block of every body that has
        one runs in the k-th backward over the batch's graph)."""
        blocks = [b.block for b in starting]
        first = blocks[0]
        kwargs = round_kwargs(starting)

        def run():
            # always through the engine's backward (DDP's check, accelerate's and DeepSpeed's
            # own backward). Several blocks run as one scalar: a block's loss, or for a block
            # given `gradient=g`, (tensor * g).sum(), whose backward hands each tensor exactly
            # g, as autograd.backward([tensor], [g]) would.
            if len(blocks) == 1:
                root, args, kwargs_ = first.tensor, first.args, {**first.kwargs, **kwargs}
            else:
                given = [b.args[0] if b.args else b.kwargs.get("gradient") for b in blocks]
                parts = [
                    b.tensor if g is None else (b.tensor * g).sum() for b, g in zip(blocks, given)
                ]
                root, args, kwargs_ = sum(parts[1:]) + parts[0], (), kwargs
            result = first.backend.backward(root, first.fn, args, kwargs_)
            self.engine.after_backward([root])
            return result

        fill_retained_grads(self.slices, self.hooked)  # (slices a round added, too)
        self.round = blocks
        session = self.session_type(
            "backward",
            run,
            bodies,
            size=self.forward.size,
            threaded=backward_threaded(first.tensor),
        )
        session.slices = self.slices
        return session

    # -- what an invoke body asks for ------------------------------------------------------
    def open_backward(self, body, block) -> None:
        if block.backend is None:
            block.backend = self.engine
        body.block = block
        _wait(body, _BACKWARD)
        if self.backward is None or not any(b is block for b in self.round):
            raise TraceStateError("the batch's backward could not start.")

    def close_backward(self, body, block, error) -> None:
        if error is None:
            _wait(body, _BACKWARD_DONE)

    def grad(self, body, tensor: torch.Tensor):
        session = self.backward
        entry = self.slices.get(id(tensor))
        full, rows = (
            (entry[1], body.rows) if entry is not None and entry[0] is tensor else (tensor, None)
        )
        if not tensor.requires_grad:
            raise GradientError(
                f"{body.label_of(tensor)}.grad: no gradient flows into it, because "
                f"it does not require grad."
            )
        point = session.grad_point(full)
        key = (point, point.calls)
        return session.request(
            body,
            key,
            lambda: grad_passed(body.block.tensor, tensor, body),
            rows=rows,
            tensor=tensor,
        )

    def plain_backward(self, body, tensor) -> None:
        """``loss.backward()`` as a plain call in a body: PyTorch's backward runs at once, over
        the batch's graph, so the body's rows that retain their gradient are hooked up first."""
        super().plain_backward(body, tensor)
        fill_retained_grads(self.slices, self.hooked)

    def grad_inputs(self, body, inputs: list) -> tuple[list, list | None]:
        """``torch.autograd.grad(loss, h)`` in a body, ``h`` its rows of a value: the graph goes
        on from the batch's tensor, so that is differentiated, and its rows are ``h``'s."""
        slices = self.slices
        found = [slices.get(id(t)) for t in inputs]
        found = [e if e is not None and e[0] is t else None for e, t in zip(found, inputs)]
        if all(e is None for e in found):
            return inputs, None
        return (
            [t if e is None else e[1] for e, t in zip(found, inputs)],
            [None if e is None else e[2] for e in found],
        )

    def close(self) -> None:
        self.backward = self.slices = self.hooked = None
        self.round = []
        super().close()


def round_kwargs(starting: list[Body]) -> dict:
    """The keyword arguments of one round's backward. ``retain_graph`` may differ: the batch's
    graph is one, so it is kept when any block asks (a block that did not ask sees the same
    numbers, and its body's next block, if any, finds the graph that another body kept)."""
    blocks = [b.block for b in starting]
    # each block's own gradient= is its own (see _backward_session's run)
    rest = [
        {k: v for k, v in b.kwargs.items() if k not in ("retain_graph", "gradient")} for b in blocks
    ]
    for body, block, other in zip(starting, blocks, rest):
        if other != rest[0]:
            raise TraceStateError(
                f"the backward blocks of invoke {starting[0].index} and invoke {body.index} pass "
                f"different keyword arguments to backward() ({_words(blocks[0].kwargs)} and "
                f"{_words(block.kwargs)}); one backward runs for the blocks of every invoke "
                f"that opens one at that point. Pass the same arguments (retain_graph may "
                f"differ)."
            )
    kwargs = dict(rest[0])
    if any("retain_graph" in b.kwargs for b in blocks):
        default = kwargs.get("create_graph", False)  # what backward() takes for a missing one
        kwargs["retain_graph"] = any(b.kwargs.get("retain_graph", default) for b in blocks)
    return kwargs


def _words(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "none"


def _frames_on_stack() -> set:
    frame, found = sys._getframe(1), set()
    while frame is not None:
        found.add(id(frame))
        frame = frame.f_back
    return found


def _wait(body: Body, key) -> None:
    body.pending = key
    try:
        body.scheduler.switch()
    finally:
        body.pending = None


__all__ = ["Invoke", "Invokes"]
