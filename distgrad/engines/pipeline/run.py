"""One pipeline trace (see ``engine.py``): the schedule's step as the run, one body per
microbatch as a coroutine of it, values of other stages received at the moments the module text
of ``engine.py`` lists, and the saved names joined across microbatches at the end. What each
body asks for is served by ``requests.py``. On one thread the step runs on the trace's
stack and its hooks wake the bodies (``direct.py``); in thread mode (CUDA) it runs in a
worker thread and ``_schedule`` below runs the bodies in turns."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import greenlet
import torch

from ... import capture
from ...capture import NotSaved
from ...interleave.gradients import step_threaded
from ...interleave.points import add_tensor_hook
from ...interleave.transports import BodyRunners
from ...interleave.session import BODIES, Body, Session
from .direct import DirectSteps
from .messages import MOST_MICROBATCHES, Messages
from .requests import BodyRequests

if TYPE_CHECKING:  # (engine.py imports this module to run a trace)
    from .engine import PipelineEngine


class MicrobatchBody(Body):
    """The body of one microbatch, and where it is in the step."""

    def __init__(self, requests, index: int, scheduler):
        super().__init__(requests, index=index, scheduler=scheduler)
        self.seq = 0          # messages tagged for this body so far
        self.last_stage = -1  # the latest stage whose forward value it read
        self.grad_stage = None  # the stage of the latest gradient it read
        self.loss = None      # tr.loss, once read
        # the module value it read last, while it asks for nothing else: (module id and
        # kind, the stop's assignment then, the stop) (BodyRequests.module_value)
        self.at = None
        # while it waits for a local forward value or loss: the event after which that
        # value has passed (the marks: the scheduler's, or self.marks), else None
        self.passed_at = None
        self.remote_value = None  # a value received from another rank, until the body takes it


class PipelineRun(BodyRequests, DirectSteps):
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
                       if r != engine.job_rank]
        self.session = None
        self.marks: dict = {}     # event key -> the body whose local value has passed by then
        self.direct = False       # the step on this stack, bodies woken by hooks (DirectSteps)

    # -- the trace --------------------------------------------------------------------------
    def run(self, code, names, frame) -> None:
        engine, trace = self.engine, self.trace
        args, kwargs = trace.raw_inputs
        n = engine.microbatches()
        if n > MOST_MICROBATCHES:
            raise NotImplementedError(f"distgrad runs pipeline steps of at most "
                                      f"{MOST_MICROBATCHES} microbatches, not {n}.")
        scheduler = greenlet.getcurrent()
        bodies = [MicrobatchBody(self, m, scheduler) for m in range(n)]
        # On CUDA the schedule's backward calls tensor hooks on autograd's device threads, so
        # the step then runs in a worker thread that accepts hand-offs from any thread, and the
        # scheduler below runs the bodies; on one thread the hooks wake them (DirectSteps).
        threaded = step_threaded()
        self.direct = not threaded
        self.session = session = Session("forward", lambda: engine.run_step(args, kwargs), bodies,
                                         threaded=threaded)
        spaces = [{**frame.f_globals, **frame.f_locals} for _ in bodies]
        runners = BodyRunners({body: (lambda space=space: exec(code, space))
                               for body, space in zip(bodies, spaces)}, BODIES)
        restore = self._instrument()
        engine.answering.append(self.messages)  # what it has sent, for a peer that asks
        try:
            if 0 not in self.mine:  # it idles until the first activation comes anyway
                self.messages.post_check_receives()
            if self.direct:
                self._run_direct(bodies, runners, args, kwargs)
            else:
                self._schedule(bodies, runners)
                # Every request is made, so nothing more joins the "end" batches: they go now,
                # not when the step ends, since a peer's bodies and its part of the check wait
                # for them. Then the check of the requests, which travels while the step runs.
                if "end" not in self.messages.sent:
                    self.messages.flush("end")
                self.messages.start_check()
                session.finish()  # the bodies are done; the step runs on with their replies
            self.messages.finish()
        finally:
            engine.answering.remove(self.messages)
            restore()
            runners.close()
            if not session.finished:
                session.abort()
            session.close()
            for body in bodies:
                body.requests = None
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
        add_tensor_hook(value, lambda grad: reached.append(self.in_backward))
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
        if self.direct:
            if key in self.waiting or key in self.marks:
                self._event_direct(key)
        elif key in self.waiting or key in self.session.wanted:
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
            if session.finished:
                for body in [b for b in bodies if id(b) in todo]:
                    body.remote_value = None  # what it waits for never comes: it raises
                    wake(body)
                continue
            for key in waiting_for:
                wanted[key] = 1
            # a local value may already have passed: notice when, for this advance only
            # (a body that ended, or waits for anything else, has no passed_at: no need to
            # pick out the waiting ones, which cost a list a turn)
            marks = []
            for body in bodies:
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
                for body in bodies:
                    if body.passed_at == key:
                        wake(body)

    def _deliver(self, key, wake) -> None:
        self.session.wanted.pop(key, None)
        for body, src, tag in self.waiting.pop(key):
            body.remote_value = self.messages.take(src, key, tag)
            wake(body)


class _Chunk:
    """``with _Chunk(run, phase, stage, microbatch):`` around one chunk of the schedule (what
    the engines' ``instrument`` calls ``on_chunk``). A class, not ``contextlib.contextmanager``:
    its generator machinery runs more bytecodes, at every chunk of every step."""

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


# -- the loss's hand-over point, and the saved names joined across microbatches -------------
class LossPoint:
    """Where the last stage hands over a microbatch's loss (a point with nothing to remove)."""
    kind = "output"

    def remove(self):
        pass


def joined(names: list[str], bodies: list, spaces: list[dict]) -> dict:
    """Each saved name: the microbatches' values concatenated on the save's ``dim`` (0 by
    default; 0-dim values are stacked); a list, tuple or dict of saved values comes back joined
    item by item."""
    saved = {id(entry[0]): entry[2] for body in bodies for entry in body.saves}
    out = {}
    for name in names:
        values = [space.get(name, _MISSING) for space in spaces]
        value = _join(values, saved)
        out[name] = value if value is not _MISSING else NotSaved(
            name, "in the body of a pipeline trace (it runs once per microbatch)")
    return out


_MISSING = object()


def _join(values: list, saved: dict):
    first = values[0]
    if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) and id(v) in saved
                                               for v in values):
        dim = saved[id(first)]
        values = [v.detach() for v in values]
        return torch.stack(values) if first.dim() == 0 else torch.cat(values, dim=dim)
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) and len(v) == len(first)
                                                for v in values):
        items = [_join([v[i] for v in values], saved) for i in range(len(first))]
        return _MISSING if any(i is _MISSING for i in items) else type(first)(items)
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys()
                                       for v in values):
        if all(id(v) in saved for v in values):  # distgrad.save(a_dict): its tensors, joined
            saved = {**saved, **{id(t): saved[id(v)] for v in values for t in v.values()}}
        items = {k: _join([v[k] for v in values], saved) for k in first}
        return _MISSING if any(i is _MISSING for i in items.values()) else items
    return _MISSING
