"""Blocking waits on helper threads, for receives that might never complete.

A timed wait on a gloo receive is not an option: when one expires, gloo closes every connection
of the group (checked on torch 2.13: later waits fail with "Application timeout caused pair
closure"). So a caller that must be able to give up - ``../pipeline/messages.py``, waiting for a
batch that a peer may never send - hands the blocking wait to a helper and waits on an event in
slices instead, reading what it needs between them.
"""
from __future__ import annotations

import queue
import threading


class _Helpers:
    """Threads that wait for receives that might never complete, so that the caller can give
    up on one. A helper whose receive never completes stays blocked until the connection
    closes (at the latest when the process exits; it is a daemon), and later waits go to
    another helper."""

    def __init__(self):
        self.idle: list = []
        self.lock = threading.Lock()

    def wait(self, work):
        """Start waiting for ``work`` on a helper; returns an event set when it ends and a list
        that then holds the error it raised, if any."""
        done, failed = threading.Event(), []
        with self.lock:
            helper = self.idle.pop() if self.idle else None
        if helper is None:
            helper = _Helper(self)
        helper.jobs.put((work, done, failed))
        return done, failed


class _Helper:
    def __init__(self, pool: _Helpers):
        self.pool, self.jobs = pool, queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="distgrad-batch-wait").start()

    def _run(self) -> None:
        while True:
            work, done, failed = self.jobs.get()
            try:
                work.wait()
            except BaseException as exc:  # handed to the waiting thread
                failed.append(exc)
            del work
            with self.pool.lock:
                self.pool.idle.append(self)
            done.set()


wait_on_a_helper = _Helpers().wait  # one pool for the process
