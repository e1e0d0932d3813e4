"""One pipeline trace (``ScheduleRun``): the runtime's step as the run, one body per microbatch
as a coroutine of it, values of other stages received at the actions ``placement.py`` names, and
the saved names joined across microbatches at the end.

The run builds, for the trace, one object per part and hands each what it needs:

* ``BodyRequests`` (``body_requests.py``): what a body asks for, and where each value comes
  from; every body holds it;
* ``Messages`` (``messages.py``) with its ``RequestCheck`` (``checks.py``): values between
  stages, and the check that every rank's bodies asked for the same ones;
* ``Waits`` (``waits.py``): the action events passed, and the bodies waiting for one;
* ``ValueStages`` (``value_stages.py``): the stage each value came from;
* the step: ``DirectStep`` (``direct.py``) on one thread, its hooks waking the bodies, or
  ``ThreadedStep`` (``threaded.py``) where a CUDA backward needs a worker thread.

The engine is used only through ``PipelineAdapter`` (``adapter.py``); the run itself handles the
action events the engine's ``instrument`` reports.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import greenlet
import torch

from ... import capture
from ...capture import NotSaved
from ...interleave.gradients import step_threaded
from ...interleave.session import BODIES
from ...interleave.transports import BodyRunners
from .body_requests import BodyRequests, MicrobatchBody
from .checks import RequestCheck
from .direct import DirectStep
from .messages import MOST_MICROBATCHES, Messages
from .threaded import ThreadedStep
from .value_stages import ValueStages
from .waits import Waits

if TYPE_CHECKING:  # (a type only: the run is given its engine)
    from .adapter import PipelineAdapter


class ScheduleRun:
    """One trace: the step as a run, one body per microbatch, remote values delivered."""

    def __init__(self, engine: PipelineAdapter, trace):
        self.engine, self.trace = engine, trace
        self.placement = engine.placement
        self.check = RequestCheck(engine, engine.channel)
        self.messages = Messages(
            engine.channel, engine.placement, engine.piggyback_buffers, engine.device, self.check
        )
        self.waits = Waits(self.messages, self.check)
        self.passed = self.waits.passed  # the action events passed
        self.value_stages = ValueStages()
        self.loss_point = LossPoint()
        self.requests = BodyRequests(
            engine, self.messages, self.waits, self.value_stages, self.loss_point
        )
        self.session = None
        self.step = None  # the DirectStep or ThreadedStep, once the trace runs

    def run(self, code, names, frame) -> None:
        engine, trace = self.engine, self.trace
        args, kwargs = trace.raw_inputs
        n = engine.microbatches()
        if n > MOST_MICROBATCHES:
            raise NotImplementedError(
                f"distgrad runs pipeline steps of at most "
                f"{MOST_MICROBATCHES} microbatches, not {n}."
            )
        scheduler = greenlet.getcurrent()
        bodies = [MicrobatchBody(self.requests, m, scheduler) for m in range(n)]
        # On CUDA the schedule's backward calls tensor hooks on autograd's device threads, so
        # the step then runs in a worker thread that accepts hand-offs from any thread, and the
        # bodies run in turns here (threaded.py); on one thread the hooks wake them (direct.py).
        threaded = step_threaded()
        run_step = functools.partial(engine.run_step, args, kwargs)
        spaces = [{**frame.f_globals, **frame.f_locals} for _ in bodies]
        runners = BodyRunners(
            {body: (lambda space=space: exec(code, space)) for body, space in zip(bodies, spaces)},
            BODIES,
        )
        step_type = ThreadedStep if threaded else DirectStep
        self.step = step_type(run_step, bodies, runners, self.messages, self.waits)
        self.session = self.requests.session = session = self.step.session
        restore = self._instrument()
        engine.answering.append(self.check)  # what it has sent, for a peer that asks
        try:
            if 0 not in self.placement.my_stages:  # it idles until the first activation anyway
                self.check.post_receives()
            self.step.run(bodies)
            self.messages.finish()
        finally:
            engine.answering.remove(self.check)
            restore()
            runners.close()
            if not session.finished:
                session.abort()
            session.close()
            for body in bodies:
                body.requests = None
                body.release_held()
        capture.write_back(frame, joined(names, bodies, spaces))

    def _instrument(self):
        """Mark each action with its microbatch and phase, catch each microbatch's loss, and
        let the schedule's messages carry bundles where they can."""
        session, loss_point = self.session, self.loss_point

        def on_loss(microbatch, loss):
            if (loss_point, microbatch) in session.wanted:
                session.hand((loss_point, microbatch), loss)

        session.microbatch = -1
        undo = self.engine.instrument(functools.partial(_ActionSpan, self), on_loss)
        undo_piggyback = self.engine.piggyback(self.messages)
        if undo_piggyback is None:
            return undo

        def restore():
            undo_piggyback()
            undo()

        return restore

    # -- the action events ------------------------------------------------------------------
    def action_started(self, phase: str, stage: int, microbatch: int) -> None:
        # the schedule has received this action's inputs, and with them the bundle its
        # neighbour piggybacked (Messages.arrived)
        self.messages.arrived(phase, stage, microbatch)
        event = (phase, stage, microbatch)
        self.passed.add(event)  # (written out here and below: every action of every step)
        self.step.event(event)
        forward = phase == "F"
        self.session.microbatch = microbatch if forward else -1
        self.value_stages.in_backward = None if forward else stage

    def action_ended(self, phase: str, stage: int, microbatch: int, ok: bool) -> None:
        self.session.microbatch = -1
        self.value_stages.in_backward = None
        if not ok:
            return
        # the bundles of values this action produced go before the schedule sends the action's
        # result, so a receiver that got the result can take the values without waiting
        self._flush_action(phase, stage, microbatch)
        if phase == "F":  # every module of this stage has run for the microbatch
            event = ("F-end", stage, microbatch)
            self.passed.add(event)
            self.step.event(event)
        else:
            self.value_stages.check_reach(stage, microbatch)

    def _flush_action(self, phase: str, stage: int, microbatch: int) -> None:
        """Send, for every other rank, the bundle this action completes: after a forward the
        bundles of the ranks that take this stage's values in a later stage's forward, after a
        backward those of the ranks that take them in an earlier stage's backward."""
        messages = self.messages
        for action in self.placement.send_actions(microbatch, phase == "F", stage).values():
            if action != "end" and action[0] == phase and action not in messages.flushed:
                messages.flush(action)


