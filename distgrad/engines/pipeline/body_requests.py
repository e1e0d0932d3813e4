"""What a pipeline body asks for (``.output``/``.input``, ``tr.loss``, ``.grad``, the backward
block) and where each value comes from: this rank's own stage, paused at the value, or the rank
whose stage runs it, waited for (``waits.py``). Each body of a microbatch holds the
``BodyRequests`` of its trace (``Body.requests``)."""

from __future__ import annotations

import dis
import sys

import torch

from ...envoy import Envoy
from ...errors import GradientError, OutOfOrderError, TraceStateError
from ...interleave.requests import Requests
from ...interleave.session import Body, Pause


class MicrobatchBody(Body):
    """The body of one microbatch, and where it is in the step."""

    def __init__(self, requests, index: int, scheduler):
        super().__init__(requests, index=index, scheduler=scheduler)
        self.seq = 0  # values tagged for this body so far
        self.last_stage = -1  # the latest stage whose forward value it read
        self.grad_stage = None  # the stage of the latest gradient it read
        self.loss = None  # tr.loss, once read
        # the module value it read last, while it asks for nothing else: (module id and
        # kind, the pause's assignment then, the pause) (BodyRequests.module_value)
        self.last_read = None
        # while it waits for a local forward value or loss: the event after which that value
        # has passed (waits.py), else None
        self.deadline = None
        self.remote_value = None  # a value received from another rank, until the body takes it


