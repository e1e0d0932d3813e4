"""Transports: how control moves between a with-block body and the run (a forward or a
backward) that answers it. One interface, one hand-off:

* the body's side calls ``resume(reply)``: the run goes on (``reply``: what the body put at the
  value it was paused at, or None) until a hook hands a value over or the run ends;
* a hook calls ``hand(key, value)``: the run pauses, the body gets ``(key, value)`` from its
  ``resume``, and ``hand`` returns the reply of the body's next ``resume``;
* ``abort()`` unwinds a run the body gives up on; ``finished`` says the run has ended.

Two implementations, chosen per run by where its hooks fire:

* ``GreenletTransport`` runs ``fn`` in a greenlet on the body's own thread. A switch is cheap
  and the run sees the body's thread-local state (grad mode, CUDA device and stream). Forward
  hooks, and backward hooks of a graph on the CPU, fire on the calling thread, so this serves
  every forward and every CPU backward.
* ``ThreadTransport`` runs ``fn`` in a worker thread and takes hand-offs from any thread. On
  CUDA the autograd engine calls tensor hooks on its per-device threads while the thread that
  called ``backward()`` sits blocked in C++, so such a backward cannot share the body's thread.
  A hand-off is a lock round trip (its cost: docs/performance.md). Worker threads are kept and
  reused, because PyTorch sets up per-thread state the first time a thread runs a backward.

What ``resume`` returns: a pause is the pair ``(key, value)`` (a plain tuple, so that
``event.__class__ is tuple`` tells a pause from an end at the cost of one comparison); the end
is an ``Outcome`` whose ``kind`` is ``"done"`` (``value``: the result), ``"error"``
(``value``: the exception) or ``"aborted"``.

``BodyRunners`` are the greenlets of bodies that a scheduler runs in turns (invokes, a
pipeline's microbatches), from the same per-thread pool as the runs.
"""

from __future__ import annotations

import threading
import warnings

import greenlet
import torch

from .. import cpp_backtrace
from ..errors import StepsEnded


class Abort(BaseException):
    """Thrown into a run to unwind it after the body failed; never reaches the user."""


class Outcome:
    """How a run ended: ``kind`` is "done", "error" or "aborted"; ``value`` the result or error."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value=None):
        self.kind = kind
        self.value = value

    def taken(self) -> Outcome:
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


# A new greenlet allocates a fresh interpreter data stack the first time it runs Python, a cost
# of the order of a tiny forward. So each thread keeps idle runner greenlets and reuses them:
# one per thread, more for nested runs and for bodies run in turns (BodyRunners).
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
                if got.value.__class__ is StepsEnded:  # a tracer.iter loop outran the run
                    warnings.warn(str(got.value), stacklevel=2)
                    return
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


class Transport:
    """The interface both transports implement; see the module text. ``fn``: the run, a
    function of nothing (the model's forward, a backward) whose hooks call ``hand``."""

    finished = False

    def resume(self, reply=None):
        """Start the run, or send ``reply`` to the hook it is paused in; return the next
        event: ``(key, value)`` at a pause, an ``Outcome`` at the end."""
        raise NotImplementedError

    def hand(self, key, value):
        """Called by a hook: pause the run, give ``(key, value)`` to the body, and return the
        body's reply (None: the value flows on unchanged)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Unwind the run (raising ``Abort`` in the hook it is paused in); it ends."""
        raise NotImplementedError


class GreenletTransport(Transport):
    """The run in a greenlet on the body's thread; see the module text."""

    def __init__(self, fn):
        self.fn = fn
        self.glet = None
        self.finished = False

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
        if _getcurrent() is not glet:  # another thread, or a greenlet that is not this run
            raise RuntimeError(
                "distgrad: a hook fired on a thread other than the one running the trace "
                f"({threading.current_thread().name}). For a backward on an accelerator set "
                "distgrad.config.backward_mode = 'thread'."
            )
        return glet.parent.switch(key, value)  # the receiver gets the pair (key, value)

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


class ThreadTransport(Transport):
    """The run in a worker thread, hand-offs from any thread; see the module text."""

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
