"""Sessions and bodies: who asks for values, and the run that answers.

A *session* is one run (a forward, or a backward) plus the hook points installed on it. A *body*
is one with-block body that asks for values: the trace body, or one invoke's body. A session
serves its bodies in invoke order; a body that is not an invoke drives the session itself, an
invoke body hands control to the trace's scheduler (see ``invoke.py``).

``BODIES`` maps the greenlet that runs a body to it: that is how ``.output``, ``.grad`` and
``.save()`` find their trace without any global "current trace" that other code could see.
"""
from __future__ import annotations

import greenlet
import torch

from ..errors import OutOfOrderError, check_replacement_grad, describe_tensor
from . import batching
from .points import GradPoint, ModulePoint
from .run import GreenletRun, ThreadRun

BODIES: dict = {}
UNSET = object()
_getcurrent = greenlet.getcurrent


def current_body():
    return BODIES.get(greenlet.getcurrent()) if BODIES else None


class Body:
    """One with-block body that asks for values. ``requests`` serves it (``requests.py``)."""

    def __init__(self, requests, rows: slice | None = None, index: int | None = None,
                 scheduler=None):
        self.requests = requests    # what serves this body's requests (requests.py)
        self.rows = rows            # rows of the batch this body sees; None: all of them
        self.index = index          # invoke number, for messages
        self.scheduler = scheduler  # greenlet to yield to (invoke bodies); None: drive the run
        self.pending = None         # key (point, call) this body waits for
        # How it wants that value: (rows it will see, for a gradient key the tensor whose .grad
        # it asked for, whether it asked through `.local` - this rank's shard as it is).
        self.asked = (rows, None, False)
        self.stop = None            # Stop: where the run is paused for this body
        self.block = None           # the open BackwardTracer, if any
        self.saves: list = []
        self.labels: dict = {}      # id(tensor) -> (tensor, "model.x.output") for messages

    def label_of(self, tensor) -> str:
        entry = self.labels.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            return describe_tensor(tensor)
        return entry[1] + entry[2]

    def remember(self, value, path: str, kind: str) -> None:
        """Name the tensors in a value handed to the body, for error messages. The label is
        kept in pieces (``path``, ``".output"``) and joined only when a message needs it."""
        if isinstance(value, torch.Tensor):
            self.labels[id(value)] = (value, path, kind)
        elif isinstance(value, dict):  # ModelOutput too: model.output.logits
            for key, item in value.items():
                if isinstance(item, torch.Tensor):
                    self.labels[id(item)] = (item, path, f"{kind}.{key}")
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    self.labels[id(item)] = (item, path, f"{kind}[{i}]")


class Stop:
    """One body's view of the point the run is paused at, and what the body put there."""

    __slots__ = ("key", "tensor", "kind", "rows", "view", "version", "replacement", "local")

    def __init__(self, key, value, rows, kind: str, size: int, slices: dict | None,
                 tensor=None, local: bool = False):
        self.key = key
        self.tensor = tensor  # whose .grad this is, as the body named it
        self.kind = kind
        self.rows = rows
        self.replacement = UNSET
        self.local = local  # asked for through `.local` (this rank's shard as it is)
        if rows is not None:
            value = batching.narrow(value, rows, size, slices)
        if kind == "grad":
            # The body gets its own copy: autograd may pass one gradient tensor to several
            # branches, and an in-place edit must reach only the branch of this tensor.
            value = value.clone()
            # torch_internals.version, inline: this runs for every gradient read
            self.version = value._version
        self.view = value

    @classmethod
    def blank(cls, kind: str) -> "Stop":
        """A Stop for a solo session to refill at each pause (``Session.request_solo``)."""
        stop = cls.__new__(cls)
        stop.kind = kind
        stop.rows = None
        stop.key = stop.tensor = stop.view = stop.version = None
        stop.replacement = UNSET
        stop.local = False
        return stop

    def value(self):
        return self.view if self.replacement is UNSET else self.replacement

    def replace(self, value, label) -> None:
        """``label``: the name the user wrote, or a function that words it (error paths only)."""
        if self.kind == "grad":
            check_replacement_grad(label, self.view, value)
        self.replacement = value

    def reply(self):
        if self.replacement is not UNSET:
            return self.replacement
        return self.edited()

    def edited(self):
        """The body's copy of a gradient if the body edited it in place, else None."""
        # torch_internals.version, inline: this runs for every gradient handed back
        if self.kind == "grad" and self.view._version != self.version:
            return self.view
        return None


