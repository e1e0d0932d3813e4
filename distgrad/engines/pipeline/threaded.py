"""The pipeline step in a worker thread, its bodies run in turns on the trace's stack
(``ThreadedStep``): what a CUDA backward needs, whose tensor hooks run on autograd's device
threads and so cannot switch into a body's greenlet (one thread: ``direct.py``).

The session runs the step in a thread that accepts hand-offs from any thread and pauses it at
every value a body waits for; the loop here resumes it, serves the bodies whose value it paused
at, and delivers the values of other stages at the action events they wait for, which the step
fires as pauses too.
"""

from __future__ import annotations

from ...interleave.session import Session


class ThreadedStep:
    """One trace's step in its session's worker thread; see the module text. It builds the
    forward ``session`` of the step, whose run is the step. Given: the step (``run_step``, a
    function of nothing), the ``bodies``, the bodies' ``runners``, the ``messages`` and the
    ``waits`` (``waits.py``)."""

    def __init__(self, run_step, bodies, runners, messages, waits):
        self.session = Session("forward", run_step, bodies, threaded=True)
        self.runners, self.messages, self.waits = runners, messages, waits

    def run(self, bodies) -> None:
        self._schedule(bodies)
        # Every request is made: the "end" bundles go and the check starts now, not when the
        # step ends (Messages.bodies_done); the step runs on with the bodies' replies.
        self.messages.bodies_done()
        self.session.finish()

    def event(self, key) -> None:
        """At an action event (in the step's thread): pause the step there if a body waits
        for it."""
        session = self.session
        if key in self.waits.remote or key in session.wanted:
            session.hand((_EVENTS[key[0]], key[1], key[2]), None)

    def _schedule(self, bodies) -> None:
        # This loop runs twice per pause of the step, so it keeps to what changed: the bodies
        # the last pause served, and the deadlines only bodies waiting for local values need.
        session, waits = self.session, self.waits
        remote, passed = waits.remote, waits.passed
        wanted, todo, wake = session.wanted, self.runners.todo, self.runners.wake
        for body in bodies:
            wake(body)
        while todo:
            found = None
            if remote:
                finished = session.finished
                for key in remote:
                    if key in passed or (finished and key == "end"):
                        found = key
                        break
            if found is not None:
                session.wanted.pop(found, None)
                waits.deliver(found, wake)
                continue
            if session.finished:
                for body in [b for b in bodies if id(b) in todo]:
                    body.remote_value = None  # what it waits for never comes: it raises
                    wake(body)
                continue
            for key in remote:
                wanted[key] = 1
            # a local value may already have passed: notice when, for this advance only
            # (a body that ended, or waits for anything else, has no deadline: no need to
            # pick out the waiting ones, which would cost a list a turn)
            deadlines = []
            for body in bodies:
                deadline = body.deadline
                if deadline is not None and deadline not in wanted:
                    wanted[deadline] = 1
                    deadlines.append(deadline)
            session.advance()
            for key in deadlines:
                wanted.pop(key, None)
            if session.finished:  # before any body waits for "end": no cycle between ranks
                self.messages.flush("end")
            key = session.paused_key
            if key is None or key in remote:
                continue  # the end, or a delivery at the top of the loop
            if session.served:  # the bodies whose value this is
                for body in list(session.served):
                    if body.pause is not None and body.pending is not None:
                        wake(body)
            elif key[0].__class__ is _ActionEvent:  # a deadline: bodies whose value has passed
                for body in bodies:
                    if body.deadline == key:
                        wake(body)


class _ActionEvent(str):
    """An action event's name as the session pauses at it: equal to the plain string, and with
    the ``kind`` the session reads from the first item of every key it pauses at."""

    kind = "event"


_EVENTS = {name: _ActionEvent(name) for name in ("F", "B", "F-end")}
