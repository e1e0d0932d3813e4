"""The pipeline step on the trace's own stack: the hook or chunk event that produces what a body
waits for wakes that body in place (a mixin of ``PipelineRun``, ``run.py``).

The scheduler loop of ``PipelineRun._schedule`` runs the step in a greenlet of its own and
pauses it at every value a body waits for, so each pause crossed the scheduler twice: four
greenlet switches and a turn of the loop. Here the step runs where the trace is (fewer
bytecodes a value, as ``benchmarks/diagnostics/pp_bytecodes_ranks.py`` counts), and:

* a hook that fires with a wanted value (``Session.hand``, replaced by ``_hand_direct``) gives
  it to the body that waits, switches into the body until it asks for its next value, and
  returns the body's reply to the schedule;
* a chunk event delivers the other stages' values due then to the bodies that wait for them,
  and wakes the body whose local value has passed (it raises);
* when the last body ends, mid-step, the ``"end"`` batches go and the end-of-step check starts,
  as the scheduler did;
* a body's exception unwinds the step as ``Abort`` (a ``BaseException``: the interleaved
  schedules log and re-raise every ``Exception``) and is raised again from the trace.

Only on one thread: on CUDA the backward calls hooks on autograd's device threads, which cannot
switch into a greenlet of the trace's thread, so there ``PipelineRun`` keeps the scheduler.
"""
from __future__ import annotations

import greenlet

from ...interleave.transports import Abort
from ...interleave.session import BODIES, Stop

_getcurrent = greenlet.getcurrent


class DirectSteps:
    """``PipelineRun``'s step with the bodies woken by the hooks; see the module text."""

    def _run_direct(self, bodies, runners, args, kwargs) -> None:
        session, messages = self.session, self.messages
        self.runners, self.main = runners, _getcurrent()
        self.body_error, self.checked = None, False
        session.hand = self._hand_direct
        for body in bodies:  # each runs to its first request
            self._wake(body)
        # The trace's own body is registered for this greenlet (trace.py); while the step runs
        # here it is not, so that the schedule's code and other libraries' hooks in it (an
        # optimizer in DeepSpeed's train_batch) get PyTorch's own `.grad`, as in a greenlet of
        # its own (gradpatch.py).
        trace_body = BODIES.pop(self.main, None)
        error = None
        try:
            self.engine.run_step(args, kwargs)
        except Abort:
            error, self.body_error = self.body_error, None
            if error is None:
                raise
        finally:
            if trace_body is not None:
                BODIES[self.main] = trace_body
            session.finished = True
        if error is not None:  # raised here, outside the handler: its own cause and context
            raise error
        # The step is over: this rank's "end" batches go before any body waits for a peer's
        # (no cycle between ranks), then the bodies that wait for "end" take theirs, and any
        # body still waiting asked for something the step never produced: it raises.
        self.fired.add("end")
        if "end" not in messages.sent:
            messages.flush("end")
        if "end" in self.waiting:
            self._deliver("end", self._wake)
        for body in bodies:
            if runners.live(body):
                body.remote_value = None
                self._wake(body)
        if not self.checked:
            self._bodies_done()

    def _hand_direct(self, key, value):
        """``Session.hand`` for this step: the value to the bodies waiting for ``key``, and
        their reply back to the hook."""
        if _getcurrent() is not self.main:
            raise RuntimeError(
                "distgrad: a pipeline hook fired outside the step it traces (on another thread, "
                "or inside a trace body). For a backward on an accelerator set "
                "distgrad.config.backward_mode = 'thread'.")
        session = self.session
        kind = key[0].kind
        served = []
        for body in session.bodies:
            if body.pending == key:
                rows, tensor, local = body.wants
                body.stop = Stop(key, value, rows, kind, session.size, session.slices, tensor,
                                 local)
                served.append(body)
        try:
            for body in served:
                self._wake(body)
        except Abort:
            raise
        except BaseException as exc:  # the body's: unwind the step, then raise it
            self.body_error = exc
            raise Abort() from None
        session.served = served
        return session.bodies_reply()

    def _event_direct(self, key) -> None:
        """At a chunk event: deliver the values due, and wake a body whose value has passed."""
        try:
            if key in self.waiting:
                self._deliver(key, self._wake)
            body = self.marks.get(key)
            if body is not None:
                self._wake(body)
        except Abort:
            raise
        except BaseException as exc:  # a body's, or a delivery's: as in _hand_direct
            self.body_error = exc
            raise Abort() from None

    def _wake(self, body) -> None:
        runners = self.runners
        runners.wake(body)  # an exception of the body is raised here
        if not runners.todo and not self.checked:
            self._bodies_done()

    def _bodies_done(self) -> None:
        """Every request is made, so nothing more joins the ``"end"`` batches: they go now, not
        when the step ends, since a peer's bodies and its part of the check wait for them. Then
        the check of the requests, which travels while the step runs on."""
        self.checked = True
        if "end" not in self.messages.sent:
            self.messages.flush("end")
        self.messages.start_check()
