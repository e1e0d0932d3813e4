"""One pipeline trace (see ``pipeline.py``): the schedule's step as the run, one body per
microbatch as a coroutine of it, values of other stages received at the moments the module text
of ``pipeline.py`` lists, and the saved names joined across microbatches at the end."""
from __future__ import annotations

import functools
import sys

import greenlet
import torch

from .. import capture
from ..backward import step_threaded
from ..errors import OutOfOrderError, TraceStateError
from ..run import BodyRunners
from ..session import BODIES, Body, Session, Stop
from .pipeline import LossPoint, PipelineEngine, moment, joined, only_opens_block
from .pipeline_messages import _MOST_MICROBATCHES, Messages


class PipelineRun:
    """One trace: the step as a run, one body per microbatch, remote values delivered."""

    def __init__(self, engine: PipelineEngine, trace):
        self.engine, self.trace = engine, trace
        self.waiting: dict = {}   # event key -> [(body, src rank, tag)]
        self.fired: set = set()   # event keys passed
        self.messages = Messages(engine)
        self.stage_of: dict = {}  # id(tensor) -> (tensor, stage) for the values handed to bodies
        # microbatch -> [(label, stages whose backward reached it, its stage)] for the values
        # an edit on another stage could use (see _check_earlier)
        self.earlier: dict = {}
        self.in_backward = None   # the stage of this rank whose backward chunk is running
        self.mine = engine.my_stages
        self.others = [(r, stages) for r, stages in engine.stages_of_rank.items()
                       if r != engine._job_rank]
        self.batch_keys = engine.batch_keys  # see _keys
        self.session = None

    # -- the trace --------------------------------------------------------------------------
    def run(self, code, names, frame) -> None:
        engine, trace = self.engine, self.trace
        args, kwargs = trace.raw_inputs
        n = engine.microbatches()
        if n > _MOST_MICROBATCHES:
            raise NotImplementedError(f"distgrad runs pipeline steps of at most "
                                      f"{_MOST_MICROBATCHES} microbatches, not {n}.")
        scheduler = greenlet.getcurrent()
        bodies = [Body(trace, index=m, scheduler=scheduler) for m in range(n)]
        for body in bodies:
            body.seq, body.last_stage, body.loss = 0, -1, None
            # while it waits for a local forward value or loss: the event after which that
            # value has passed (the scheduler's marks), else None
            body.passed_at = None
        # On CUDA the schedule's backward calls tensor hooks on autograd's device threads, so
        # the step then runs in a worker thread that accepts hand-offs from any thread.
        self.session = session = Session("forward", lambda: engine.run_step(args, kwargs), bodies,
                                         threaded=step_threaded())
        trace.pipeline = self
        spaces = [{**frame.f_globals, **frame.f_locals} for _ in bodies]
        runners = BodyRunners({body: (lambda space=space: exec(code, space))
                               for body, space in zip(bodies, spaces)}, BODIES)
        restore = self._instrument()
        engine.answering.append(self.messages)  # what it has sent, for a peer that asks
        try:
            if 0 not in self.mine:  # it idles until the first activation comes anyway
                self.messages.post_check_receives()
            self._schedule(bodies, runners)
            # Every request is made, so nothing more joins the "end" batches: they go now, not
            # when the step ends, since a peer's bodies and its part of the check wait for them.
            # Then the check of the requests, which travels while the step runs on.
            if "end" not in self.messages.sent:
                self.messages.flush("end")
            self.messages.start_check()
            session.finish()  # the bodies are done; the step runs on with their last replies
            self.messages.finish()
        finally:
            engine.answering.remove(self.messages)
            restore()
            runners.close()
            if not session.finished:
                session.abort()
            session.close()
            trace.pipeline = None
        capture.write_back(frame, joined(names, bodies, spaces))

    def _instrument(self):
        """Mark each chunk with its microbatch and phase, and catch each microbatch's loss."""
        session = self.session
        self.loss_point = LossPoint()

        def on_loss(microbatch, loss):
            if (self.loss_point, microbatch) in session.wanted:
                session.hand((self.loss_point, microbatch), loss)

        session.microbatch = -1
        undo = self.engine.instrument(functools.partial(_Chunk, self), on_loss)
        undo_carry = self.engine.carry(self.messages)
        if undo_carry is None:
            return undo

        def restore():
            undo_carry()
            undo()
        return restore

    def chunk_started(self, phase: str, stage: int, microbatch: int) -> None:
        # the schedule has received this chunk's inputs, and with them the values its
        # neighbour sent along (Messages.arrived)
        self.messages.arrived(phase, stage, microbatch)
        self._event((phase, stage, microbatch))
        forward = phase == "F"
        self.session.microbatch = microbatch if forward else -1
        self.in_backward = None if forward else stage

    def chunk_ended(self, phase: str, stage: int, microbatch: int, ok: bool) -> None:
        self.session.microbatch = -1
        self.in_backward = None
        if not ok:
            return
        # the batch of values this chunk produced goes before the schedule sends the chunk's
        # result, so a receiver that got the result can take the values without waiting
        self._flush_chunk(phase, stage, microbatch)
        if phase == "F":  # every module of this stage has run for the microbatch
            self._event(("F-end", stage, microbatch))
        else:
            self._check_earlier(stage, microbatch)

    def _flush_chunk(self, phase: str, stage: int, microbatch: int) -> None:
        """Send, for every other rank, the batch this chunk completes: after a forward the
        batches of the ranks that take this stage's values in a later stage's forward, after a
        backward those of the ranks that take them in an earlier stage's backward."""
        messages = self.messages
        for key in self._keys(microbatch, phase == "F", stage).values():
            if key != "end" and key[0] == phase and key not in messages.sent:
                messages.flush(key)

    def _note_reach(self, value, label: str, stage: int, microbatch: int) -> None:
        """Note which of this rank's stages' backward reaches ``value`` (of ``stage``)."""
        reached = []
        value.register_hook(lambda grad: reached.append(self.in_backward))
        self.earlier.setdefault(microbatch, []).append((label, reached, stage))

    def _check_earlier(self, stage: int, microbatch: int) -> None:
        """One process would carry the gradient of a value that an edit on a later stage used
        back into the value's own stage; a pipeline does not (a copy received from another rank
        ends there; on this rank, the earlier stage's backward would find its graph already
        used), so the later stage's backward reaching the value is refused."""
        for label, reached, owner in self.earlier.get(microbatch, ()):
            if any(s is not None and s != owner for s in reached):
                raise NotImplementedError(
                    f"{label} (run by pipeline stage {owner}) was used in an edit on stage "
                    f"{stage}, so its gradient would have to flow back to stage {owner}, which "
                    f"a pipeline schedule does not do: stage {owner}'s gradients would differ "
                    f"from one process. Use {label}.detach() in the edit to treat it as a "
                    f"constant, or make the edit on the stage that runs it.")

    def _event(self, key) -> None:
        self.fired.add(key)
        if key in self.waiting or key in self.session.wanted:
            self.session.hand((_PHASES[key[0]], key[1], key[2]), None)

    # -- the scheduler ----------------------------------------------------------------------
    def _schedule(self, bodies, runners: BodyRunners) -> None:
        # This loop runs twice per pause of the step, so it keeps to what changed: the bodies
        # the last pause served, and the marks only bodies waiting for local values need.
        session, waiting_for, fired = self.session, self.waiting, self.fired
        wanted, todo, wake = session.wanted, runners.todo, runners.wake
        for body in bodies:
            wake(body)
        while todo:
            found = None
            if waiting_for:
                finished = session.finished
                for key in waiting_for:
                    if key in fired or (finished and key == "end"):
                        found = key
                        break
            if found is not None:
                self._deliver(found, wake)
                continue
            waiting = [b for b in bodies if id(b) in todo]
            if session.finished:
                for body in waiting:
                    body.remote_value = None  # what it waits for never comes: it raises
                    wake(body)
                continue
            for key in waiting_for:
                wanted[key] = 1
            # a local value may already have passed: notice when, for this advance only
            marks = []
            for body in waiting:
                mark = body.passed_at
                if mark is not None and mark not in wanted:
                    wanted[mark] = 1
                    marks.append(mark)
            session.advance()
            for key in marks:
                wanted.pop(key, None)
            if session.finished:  # before any body waits for "end": no cycle between ranks
                self.messages.flush("end")
            key = session.paused_key
            if key is None or key in waiting_for:
                continue  # the end, or a delivery at the top of the loop
            if session.served:  # the bodies whose value this is
                for body in list(session.served):
                    if body.stop is not None and body.pending is not None:
                        wake(body)
            elif key[0].__class__ is _Phase:  # a mark: bodies whose value has passed raise
                for body in waiting:
                    if body.passed_at == key:
                        wake(body)

    def _deliver(self, key, wake) -> None:
        self.session.wanted.pop(key, None)
        for body, src, tag in self.waiting.pop(key):
            body.remote_value = self.messages.take(src, key, tag)
            wake(body)

    # -- what the body asks for ---------------------------------------------------------------
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
            event = moment(self.mine, stage, body.index, True)
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
        body.passed_at = ("F-end", stage, body.index)
        try:
            stop = session.request(body, (point, body.index), lambda: _passed(path, kind))
        finally:
            body.passed_at = None
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
            event = moment(self.mine, last, body.index, True)
            value = self._wait_remote(body, event, engine.rank_of_stage[last], tag)
        else:
            if ("B", engine.last_stage, body.index) in self.fired:
                raise OutOfOrderError(_LATE_LOSS)
            body.passed_at = ("B", engine.last_stage, body.index)
            try:
                stop = self.session.request(body, (self.loss_point, body.index),
                                            lambda: _LATE_LOSS)
            finally:
                body.passed_at = None
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
            event = moment(self.mine, stage, body.index, False)
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

    def _send(self, value, tag: int, microbatch: int, forward: bool, stage: int) -> None:
        """Queue a value of this rank's ``stage`` for every other rank, in the batch of the
        moment that rank takes it (the module text of ``pipeline.py``)."""
        self.messages.send(value, tag, self._keys(microbatch, forward, stage))

    def _keys(self, microbatch: int, forward: bool, stage: int) -> dict:
        """``{rank: the batch key}`` of a forward value (or gradient) of ``stage``."""
        keys = self.batch_keys.get((microbatch, forward, stage))
        if keys is None:  # the same for every value of this microbatch, direction and stage
            keys = self.batch_keys[(microbatch, forward, stage)] = {
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


class _Chunk:
    """``with _Chunk(run, phase, stage, microbatch):`` around one chunk of the schedule (what
    the engines' ``instrument`` calls ``on_chunk``). A class, not ``contextlib.contextmanager``:
    its generator machinery ran about 45 more bytecodes a chunk (8 chunks a step per stage)."""

    __slots__ = ("run", "phase", "stage", "microbatch")

    def __init__(self, run, phase: str, stage: int, microbatch: int):
        self.run, self.phase, self.stage, self.microbatch = run, phase, stage, microbatch

    def __enter__(self):
        self.run.chunk_started(self.phase, self.stage, self.microbatch)

    def __exit__(self, exc_type, exc, tb):
        self.run.chunk_ended(self.phase, self.stage, self.microbatch, exc_type is None)
        return False


class _Phase(str):
    """A chunk event's name as the session fires it: equal to the plain string, and with the
    ``kind`` the session reads from the first item of every key it pauses at."""
    kind = "event"


_PHASES = {p: _Phase(p) for p in ("F", "B", "F-end")}
# What `with tr.loss.backward():` opens its block on when the body cannot see the loss: one
# tensor for every body (nothing reads, edits or backpropagates it).
_STAND_IN = torch.zeros((), requires_grad=True)
_LATE_LOSS = ("tr.loss was requested after the last stage had started the microbatch's backward; "
              "read tr.loss once, after the forward values and before the backward block.")


def _passed(path, kind):
    return (f"{path}.{kind} was requested after this stage had run it for the microbatch; read "
            f"module values in forward order.")