class BodyRequests(Requests):
    """The requests of one trace's microbatch bodies; see the module text. The backward block
    opens on ``tr.loss`` and the schedule runs the backward: closing it asks for nothing.

    Given when built: ``engine``, the ``PipelineAdapter`` (the stage of a module, this rank's
    module for it); ``messages``, where values go (``messages.py``); ``waits``, the events
    passed and the bodies waiting; ``value_stages``, the stage of each value handed to a body
    (``value_stages.py``); ``loss_point``, where the last stage hands over a microbatch's loss.
    The run sets ``session`` once the bodies exist (the session needs them, and they this)."""

    def __init__(self, engine, messages, waits, value_stages, loss_point):
        self.engine, self.messages, self.waits = engine, messages, waits
        self.value_stages, self.loss_point = value_stages, loss_point
        self.placement = placement = engine.placement
        self.my_stages, self.other_ranks = placement.my_stages, placement.other_ranks
        self.rank_of_stage, self.last_stage = placement.rank_of_stage, placement.last_stage
        self.passed, self.deadlines = waits.passed, waits.deadlines
        self.session = None

    def module_value(self, body, envoy, kind: str):
        engine, session = self.engine, self.session
        module, path = envoy._module, envoy._path
        stage = engine.stage_of(module)
        if stage is None:
            raise TraceStateError(
                f"{path}.{kind}: no pipeline stage runs {path} itself (a "
                f"container, or the whole model); name one of its layers."
            )
        if body.block is not None or body.loss is not None:
            raise OutOfOrderError(
                f"{path}.{kind} was requested after tr.loss; read forward "
                f"values before tr.loss and `with tr.loss.backward():`."
            )
        if kind == "input" and self.other_ranks and not _reads_first_input():
            raise TypeError(_INPUTS.format(path=path))
        self._in_order(body, stage, True, path, "." + kind)
        # Still at this value (the body asked for nothing else since it last read it): the
        # read is answered from the same pause on every rank, as on one process, so an in-place
        # edit made since is seen here as there and nothing is sent. Assigned since (`x.output
        # = ...`, on every rank alike): the owner sends what its read returns now.
        read = (id(module), kind)
        last = body.last_read
        again = last is not None and last[0] == read
        if again and last[2].replacement is last[1]:
            return last[2]
        body.seq += 1
        tag = body.index * 100_000 + body.seq
        if stage not in self.my_stages:
            value = self.waits.wait_remote(
                body,
                self.placement.receive_action(stage, body.index, True),
                self.rank_of_stage[stage],
                tag,
            )
            pause = (
                last[2]
                if again
                else Pause(("remote", tag), _as_read(value, kind), None, kind, 0, None)
            )
            if again:  # the body's own assignment, unless the owner's numbers differ from it
                value = self._own_or_received(pause, value, kind)
            self._remember_remote(value, stage, body.index, f"{path}.{kind}")
            body.last_read = (read, pause.replacement, pause)
            return pause
        if ("F-end", stage, body.index) in self.passed:
            raise OutOfOrderError(_passed(path, kind))
        module = engine.stage_module(module)
        point = session.points.get((id(module), kind))
        if point is None:
            point = session.module_point(module, path, kind)
            for outer in envoy._ancestors():
                if engine.owns(outer._module):
                    session.module_point(engine.stage_module(outer._module), outer._path, "output")
        pause = self._request_local(
            body, (point, body.index), ("F-end", stage, body.index), lambda: _passed(path, kind)
        )
        # what this read returns: the value, or what the body assigned; of a call's
        # (args, kwargs), the tensor `.input` reads (the only part that crosses stages)
        value = pause.value()
        if kind == "input":
            value = first_argument(value, path)
        if len(self.my_stages) > 1:  # (with one stage, grad() finds it without this entry)
            self.value_stages.note(value, stage)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                # another stage of this rank may use it in an edit
                self.value_stages.watch(value, f"{path}.{kind}", stage, body.index)
        # its bytes as they are now (messages.py): an in-place edit the body
        # makes next, every other rank makes on its copy too
        self._send(value, tag, body.index, True, stage)
        body.last_read = (read, pause.replacement, pause)
        return pause

    def _remember_remote(self, value, stage: int, microbatch: int, label: str) -> None:
        """A value of another rank's ``stage`` handed to the body: its gradient comes from
        there, and (of an earlier stage) no backward of this rank may reach it."""
        self.value_stages.note(value, stage)
        if self.placement.receive_action(stage, microbatch, True)[0] == "F" and value.requires_grad:
            self.value_stages.watch(value, label, stage, microbatch)

    def _own_or_received(self, pause, value, kind: str):
        """After an assignment, the owner's value read back (``value``) for ``pause``, this
        rank's copy of the assigned pause. The body computed its own assignment from the same
        values as the owner, so it is normally equal: then it stays what the read returns,
        the same tensor as on the owner (an in-place edit of either is an edit of both). A
        different one (noise the body drew on each rank) gives way to the owner's numbers,
        those the model goes on with."""
        own = pause.value()
        if kind == "input":
            own = first_argument(own, "")
        if (
            isinstance(own, torch.Tensor)
            and own.shape == value.shape
            and own.dtype == value.dtype
            and own.device == value.device
            and torch.equal(own.detach(), value.detach())
        ):
            return own
        pause.replacement = _as_read(value, kind)
        return value

    def loss(self, body):
        last = self.last_stage
        body.last_read = None
        body.seq += 1
        tag = body.index * 100_000 + body.seq
        # read as `with tr.loss.backward():` (frame 2: the body) the value reaches nothing the
        # body can see: the block opens on a stand-in (the schedule runs the real backward)
        if only_opens_block(sys._getframe(2)):  # every rank: none waits, none sends
            value = _STAND_IN
        elif last not in self.my_stages:
            action = self.placement.receive_action(last, body.index, True)
            value = self.waits.wait_remote(body, action, self.rank_of_stage[last], tag)
        else:
            if ("B", last, body.index) in self.passed:
                raise OutOfOrderError(_LATE_LOSS)
            pause = self._request_local(
                body, (self.loss_point, body.index), ("B", last, body.index), lambda: _LATE_LOSS
            )
            value = pause.view
            self._send(value, tag, body.index, True, last)
        body.loss = value
        return value

    def open_backward(self, body, block) -> None:
        if block.tensor is not body.loss:
            raise TraceStateError(
                "in a pipeline trace the schedule runs the backward of its own "
                "loss: open the block with `with tr.loss.backward():`."
            )
        body.block = block

    def grad(self, body, tensor):
        session, my_stages = self.session, self.my_stages
        stage = self.value_stages.stage_of(tensor)
        if stage is None:  # a tensor the body made: the latest stage of this rank it read values of
            stage = max((s for s in my_stages if s <= body.last_stage), default=my_stages[0])
        self._in_order(body, stage, False, tensor, ".grad")
        body.last_read = None
        body.seq += 1
        tag = body.index * 100_000 + body.seq
        if stage not in my_stages:
            action = self.placement.receive_action(stage, body.index, False)
            value = self.waits.wait_remote(body, action, self.rank_of_stage[stage], tag)
            # the body is "at" this gradient now, as its owner is: `t.grad = t.grad * 2` reads
            # and writes this one pause on every rank alike
            body.pause = Pause(("remote", tag), value, None, "grad", 0, None, tensor)
            return body.pause
        if not tensor.requires_grad:
            raise GradientError(
                f"{body.label_of(tensor)}.grad: no gradient flows into it, "
                f"because it does not require grad."
            )
        point = session.grad_point(tensor)
        pause = session.request(
            body,
            (point, point.calls),
            lambda: (
                f"{body.label_of(tensor)}.grad was requested after this stage's backward had "
                f"passed it; request gradients in reverse-forward order."
            ),
            tensor=tensor,
        )
        self._send(pause.view, tag, body.index, False, stage)
        return pause

    def _request_local(self, body, key, deadline, passed_message):
        """A forward value (or loss) of this rank's stage: the session's request, with the
        event after which it has passed as the body's deadline while it waits (waits.py; a
        deadline left behind would wake the body at the wrong event later)."""
        body.deadline = deadline
        self.deadlines[deadline] = body
        try:
            return self.session.request(body, key, passed_message)
        finally:
            body.deadline = None
            self.deadlines.pop(deadline, None)

    def _send(self, value, tag: int, microbatch: int, forward: bool, stage: int) -> None:
        """Queue a value of this rank's ``stage`` for every other rank, in its bundle for the
        action at which that rank takes it (``placement.py``)."""
        self.messages.send(value, tag, self.placement.send_actions(microbatch, forward, stage))

    def _in_order(self, body, stage: int, forward: bool, named, kind: str) -> None:
        """``named``: the module path, or the tensor whose label words the error."""
        last = body.last_stage
        if (
            forward
            and stage < last
            or not forward
            and body.block is not None
            and body.grad_stage is not None
            and stage > body.grad_stage
        ):
            what = (named if isinstance(named, str) else body.label_of(named)) + kind
            raise OutOfOrderError(
                f"{what} was requested after a value of stage "
                f"{last if forward else body.grad_stage}; in a pipeline, forward values come "
                f"stage by stage (0 first) and gradients in reverse (last stage first)."
            )
        if forward:
            body.last_stage = stage
        else:
            body.grad_stage = stage


