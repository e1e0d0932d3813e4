"""What a pipeline body asks for (``.output``/``.input``, ``tr.loss``, ``.grad``, the backward
block) and where each value comes from: this rank's own stage, paused at the value, or the rank
whose stage runs it, waited for. A mixin of ``PipelineRun`` (``run.py``), which holds
the state these methods read: the session, the messages, the events fired and the bodies'
waits."""
from __future__ import annotations

import dis
import sys

import torch

from ...envoy import Envoy
from ...errors import GradientError, OutOfOrderError, TraceStateError
from ...interleave.requests import Requests
from ...interleave.session import Stop


class BodyRequests(Requests):
    """The requests of ``PipelineRun``'s bodies; see the module text. The backward block
    opens on ``tr.loss`` and the schedule runs the backward: closing it asks for nothing."""

    def module_value(self, body, envoy, kind: str):
        engine, session = self.engine, self.session
        module, path = envoy._module, envoy._path
        stage = engine.stage_of(module)
        if stage is None:
            raise TraceStateError(f"{path}.{kind}: no pipeline stage runs {path} itself (a "
                                  f"container, or the whole model); name one of its layers.")
        if body.block is not None or body.loss is not None:
            raise OutOfOrderError(f"{path}.{kind} was requested after tr.loss; read forward "
                                  f"values before tr.loss and `with tr.loss.backward():`.")
        if kind == "input" and self.others and not _reads_first_input():
            raise TypeError(_INPUTS.format(path=path))
        self._in_order(body, stage, True, path, "." + kind)
        # Still at this value (the body asked for nothing else since it last read it): the
        # read is answered from the same stop on every rank, as on one process, so an in-place
        # edit made since is seen here as there and nothing is sent. Assigned since (`x.output
        # = ...`, on every rank alike): the owner sends what its read returns now.
        at = (id(module), kind)
        last = body.at
        again = last is not None and last[0] == at
        if again and last[2].replacement is last[1]:
            return last[2]
        body.seq += 1
        tag = body.index * 100_000 + body.seq
        if stage not in self.mine:
            value = self._wait_remote(body, self._moment(stage, body.index, True),
                                      engine.rank_of_stage[stage], tag)
            stop = last[2] if again else Stop(("remote", tag), _as_read(value, kind), None, kind,
                                               0, None)
            if again:  # the body's own assignment, unless the owner's numbers differ from it
                value = self._own_or_received(stop, value, kind)
            self._remember_remote(value, stage, body.index, f"{path}.{kind}")
            body.at = (at, stop.replacement, stop)
            return stop
        if ("F-end", stage, body.index) in self.fired:
            raise OutOfOrderError(_passed(path, kind))
        module = engine.local[id(module)]
        point = session.points.get((id(module), kind))
        if point is None:
            point = session.module_point(module, path, kind)
            for outer in envoy._ancestors():
                if engine.owns(outer._module):
                    session.module_point(engine.local[id(outer._module)], outer._path, "output")
        stop = self._request_local(body, (point, body.index), ("F-end", stage, body.index),
                                   lambda: _passed(path, kind))
        # what this read returns: the value, or what the body assigned; of a call's
        # (args, kwargs), the tensor `.input` reads (the only part that crosses stages)
        value = stop.value()
        if kind == "input":
            value = first_argument(value, path)
        if len(self.mine) > 1:  # (with one stage, grad() finds it without this entry)
            self.stage_of[id(value)] = (value, stage)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                # another stage of this rank may use it in an edit
                self._note_reach(value, f"{path}.{kind}", stage, body.index)
        # its bytes as they are now (messages._entry): an in-place edit the body
        # makes next, every other rank makes on its copy too
        self._send(value, tag, body.index, True, stage)
        body.at = (at, stop.replacement, stop)
        return stop

    def _remember_remote(self, value, stage: int, microbatch: int, label: str) -> None:
        """A value of another rank's ``stage`` handed to the body: its gradient comes from
        there, and (of an earlier stage) no backward of this rank may reach it."""
        self.stage_of[id(value)] = (value, stage)
        if self._moment(stage, microbatch, True)[0] == "F" and value.requires_grad:
            self._note_reach(value, label, stage, microbatch)

    def _own_or_received(self, stop, value, kind: str):
        """After an assignment, the owner's value read back (``value``) for ``stop``, this
        rank's copy of the assigned stop. The body computed its own assignment from the same
        values as the owner, so it is normally equal: then it stays what the read returns,
        the same tensor as on the owner (an in-place edit of either is an edit of both). A
        different one (noise the body drew on each rank) gives way to the owner's numbers,
        those the model goes on with."""
        own = stop.value()
        if kind == "input":
            own = first_argument(own, "")
        if isinstance(own, torch.Tensor) and own.shape == value.shape and \
                own.dtype == value.dtype and own.device == value.device and \
                torch.equal(own.detach(), value.detach()):
            return own
        stop.replacement = _as_read(value, kind)
        return value

    def loss(self, body):
        engine = self.engine
        body.at = None
        body.seq += 1
        tag = body.index * 100_000 + body.seq
        # read as `with tr.loss.backward():` (frame 2: the body) the value reaches nothing the
        # body can see: the block opens on a stand-in (the schedule runs the real backward)
        if only_opens_block(sys._getframe(2)):  # every rank: none waits, none sends
            value = _STAND_IN
        elif engine.last_stage not in self.mine:
            last = engine.last_stage
            event = self._moment(last, body.index, True)
            value = self._wait_remote(body, event, engine.rank_of_stage[last], tag)
        else:
            if ("B", engine.last_stage, body.index) in self.fired:
                raise OutOfOrderError(_LATE_LOSS)
            stop = self._request_local(body, (self.loss_point, body.index),
                                       ("B", engine.last_stage, body.index), lambda: _LATE_LOSS)
            value = stop.view
            self._send(value, tag, body.index, True, engine.last_stage)
        body.loss = value
        return value

    def open_backward(self, body, block) -> None:
        if block.tensor is not body.loss:
            raise TraceStateError("in a pipeline trace the schedule runs the backward of its own "
                                  "loss: open the block with `with tr.loss.backward():`.")
        body.block = block

    def grad(self, body, tensor):
        engine, session = self.engine, self.session
        entry = self.stage_of.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            stage = entry[1]
        else:  # a tensor the body made: the latest stage of this rank it read values of
            stage = max((s for s in self.mine if s <= body.last_stage), default=self.mine[0])
        self._in_order(body, stage, False, tensor, ".grad")
        body.at = None
        body.seq += 1
        tag = body.index * 100_000 + body.seq
        if stage not in self.mine:
            event = self._moment(stage, body.index, False)
            value = self._wait_remote(body, event, engine.rank_of_stage[stage], tag)
            # the body is "at" this gradient now, as its owner is: `t.grad = t.grad * 2` reads
            # and writes this one stop on every rank alike
            body.stop = Stop(("remote", tag), value, None, "grad", 0, None, tensor)
            return body.stop
        if not tensor.requires_grad:
            raise GradientError(f"{body.label_of(tensor)}.grad: no gradient flows into it, because "
                             f"it does not require grad.")
        point = session.grad_point(tensor)
        stop = session.request(body, (point, point.calls), lambda: (
            f"{body.label_of(tensor)}.grad was requested after this stage's backward had passed "
            f"it; request gradients in reverse-forward order."), tensor=tensor)
        self._send(stop.view, tag, body.index, False, stage)
        return stop

    def _request_local(self, body, key, passed_at, passed_message):
        """A forward value (or loss) of this rank's stage: the session's request, with the
        event after which it has passed marked on the body while it waits (the scheduler's
        marks read it; a stale mark would wake the body at the wrong event later)."""
        body.passed_at = passed_at
        self.marks[passed_at] = body  # (the direct step's marks: direct.py)
        try:
            return self.session.request(body, key, passed_message)
        finally:
            body.passed_at = None
            self.marks.pop(passed_at, None)

    def _send(self, value, tag: int, microbatch: int, forward: bool, stage: int) -> None:
        """Queue a value of this rank's ``stage`` for every other rank, in the batch of the
        moment that rank takes it (the module text of ``engine.py``)."""
        self.messages.send(value, tag, self._keys(microbatch, forward, stage))

    def _moment(self, stage: int, microbatch: int, forward: bool):
        """The batch key under which this rank takes a value of another rank's ``stage``
        (``moment``), kept across traces: the placement fixes it."""
        kept = self.engine.my_moments
        key = kept.get((stage, microbatch, forward))
        if key is None:
            key = kept[(stage, microbatch, forward)] = moment(self.mine, stage, microbatch,
                                                              forward)
        return key

    def _keys(self, microbatch: int, forward: bool, stage: int) -> dict:
        """``{rank: the batch key}`` of a forward value (or gradient) of ``stage``."""
        kept = self.engine.batch_keys  # fixed by the placement: kept across traces
        keys = kept.get((microbatch, forward, stage))
        if keys is None:  # the same for every value of this microbatch, direction and stage
            keys = kept[(microbatch, forward, stage)] = {
                dst: moment(theirs, stage, microbatch, forward) for dst, theirs in self.others}
        return keys

    def _in_order(self, body, stage: int, forward: bool, named, kind: str) -> None:
        """``named``: the module path, or the tensor whose label words the error."""
        last = body.last_stage
        if forward and stage < last or not forward and body.block is not None and \
                body.grad_stage is not None and stage > body.grad_stage:
            what = (named if isinstance(named, str) else body.label_of(named)) + kind
            raise OutOfOrderError(
                f"{what} was requested after a value of stage {last if forward else body.grad_stage}; "
                f"in a pipeline, forward values come stage by stage (0 first) and gradients in "
                f"reverse (last stage first).")
        if forward:
            body.last_stage = stage
        else:
            body.grad_stage = stage

    # -- waiting for a value from another stage -------------------------------------------------
    def _wait_remote(self, body, event, src: int, tag: int):
        self.messages.want(src, tag)
        self.messages.expect(src, event)  # posted now, it arrives while the body waits
        if event in self.fired:
            return self.messages.take(src, event, tag)
        self.waiting.setdefault(event, []).append((body, src, tag))
        body.pending = ("remote", tag)
        body.remote_value = None
        try:
            body.scheduler.switch()
        finally:
            body.pending = None
        if body.remote_value is None:
            raise TraceStateError(f"the pipeline step ended before rank {src} sent a value this "
                                  f"body asked for (microbatch {body.index}).")
        value, body.remote_value = body.remote_value, None
        return value


