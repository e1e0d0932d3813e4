"""Invokes whose rows overlap, served one after another at each value.

An empty ``tracer.invoke()`` sees the whole batch, so its rows overlap every other invoke's.
As in nnsight, the bodies waiting at one value then see it in invoke order, each as the bodies
before it left it: an empty invoke after ``with tr.invoke(a): h.output = h.output * 0`` reads
zeros in ``a``'s rows, and its own edit is applied on top of them.
"""

from __future__ import annotations

from . import batching
from .session import Pause, Session


class InOrderSession(Session):
    """A session of invoke bodies with overlapping rows. At a pause ``serve`` gives the first
    waiting body its view; the scheduler calls ``serve_next`` once that body has moved on,
    which folds its reply into ``current`` and serves the next one from it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queue: list = []  # bodies waiting at the paused value, not served yet
        self.current = None  # the paused value as the bodies served so far left it
        self.last = None  # the body served last, whose reply is not folded in yet

    def serve(self, key, value) -> None:
        self.current = value
        self.queue = [body for body in self.bodies if body.pending == key]
        self._serve_first(key)

    def _serve_first(self, key):
        body = self.queue.pop(0)
        rows, tensor, local = body.wants
        body.pause = Pause(
            key, self.current, rows, key[0].kind, self.size, self.slices, tensor, local
        )
        self.served.append(body)
        self.last = body
        return body

    def serve_next(self):
        if not self.queue or self.finished:
            return None
        key = self.paused_key
        self._fold()
        while self.queue and self.queue[0].pending != key:  # gone (a body that failed)
            self.queue.pop(0)
        return self._serve_first(key) if self.queue else None

    def _fold(self) -> None:
        body, self.last = self.last, None
        pause = body.pause if body is not None else None
        if pause is None:
            return
        reply = pause.reply()
        if reply is not None:
            merged = batching.merge(self.current, [(pause.rows, reply)], self.size)
            self.current = reply if merged is None else merged

    def _merged_reply(self, served):
        if not served:
            return None
        self._fold()
        for body in served:
            body.pause = None
        reply = None if self.current is self.paused_value else self.current
        self.paused_value = self.current = None
        self.queue = []
        return reply

    def abort(self) -> None:
        self.queue, self.current, self.last = [], None, None
        super().abort()
