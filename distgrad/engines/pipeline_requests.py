"""What a pipeline body asks for (``.output``/``.input``, ``tr.loss``, ``.grad``, the backward
block) and where each value comes from: this rank's own stage, paused at the value, or the rank
whose stage runs it, waited for. A mixin of ``PipelineRun`` (``pipeline_run.py``), which holds
the state these methods read: the session, the messages, the events fired and the bodies'
waits."""
from __future__ import annotations

import sys

import torch

from ..errors import OutOfOrderError, TraceStateError
from ..session import Stop
from .pipeline import moment, only_opens_block


class BodyRequests:
    """The requests of ``PipelineRun``'s bodies; see the module text."""

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
        self._in_order(body, stage, True, path, "." + kind)
        body.seq += 1
        tag = body.index * 100_000 + body.seq
        if stage not in self.mine:
            src = engine.rank_of_stage[stage]
            event = self._moment(stage, body.index, True)
            value = self._wait_remote(body, event, src, tag)
            self.stage_of[id(value)] = (value, stage)
            if event[0] == "F" and value.requires_grad:  # a value of an earlier stage
                self._note_reach(value, f"{path}.{kind}", stage, body.index)
            return Stop(("remote", tag), value, None, kind, 0, None)
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
        if len(self.mine) > 1:  # (with one stage, grad() finds it without this entry)
            self.stage_of[id(stop.view)] = (stop.view, stage)
            if isinstance(stop.view, torch.Tensor) and stop.view.requires_grad:
                # another stage of this rank may use it in an edit
                self._note_reach(stop.view, f"{path}.{kind}", stage, body.index)
        self._send(stop.view, tag, body.index, True, stage)
        return stop

    def loss(self, body):
        engine = self.engine
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

    def backward_block(self, body, block) -> None:
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
            raise ValueError(f"{body.label_of(tensor)}.grad: no gradient flows into it, because "
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
        self.marks[passed_at] = body  # (the direct step's marks: pipeline_direct.py)
        try:
            return self.session.request(body, key, passed_message)
        finally:
            body.passed_at = None
            self.marks.pop(passed_at, None)

    def _send(self, value, tag: int, microbatch: int, forward: bool, stage: int) -> None:
        """Queue a value of this rank's ``stage`` for every other rank, in the batch of the
        moment that rank takes it (the module text of ``pipeline.py``)."""
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
                getattr(body, "grad_stage", None) is not None and stage > body.grad_stage:
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


def _passed(path, kind):
    return (f"{path}.{kind} was requested after this stage had run it for the microbatch; read "
            f"module values in forward order.")