# What `with tr.loss.backward():` opens its block on when the body cannot see the loss: one
# tensor for every body (nothing reads, edits or backpropagates it).
_STAND_IN = torch.zeros((), requires_grad=True)
_LATE_LOSS = (
    "tr.loss was requested after the last stage had started the microbatch's backward; "
    "read tr.loss once, after the forward values and before the backward block."
)


_INPUTS = (
    "{path}.inputs: distgrad sends only tensors between pipeline stages, and a call's "
    "(args, kwargs) is not one. Use {path}.input (the first positional argument, or the "
    "first keyword's value), which every rank can read; for another argument, read the "
    "output of the module that makes it."
)


def first_argument(pair, path: str):
    """What ``.input`` reads of a call's ``(args, kwargs)`` (``Envoy.input``)."""
    args, kwargs = pair
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise TraceStateError(f"{path}.input: this call has no arguments.")


def _as_read(value, kind: str):
    """A received value as the envoy reads it from a pause: ``.input`` of a call's arguments."""
    return ((value,), {}) if kind == "input" else value


def _reads_first_input() -> bool:
    """Whether this request comes from ``.input`` (read or assigned), not ``.inputs``: the
    envoy's property whose code is on the stack a few frames up (``.inputs`` cannot be sent)."""
    first = (Envoy.input.fget.__code__, Envoy.input.fset.__code__)
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code in first:
            return True
        frame = frame.f_back
    return False


def _passed(path, kind):
    return (
        f"{path}.{kind} was requested after this stage had run it for the microbatch; read "
        f"module values in forward order."
    )


# -- whether `tr.loss` only opens a block --------------------------------------------------
_SITES: dict = {}  # (code, offset) -> whether `tr.loss` read there only opens a block


def only_opens_block(frame) -> bool:
    """Whether the `.loss` read at ``frame``'s instruction is `with tr.loss.backward():`, with
    no `as`: the loss then goes only to the block, which the body cannot reach."""
    site = (frame.f_code, frame.f_lasti)
    known = _SITES.get(site)
    if known is None:
        ops = [
            (op.offset, op.opname, op.argval)
            for op in dis.get_instructions(frame.f_code)
            if op.opname not in ("CACHE", "EXTENDED_ARG", "PRECALL", "NOP")
        ]
        here = [i for i, op in enumerate(ops) if op[0] <= frame.f_lasti][-1:]
        seen = [op[1:] for op in ops[here[0] : here[0] + 5]] if here else []
        known = _SITES[site] = (
            len(seen) == 5
            and seen[0] == ("LOAD_ATTR", "loss")
            and seen[1][0] in ("LOAD_METHOD", "LOAD_ATTR")
            and seen[1][1] == "backward"
            and seen[2] == ("CALL", 0)
            and seen[3][0] in ("BEFORE_WITH", "SETUP_WITH")
            and seen[4][0] == "POP_TOP"
        )
    return known
