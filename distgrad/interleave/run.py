"""Runs a forward or a backward as a coroutine of the with-block body.

The body asks for a value; the run goes on until the hook that produces it fires; the hook hands
the value over and waits; the body reads or replaces it and, when it asks for the next value,
hands the reply back to the hook. Two ways to switch, one protocol:

* ``GreenletRun`` runs ``fn`` in a greenlet on the body's own thread. A switch is cheap and
  the run sees the body's thread-local state (grad mode, CUDA device and stream).
  Forward hooks, and backward hooks of a graph on the CPU, fire on the calling thread, so this
  serves every forward and every CPU backward.
* ``ThreadRun`` runs ``fn`` in a worker thread and accepts hand-offs from any thread. On CUDA the
  autograd engine calls tensor hooks on its per-device threads while the thread that called
  ``backward()`` sits blocked in C++, so such a backward cannot share the body's thread. A
  hand-off costs a lock round trip, dearer than a switch (see docs/performance.md). The worker
  threads are kept and reused: PyTorch sets up per-thread state the first time a thread runs a
  backward, which made a fresh thread per backward block cost more than the backward itself.

Events returned to the driver by ``resume``: a pause is the pair ``(key, value)`` (a plain tuple:
checking ``event.__class__ is tuple`` is the cheapest test on the hot path); the end is an
``Outcome`` whose ``kind`` is ``"done"`` (``value``: the result), ``"error"`` (``value``: the
exception) or ``"aborted"``.
"""
from __future__ import annotations

import threading

import greenlet
import torch

from .. import cpp_backtrace


class Abort(BaseException):
    """Thrown into a run to unwind it after the body failed; never reaches the user."""


