"""The pipeline step on the trace's own stack (one thread): the hook or action event that
produces what a body waits for wakes that body in place (``DirectStep``; on a CUDA backward,
``threaded.py`` runs the step instead).

The step runs where the trace is, so a value reaches its body with one greenlet switch into the
body and one back, and no scheduler loop between them:

* a hook that fires with a wanted value calls ``DirectStep.hand`` (the hand-off the step's
  session is built with), which gives it to the body that waits, switches into the body until
  it asks for its next value, and returns the body's reply to the schedule;
* an action event delivers the other stages' values due then to the bodies that wait for them,
  and wakes the body whose local value has passed (it raises);
* when the last body ends, mid-step, the ``"end"`` bundles go and the end-of-step check starts
  (``Messages.bodies_done``), so that the peers waiting for them need not wait for this step;
* a body's exception unwinds the step as ``Abort`` (a ``BaseException``: the interleaved
  schedules log and re-raise every ``Exception``) and is raised again from the trace.

Only on one thread: on CUDA the backward calls hooks on autograd's device threads, which cannot
switch into a greenlet of the trace's thread.
"""

from __future__ import annotations

import greenlet

from ...interleave.session import BODIES, Pause, Session
from ...interleave.transports import Abort

_getcurrent = greenlet.getcurrent


class DirectStep:
    """One trace's step on this stack, its bodies woken by the hooks; see the module text.
    It builds the forward ``session`` of the step, whose hooks call ``hand``. Given: the
    step (``run_step``, a function of nothing, run here), the ``bodies``, the bodies'
    ``runners``, the ``messages`` and the ``waits`` (``waits.py``)."""

    def __init__(self, run_step, bodies, runners, messages, waits):
        self.session = Session("forward", run_step, bodies, hand=self.hand)
        self.runners, self.messages, self.waits = runners, messages, waits
        self.remote, self.deadlines = waits.remote, waits.deadlines
        self.step = run_step
        self.main = _getcurrent()  # the trace's greenlet, where the step runs
        self.body_error = None  # a body's exception, while it unwinds the step as Abort
        self.bodies_finished = False

    def run(self, bodies) -> None:
        session, messages, runners = self.session, self.messages, self.runners
        for body in bodies:  # each runs to its first request
            self._wake(body)
        # The trace's own body is registered for this greenlet (trace.py); while the step runs
        # here it is not, so that the schedule's code and other libraries' hooks in it (an
        # optimizer in DeepSpeed's train_batch) get PyTorch's own `.grad`, as in a greenlet of
        # its own (gradpatch.py).
        trace_body = BODIES.pop(self.main, None)
        error = None
        try:
            self.step()
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
        # The step is over: this rank's "end" bundles go before any body waits for a peer's
        # (no cycle between ranks), then the bodies that wait for "end" take theirs, and any
        # body still waiting asked for something the step never produced: it raises.
        self.waits.passed.add("end")
        if "end" not in messages.flushed:
            messages.flush("end")
        if "end" in self.remote:
            self.waits.deliver("end", self._wake)
        for body in bodies:
            if runners.live(body):
                body.remote_value = None
                self._wake(body)
        if not self.bodies_finished:
            self._bodies_done()

    def hand(self, key, value):
        """``Session.hand`` for this step: the value to the bodies waiting for ``key``, and
        their reply back to the hook."""
        if _getcurrent() is not self.main:
            raise RuntimeError(
                "distgrad: a pipeline hook fired outside the step it traces (on another thread, "
                "or inside a trace body). For a backward on an accelerator set "
                "distgrad.config.backward_mode = 'thread'."
            )
        session = self.session
        kind = key[0].kind
        served = []
        for body in session.bodies:
            if body.pending == key:
                rows, tensor, local = body.wants
                body.pause = Pause(
                    key, value, rows, kind, session.size, session.slices, tensor, local
                )
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

    def event(self, key) -> None:
        """At an action event (passed already): deliver the values due, and wake a body whose
        value has passed."""
        remote = self.remote
        if key not in remote and key not in self.deadlines:
            return
        try:
            if key in remote:
                self.waits.deliver(key, self._wake)
            body = self.deadlines.get(key)
            if body is not None:
                self._wake(body)
        except Abort:
            raise
        except BaseException as exc:  # a body's, or a delivery's: as in hand
            self.body_error = exc
            raise Abort() from None

    def _wake(self, body) -> None:
        runners = self.runners
        runners.wake(body)  # an exception of the body is raised here
        if not runners.todo and not self.bodies_finished:
            self._bodies_done()

    def _bodies_done(self) -> None:
        self.bodies_finished = True
        self.messages.bodies_done()