# What `with tr.loss.backward():` opens its block on when the body cannot see the loss: one
# tensor for every body (nothing reads, edits or backpropagates it).
_STAND_IN = torch.zeros((), requires_grad=True)
_LATE_LOSS = ("tr.loss was requested after the last stage had started the microbatch's backward; "
              "read tr.loss once, after the forward values and before the backward block.")


_INPUTS = ("{path}.inputs: distgrad sends only tensors between pipeline stages, and a call's "
           "(args, kwargs) is not one. Use {path}.input (the first positional argument, or the "
           "first keyword's value), which every rank can read; for another argument, read the "
           "output of the module that makes it.")


def first_argument(pair, path: str):
    """What ``.input`` reads of a call's ``(args, kwargs)`` (``Envoy.input``)."""
    args, kwargs = pair
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise TraceStateError(f"{path}.input: this call has no arguments.")


def _as_read(value, kind: str):
    """A received value as the envoy reads it from a stop: ``.input`` of a call's arguments."""
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
    return (f"{path}.{kind} was requested after this stage had run it for the microbatch; read "
            f"module values in forward order.")


# -- where a body takes another stage's value, and whether `tr.loss` only opens a block ------
_SITES: dict = {}  # (code, offset) -> whether `tr.loss` read there only opens a block