class Outcome:
    """How a run ended: ``kind`` is "done", "error" or "aborted"; ``value`` the result or error."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value=None):
        self.kind = kind
        self.value = value

    def taken(self) -> "Outcome":
        """The receiver's copy. The runner greenlet that made this one keeps it on its stack
        while it idles in the pool, so it is emptied here: the run's result (the logits, an
        exception and its frames) must die when the receiver lets go of it."""
        value, self.value = self.value, None
        return Outcome(self.kind, value)


def outcome_of(fn) -> Outcome:
    try:
        return Outcome("done", fn())
    except (Abort, greenlet.GreenletExit) as exc:
        if isinstance(exc, greenlet.GreenletExit):
            raise
        return Outcome("aborted")
    except BaseException as exc:  # handed to the body, which re-raises it
        return Outcome("error", exc)


# A new greenlet allocates a fresh interpreter data stack the first time it runs Python, which
# made a tiny forward measurably slower than the same forward run directly. So each thread keeps
# idle runner greenlets and reuses them: one is created per thread, more for nested runs and for
# bodies run in turns (BodyRunners).
_idle = threading.local()
_getcurrent = greenlet.getcurrent


def _runner():
    fn = greenlet.getcurrent().parent.switch()  # started empty: see _take_runner
    while True:
        outcome = outcome_of(fn)
        fn = None  # the finished run's function (its inputs, a backward's graph) dies with it
        fn = greenlet.getcurrent().parent.switch(outcome)


def _take_runner() -> greenlet.greenlet:
    pool = getattr(_idle, "runners", None)
    if pool is None:
        pool = _idle.runners = []
    if pool:
        return pool.pop()
    # Started here with no arguments, to wait for its first run's function like an idle one:
    # a greenlet keeps the arguments it was started with for as long as it lives, and in the
    # pool that would keep its first run's function (the model, the inputs) alive.
    cpp_backtrace.guard()  # a torch error on a greenlet raises instead of crashing (once)
    glet = greenlet.greenlet(_runner)
    glet.switch()
    return glet


_MOST_IDLE = 64  # idle runners a thread keeps (a trace with more invokes makes the rest anew)


def _give_back(glet) -> None:
    pool = _idle.runners
    if not glet.dead and len(pool) < _MOST_IDLE:
        pool.append(glet)


class BodyRunners:
    """Greenlets for bodies that a scheduler runs in turns (invokes, a pipeline's microbatches),
    taken from the same per-thread pool as the runs: a new greenlet pays for a fresh data
    stack the first time it runs Python, and a pipeline step starts several bodies. ``bodies``
    maps each Body to the function that runs it; each greenlet is entered in ``registry``
    (``session.BODIES``) while it runs its body, so that the body can be found."""

    def __init__(self, bodies: dict, registry: dict):
        self.todo = {}  # id(body) -> [greenlet, function to start it with, or None once started]
        self.taken = []
        self.registry = registry
        scheduler = _getcurrent()
        for body, fn in bodies.items():
            glet = _take_runner()
            glet.parent = scheduler
            self.taken.append(glet)
            registry[glet] = body
            self.todo[id(body)] = [glet, fn]

    def live(self, body) -> bool:
        return id(body) in self.todo

    def wake(self, body) -> None:
        """Run ``body`` until it waits or ends; an exception of the body is raised here."""
        entry = self.todo[id(body)]
        glet, fn = entry
        if fn is not None:
            entry[1] = None
            got = glet.switch(fn)
        else:
            got = glet.switch()
        if got.__class__ is Outcome:  # the body ended
            got = got.taken()
            del self.todo[id(body)]
            if got.kind == "error":
                raise got.value

    def close(self) -> None:
        """Unwind the bodies still waiting and give every greenlet back to the pool."""
        scheduler = _getcurrent()
        started = {id(entry[0]) for entry in self.todo.values() if entry[1] is None}
        for glet in self.taken:
            self.registry.pop(glet, None)
            if id(glet) in started:  # started and not ended
                glet.parent = scheduler
                if glet.throw(Abort()).__class__ is not Outcome:
                    continue  # the body caught the abort and waits again: never reuse it
            _give_back(glet)
        self.taken, self.todo = [], {}


class GreenletRun:
    def __init__(self, fn):
        self.fn = fn
        self.glet = None
        self.finished = False
        self.thread = threading.current_thread()

    def resume(self, reply=None):
        # The run returns to whoever resumed it: the body, or the invoke scheduler.
        glet = self.glet
        if glet is None:
            self.glet = glet = _take_runner()
            glet.parent = _getcurrent()
            event = glet.switch(self.fn)
        else:
            glet.parent = _getcurrent()
            event = glet.switch(reply)
        if event.__class__ is not tuple:
            event = event.taken()
            self.done()
        return event

    def hand(self, key, value):
        glet = self.glet
        if _getcurrent() is not glet:
            raise RuntimeError(
                "distgrad: a hook fired on a thread other than the one running the trace "
                f"({threading.current_thread().name}). For a backward on an accelerator set "
                "distgrad.config.backward_mode = 'thread'.")
        return glet.parent.switch(key, value)  # the receiver gets the pair (key, value)

    def hand_solo(self, key, value):
        """``hand`` for a session with one body that drives the run: while a key is wanted that
        body waits in ``resume``, so a hook that fires on this thread runs in the run's greenlet
        and the check is needed only for other threads, where the switch itself refuses."""
        try:
            return self.glet.parent.switch(key, value)
        except greenlet.error:
            if threading.current_thread() is self.thread:
                raise
            self.hand(key, value)  # raises the message for a hook on another thread

    def abort(self):
        if self.glet is not None:
            self.glet.parent = greenlet.getcurrent()
            self.glet.throw(Abort())
            self.done()
        self.finished = True

    def done(self):
        self.finished = True
        _give_back(self.glet)
        self.glet = None


class _Worker:
    """A daemon thread that runs one job at a time; idle workers wait in ``_workers``."""

    def __init__(self):
        self.job = None
        self.go = threading.Lock()
        self.go.acquire()
        self.thread = threading.Thread(target=self._loop, name="distgrad-backward", daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            self.go.acquire()
            job, self.job = self.job, None
            job()
            job = None  # not kept while idle: it holds the finished run

    def start(self, job) -> None:
        self.job = job
        self.go.release()


_workers: list[_Worker] = []  # idle ones; a list's append and pop are atomic under the GIL


class ThreadRun:
    glet = None  # no greenlet: Session.request_solo takes resume()
    hand_solo = property(lambda self: self.hand)

    def __init__(self, fn):
        self.fn = fn
        self.worker = None
        self.finished = False
        self._to_body = threading.Lock()
        self._to_run = threading.Lock()
        self._to_body.acquire()
        self._to_run.acquire()
        self._one_hand = threading.Lock()  # several device threads may fire hooks at once
        self._box = None
        self._reply = None
        self._aborting = False
        # CUDA device and stream are per thread: the worker must use the body's.
        self._stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    def _main(self):
        # The job's last act is the release: after it the worker may be handed to another run.
        if self._stream is not None:
            torch.cuda.set_device(self._stream.device)
            with torch.cuda.stream(self._stream):
                self._box = outcome_of(self.fn)
        else:
            self._box = outcome_of(self.fn)
        self._to_body.release()

    def resume(self, reply=None):
        if self.worker is None:
            self.worker = _workers.pop() if _workers else _Worker()
            self.worker.start(self._main)
        else:
            self._reply = reply
            self._to_run.release()
        self._to_body.acquire()
        event, self._box = self._box, None
        if event.__class__ is not tuple:
            self.done()
        return event

    def hand(self, key, value):
        with self._one_hand:
            if self._aborting:
                raise Abort()
            self._box = (key, value)
            self._to_body.release()
            self._to_run.acquire()
            if self._aborting:
                raise Abort()
            return self._reply

    def abort(self):
        if self.worker is not None and not self.finished:
            self._aborting = True
            self._to_run.release()
            self._to_body.acquire()
            self.done()
        self.finished = True

    def done(self):
        self.finished = True
        _workers.append(self.worker)