def passed_error(passed_message) -> Exception:
    """The error for a key the run went past: ``passed_message()`` gives the text, or the whole
    exception when the cause is not ordering (a tensor no gradient reaches)."""
    found = passed_message()
    return found if isinstance(found, Exception) else OutOfOrderError(found)


class Session:
    def __init__(self, kind: str, fn, bodies: list[Body], size: int = 0, threaded: bool = False,
                 views=None):
        self.kind = kind            # "forward" or "backward"
        self.run = ThreadRun(fn) if threaded else GreenletRun(fn)
        self.resume = self.run.resume
        self.bodies = bodies
        self.size = size            # batch size, for splitting values between invokes
        self.wanted: dict = {}      # key -> number of bodies waiting for it
        self.points: dict = {}      # (module id, kind) or tensor id -> point
        self.installed: list = []   # every point made, to remove them all at close
        self.served: list[Body] = []
        self.slices: dict | None = None  # id(view) -> (view, full) for values split by invoke
        self.paused_value = None
        self.views = views          # the engine's TensorParallelViews, or None: values as they are
        self.paused_token = None    # what views.show returned for the paused value
        self.paused_key = None      # the key the run is paused at
        self.microbatch = None      # under a pipeline schedule: the microbatch now running
        self.covered: set = set()   # envoy paths whose enclosing modules have output points
        self.finished = False
        # One body that drives the run itself and sees whole values: nothing to merge, split
        # or show, so requests take the short path (request_solo).
        self.solo = (len(bodies) == 1 and bodies[0].scheduler is None and bodies[0].rows is None
                     and views is None)
        # A solo session pauses for one body at a time and the body is done with a Stop once it
        # asks for the next value, so it refills one Stop instead of making one per pause.
        self.spare = Stop.blank("grad" if kind == "backward" else "value") if self.solo else None
        # what a hook calls to hand a wanted value to the bodies
        self.hand = self.run.hand_solo if self.solo else self.run.hand

    # -- points ---------------------------------------------------------------------------
    def module_point(self, module, path: str, kind: str, new: bool = False) -> ModulePoint:
        """``new``: the caller has just found none for this module and kind. A new point enters
        itself in ``points`` and ``installed`` (removed at close)."""
        point = None if new else self.points.get((id(module), kind))
        if point is None:
            point = ModulePoint(self, module, path, kind)
        return point

    def grad_point(self, tensor, new: bool = False) -> GradPoint:
        """``new``: the caller has just found none for this tensor."""
        point = None if new else self.points.get(id(tensor))
        if point is None or point.tensor is not tensor:
            point = self.points[id(tensor)] = GradPoint(self, tensor)
        return point

    # -- the body side --------------------------------------------------------------------
    def request(self, body: Body, key, passed_message, rows=UNSET, tensor=None,
                local: bool = False) -> Stop:
        """Stop where ``key`` fires and return the body's view of it (its ``rows`` of it).
        ``passed_message()`` words the error if the run goes past ``key`` instead."""
        stop = body.stop
        if stop is not None and stop.key == key:
            return stop
        if self.finished:
            raise passed_error(passed_message)
        if self.solo and rows is UNSET:
            return self.request_solo(body, key, passed_message, tensor, local)
        body.pending = key
        body.asked = (body.rows if rows is UNSET else rows, tensor, local)
        wanted = self.wanted
        wanted[key] = wanted.get(key, 0) + 1
        try:
            if body.scheduler is None:
                self.advance()
            else:
                body.scheduler.switch()
        finally:
            body.pending = None
            left = wanted.pop(key) - 1
            if left:
                wanted[key] = left
        stop = body.stop
        if stop is not None and stop.key == key:
            return stop
        raise passed_error(passed_message)

    def request_solo(self, body: Body, key, passed_message, tensor=None, local=False) -> Stop:
        """``request`` for a ``solo`` session, when the body is not already at ``key``."""
        # request + advance + bodies_reply + Stop() for the common case, written out: this runs
        # twice per read+edit, and each call of the general path costs a few hundred nanoseconds.
        if self.finished:
            raise passed_error(passed_message)
        stop = body.stop
        reply = None
        if stop is not None:
            body.stop = None
            reply = stop.replacement
            if reply is UNSET:
                reply = stop.edited()
        wanted = self.wanted
        wanted[key] = 1
        try:
            glet = self.run.glet
            if glet is not None:  # GreenletRun.resume, written out
                glet.parent = _getcurrent()
                event = glet.switch(reply)
                if event.__class__ is not tuple:
                    event = event.taken()
                    self.run.done()
            else:
                event = self.resume(reply)
        finally:
            del wanted[key]
        if event.__class__ is tuple:  # only this key is wanted, so the run paused at it
            stop = self.spare
            stop.key = key
            stop.tensor = tensor
            stop.local = local
            stop.replacement = UNSET
            value = event[1]
            if tensor is not None:  # a gradient: the body's own copy (see Stop)
                value = value.clone()
                # torch_internals.version, inline: this runs for every gradient read
                stop.version = value._version
            stop.view = value
            body.stop = stop
            return stop
        self.finished = True
        if event.kind == "error":
            raise event.value
        raise passed_error(passed_message)

    def advance(self) -> None:
        """Resume the run with the bodies' replies until it pauses at a wanted key or ends."""
        event = self.resume(self.bodies_reply())
        if event.__class__ is tuple:
            key, value = event
            self.paused_key = key
            if self.views is not None:
                value, self.paused_token = self._show(key, value)
            self.paused_value = value
            self.serve(key, value)
            return
        self.finished = True
        self.paused_key = None
        if event.kind == "error":
            raise event.value

    def serve(self, key, value) -> None:
        """Give each body waiting for ``key`` its view of ``value``, all at once (their rows
        are apart; ``in_order.py`` serves bodies whose rows overlap one after another)."""
        kind = key[0].kind
        for body in self.bodies:
            if body.pending == key:
                rows, tensor, local = body.asked
                body.stop = Stop(key, value, rows, kind, self.size, self.slices, tensor, local)
                self.served.append(body)

    def serve_next(self):
        """The next body to serve at the paused value, once the bodies served have moved on;
        None: every body waiting there has its view (see ``serve``)."""
        return None

    def finish(self) -> None:
        while not self.finished:
            self.advance()

    def abort(self) -> None:
        self.served = []
        for body in self.bodies:
            body.stop = None
        if not self.finished:
            self.run.abort()
            self.finished = True

    def close(self) -> None:
        for point in self.installed:
            point.remove()
        self.installed.clear()
        self.points.clear()
        # A closed session lets go of its bodies, its run and its spare Stop. Each links back
        # here (a body's trace holds this session; the run's function a backward block that
        # holds it; the Stop's key a point of it), and a cycle would keep the trace's tensors
        # alive until the cycle collector happens to run. A request after close finds
        # ``finished`` set first and raises before it could use any of them.
        self.bodies = self.served = ()
        self.spare = self.paused_value = self.paused_key = None
        self.run = self.resume = self.hand = None

    def _show(self, key, value):
        point = key[0]
        if isinstance(point, GradPoint):
            if point.split is None:
                return value, None
            whole, split = self.views.show_grad(point.split, value)
            return whole, ("grad", split)
        if all(b.asked[2] for b in self.bodies if b.pending == key):
            return value, None
        whole, token = self.views.show(point.kind, point.module, value, point.label)
        return whole, (None if token is None else ("value", token))

    def bodies_reply(self):
        if self.solo:
            body = self.bodies[0]
            stop = body.stop
            if stop is None:
                return None
            body.stop = None
            return stop.reply()
        served = self.served
        if not served and self.paused_token is None:
            return None
        self.served = []
        if len(served) == 1 and self.paused_token is None:  # one body, whole value: common case
            body = served[0]
            stop = body.stop
            if stop.rows is None:
                body.stop = None
                self.paused_value = None
                return stop.reply()
        token, self.paused_token = self.paused_token, None
        reply = self._merged_reply(served)
        if token is None:
            return reply
        if token[0] == "grad":
            return None if reply is None else self.views.place_grad(token[1], reply)
        return self.views.place(token[1], reply)

    def _merged_reply(self, served):
        if not served:
            return None
        if all(b.stop.rows is None for b in served):
            replies = [r for r in (b.stop.reply() for b in served) if r is not None]
            reply = replies[-1] if replies else None  # whole values: the last writer wins
        else:
            pieces = [(b.stop.rows, b.stop.reply()) for b in served]
            reply = batching.merge(self.paused_value, pieces, self.size)
        for body in served:
            body.stop = None
        self.paused_value = None
        return reply