def moment(stages, stage: int, microbatch: int, forward: bool):
    """The batch key under which a rank running ``stages`` takes a forward value (or a
    gradient) of another rank's ``stage``: the first moment of its own at which the owner has
    certainly sent it (the module text of ``engine.py``). A forward value: the forward of its
    first stage after ``stage`` (which needed ``stage``'s output), else the backward of its last
    stage before it (which needed the later stages' gradients). A gradient: the backward of its
    last stage before ``stage``, else when its step has ended."""
    if forward:
        later = [s for s in stages if s > stage]
        if later:
            return ("F", later[0], microbatch)
    earlier = [s for s in stages if s < stage]
    return ("B", earlier[-1], microbatch) if earlier else "end"


def only_opens_block(frame) -> bool:
    """Whether the `.loss` read at ``frame``'s instruction is `with tr.loss.backward():`, with
    no `as`: the loss then goes only to the block, which the body cannot reach."""
    site = (frame.f_code, frame.f_lasti)
    known = _SITES.get(site)
    if known is None:
        ops = [(op.offset, op.opname, op.argval) for op in dis.get_instructions(frame.f_code)
               if op.opname not in ("CACHE", "EXTENDED_ARG", "PRECALL", "NOP")]
        at = [i for i, op in enumerate(ops) if op[0] <= frame.f_lasti][-1:]
        seen = [op[1:] for op in ops[at[0]: at[0] + 5]] if at else []
        known = _SITES[site] = len(seen) == 5 and seen[0] == ("LOAD_ATTR", "loss") and \
            seen[1][0] in ("LOAD_METHOD", "LOAD_ATTR") and seen[1][1] == "backward" and \
            seen[2] == ("CALL", 0) and seen[3][0] in ("BEFORE_WITH", "SETUP_WITH") and \
            seen[4][0] == "POP_TOP"
    return known