class _ActionSpan:
    """``with _ActionSpan(run, phase, stage, microbatch):`` around one action of the schedule
    (what the engines' ``instrument`` calls ``on_action``). A class, not
    ``contextlib.contextmanager``: its generator machinery would run more bytecodes, at every
    action of every step."""

    __slots__ = ("run", "phase", "stage", "microbatch")

    def __init__(self, run, phase: str, stage: int, microbatch: int):
        self.run, self.phase, self.stage, self.microbatch = run, phase, stage, microbatch

    def __enter__(self):
        self.run.action_started(self.phase, self.stage, self.microbatch)

    def __exit__(self, exc_type, exc, tb):
        self.run.action_ended(self.phase, self.stage, self.microbatch, exc_type is None)
        return False


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
        out[name] = (
            value
            if value is not _MISSING
            else NotSaved(name, "in the body of a pipeline trace (it runs once per microbatch)")
        )
    return out


_MISSING = object()


def _join(values: list, saved: dict):
    first = values[0]
    if isinstance(first, torch.Tensor) and all(
        isinstance(v, torch.Tensor) and id(v) in saved for v in values
    ):
        dim = saved[id(first)]
        values = [v.detach() for v in values]
        return torch.stack(values) if first.dim() == 0 else torch.cat(values, dim=dim)
    if isinstance(first, (list, tuple)) and all(
        type(v) is type(first) and len(v) == len(first) for v in values
    ):
        items = [_join([v[i] for v in values], saved) for i in range(len(first))]
        return _MISSING if any(i is _MISSING for i in items) else type(first)(items)
    if isinstance(first, dict) and all(
        isinstance(v, dict) and v.keys() == first.keys() for v in values
    ):
        if all(id(v) in saved for v in values):  # distgrad.save(a_dict): its tensors, joined
            saved = {**saved, **{id(t): saved[id(v)] for v in values for t in v.values()}}
        items = {k: _join([v[k] for v in values], saved) for k in first}
        return _MISSING if any(i is _MISSING for i in items.values()) else items
    return _MISSING
