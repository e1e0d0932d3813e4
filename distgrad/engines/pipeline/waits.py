"""The action events a pipeline step has passed on this rank, and the bodies waiting for one:
where a body's request (``body_requests.py``) waits and the step (``direct.py``,
``threaded.py``) wakes it.

An event key is ``(phase, stage, microbatch)``: ``"F"`` or ``"B"``, an action of this rank's
``stage`` starts; ``"F-end"``, its forward of the microbatch has ended (every module of the stage
has run for it). ``"end"``: this rank's step has ended. A body waits for an event in two ways:

* for a value of another rank's stage, until its receiving action (``placement.py``), when the
  value's bundle has certainly been sent (``remote``);
* for a value of this rank's stage, which has passed if a given event comes first: the body is
  woken then and raises (``deadlines``; the body keeps its deadline in ``body.deadline`` too).
"""

from __future__ import annotations

from ...errors import TraceStateError


class Waits:
    """One trace's record of the events passed and the bodies waiting. ``messages``: where a
    body's remote value comes from; ``check``: told of every value a body asks another rank
    for."""

    def __init__(self, messages, check):
        self.messages, self.check = messages, check
        self.passed: set = set()  # event keys passed
        self.remote: dict = {}  # receiving action -> [(body, src rank, tag)]
        self.deadlines: dict = {}  # event key -> the body whose local value has passed by then

    def wait_remote(self, body, action, src: int, tag: int):
        """The body's value ``tag`` of ``src``'s stage, which comes in the bundle for
        ``action``: taken now if the action has passed, else once the step wakes the body
        (``deliver``)."""
        messages = self.messages
        self.check.ask(src, tag)
        messages.expect(src, action)  # posted now, it arrives while the body waits
        if action in self.passed:
            return messages.take(src, action, tag)
        self.remote.setdefault(action, []).append((body, src, tag))
        body.pending = ("remote", tag)
        body.remote_value = None
        try:
            body.scheduler.switch()
        finally:
            body.pending = None
        if body.remote_value is None:
            raise TraceStateError(
                f"the pipeline step ended before rank {src} sent a value this "
                f"body asked for (microbatch {body.index})."
            )
        value, body.remote_value = body.remote_value, None
        return value

    def deliver(self, action, wake) -> None:
        """At ``action`` (or the end): each body waiting for it gets its value, and ``wake``
        runs it to its next request."""
        for body, src, tag in self.remote.pop(action):
            body.remote_value = self.messages.take(src, action, tag)
            wake(body)
