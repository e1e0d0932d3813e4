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
from .scaling import unscaled_hand_off
from .transports import GreenletTransport, ThreadTransport

BODIES: dict = {}
UNSET = object()


def current_body():
    return BODIES.get(greenlet.getcurrent()) if BODIES else None


class Body:
    """One with-block body that asks for values. ``requests`` serves it (``requests.py``)."""

    def __init__(
        self, requests, rows: slice | None = None, index: int | None = None, scheduler=None
    ):
        self.requests = requests  # what serves this body's requests (requests.py)
        self.rows = rows  # rows of the batch this body sees; None: all of them
        self.index = index  # invoke number, for messages
        self.scheduler = scheduler  # greenlet to yield to (invoke bodies); None: drive the run
        self.pending = None  # key (point, call) this body waits for
        # How it wants that value: (rows it will see, for a gradient key the tensor whose .grad
        # it asked for, whether it asked through `.local` - this rank's shard as it is).
        self.wants = (rows, None, False)
        self.pause = None  # Pause: where the run is paused for this body
        self.block = None  # the open BackwardTracer, if any
        self.saves: list = []
        self.labels: dict = {}  # id(tensor) -> (tensor, "model.x.output") for messages
        self.held: list = []  # (object, its class): objects given .save() (saveable.py)

    def label_of(self, tensor) -> str:
        entry = self.labels.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            return describe_tensor(tensor)
        return entry[1] + entry[2]

    def release_held(self) -> None:
        """Give the objects this body held with ``.save()`` their own class back."""
        held, self.held = self.held, []
        for value, cls in held:
            value.__class__ = cls

    def remember(self, value, path: str, kind: str, pause=None, hold=None):
        """Name the tensors in a value handed to the body, for error messages, and return the
        value as the body holds it: a value that is not a tensor as ``hold(value, body,
        pause)`` makes it (``saveable.held``), if given. The label is kept in pieces (``path``,
        ``".output"``) and joined only when a message needs it."""
        if isinstance(value, torch.Tensor):
            self.labels[id(value)] = (value, path, kind)
            return value
        if isinstance(value, dict):  # ModelOutput too: model.output.logits
            for key, item in value.items():
                if isinstance(item, torch.Tensor):
                    self.labels[id(item)] = (item, path, f"{kind}.{key}")
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    self.labels[id(item)] = (item, path, f"{kind}[{i}]")
        return value if hold is None else hold(value, self, pause)


class Pause:
    """One body's view of the point the run is paused at, and what the body put there."""

    __slots__ = ("key", "tensor", "kind", "rows", "view", "version", "replacement", "local")

    def __init__(
        self,
        key,
        value,
        rows,
        kind: str,
        size: int,
        slices: dict | None,
        tensor=None,
        local: bool = False,
    ):
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
    """One run (a forward, or a backward block's backward), the points installed on it and the
    bodies it serves; see the module text.

    ``kind``: "forward" or "backward"; ``fn``: the run, a function of nothing; ``bodies``: the
    bodies it serves, in invoke order; ``size``: the batch size, to split values between
    invokes; ``threaded``: run ``fn`` in a worker thread (``ThreadTransport``), else a greenlet;
    ``views``: the engine's ``ShardViews`` (``engines/base.py``), or None: values as
    they are; ``scale``: a loss scaler's scale, to show gradients unscaled (``scaling.py``);
    ``hand``: for a scheduler that serves hooks itself (the pipeline's step on the trace's
    stack), what the hooks call instead of the transport's hand-off.
    """

    def __init__(
        self,
        kind: str,
        fn,
        bodies: list[Body],
        size: int = 0,
        threaded: bool = False,
        views=None,
        scale: float | None = None,
        hand=None,
    ):
        self.kind = kind
        self.transport = ThreadTransport(fn) if threaded else GreenletTransport(fn)
        self.bodies = bodies
        self.size = size
        self.wanted: dict = {}  # key -> number of bodies waiting for it
        self.points: dict = {}  # (module id, kind) or tensor id -> point
        self.installed: list = []  # every point made, to remove them all at close
        self.served: list[Body] = []
        self.slices: dict | None = None  # id(view) -> (view, full) for values split by invoke
        self.paused_value = None
        self.views = views
        self.paused_token = None  # what views.show returned for the paused value
        self.paused_key = None  # the key the run is paused at
        self.microbatch = None  # under a pipeline schedule: the microbatch now running
        self.outputs_watched: set = set()  # envoy paths whose enclosing modules have output points
        self.finished = False
        # One body that drives the run itself and sees whole values: nothing to merge, split
        # or show, so its requests take the short path (request_single).
        self.single_body = (
            len(bodies) == 1
            and bodies[0].scheduler is None
            and bodies[0].rows is None
            and views is None
        )
        # What a point's hook calls to hand a wanted value over: the one hand-off of the
        # transport, given its wrapping here, once, so that nothing rebinds it later.
        hand = self.transport.hand if hand is None else hand
        self.hand = hand if scale is None else unscaled_hand_off(hand, scale)

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
    def request(
        self, body: Body, key, passed_message, rows=UNSET, tensor=None, local: bool = False
    ) -> Pause:
        """Pause where ``key`` fires and return the body's view of it (its ``rows`` of it).
        ``passed_message()`` words the error if the run goes past ``key`` instead."""
        pause = body.pause
        if pause is not None and pause.key == key:
            return pause
        if self.finished:
            raise passed_error(passed_message)
        if self.single_body and rows is UNSET:
            return self.request_single(body, key, passed_message, tensor, local)
        body.pending = key
        body.wants = (body.rows if rows is UNSET else rows, tensor, local)
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
        pause = body.pause
        if pause is not None and pause.key == key:
            return pause
        raise passed_error(passed_message)

    def request_single(self, body: Body, key, passed_message, tensor=None, local=False) -> Pause:
        """``request`` for a ``single_body`` session, when the body is not already at ``key``:
        the short path of the most common request (one body, whole values), counted by
        benchmarks/bytecodes.py. With one body there is no one to wait for but the run, so the
        reply goes straight to the transport and the pause straight to a Pause."""
        if self.finished:
            raise passed_error(passed_message)
        pause = body.pause
        reply = None
        if pause is not None:
            body.pause = None
            reply = pause.reply()
        wanted = self.wanted
        wanted[key] = 1
        try:
            event = self.transport.resume(reply)
        finally:
            del wanted[key]
        if event.__class__ is tuple:  # only this key is wanted, so the run paused at it
            pause = body.pause = Pause(key, event[1], None, key[0].kind, 0, None, tensor, local)
            return pause
        self.finished = True
        if event.kind == "error":
            raise event.value
        raise passed_error(passed_message)

    def advance(self) -> None:
        """Resume the run with the bodies' replies until it pauses at a wanted key or ends."""
        event = self.transport.resume(self.bodies_reply())
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
                rows, tensor, local = body.wants
                body.pause = Pause(key, value, rows, kind, self.size, self.slices, tensor, local)
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
            body.pause = None
        if not self.finished:
            self.transport.abort()
            self.finished = True

    def close(self) -> None:
        for point in self.installed:
            point.remove()
        self.installed.clear()
        self.points.clear()
        # A closed session lets go of its bodies and its transport. Each links back here (a
        # body's trace holds this session; the run's function a backward block that holds it),
        # and a cycle would keep the trace's tensors alive until the cycle collector happens to
        # run. A request after close finds ``finished`` set first and raises before it could
        # use any of them.
        self.bodies = self.served = ()
        self.paused_value = self.paused_key = None
        self.transport = self.hand = None

    def _show(self, key, value):
        point = key[0]
        if isinstance(point, GradPoint):
            if point.split is None:
                return value, None
            whole, split = self.views.show_grad(point.split, value)
            return whole, ("grad", split)
        if all(b.wants[2] for b in self.bodies if b.pending == key):
            return value, None
        whole, token = self.views.show(point.kind, point.module, value, point.label)
        return whole, (None if token is None else ("value", token))

    def bodies_reply(self):
        if self.single_body:
            body = self.bodies[0]
            pause = body.pause
            if pause is None:
                return None
            body.pause = None
            return pause.reply()
        served = self.served
        if not served and self.paused_token is None:
            return None
        self.served = []
        if len(served) == 1 and self.paused_token is None:  # one body, whole value: common case
            body = served[0]
            pause = body.pause
            if pause.rows is None:
                body.pause = None
                self.paused_value = None
                return pause.reply()
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
        if all(b.pause.rows is None for b in served):
            replies = [r for r in (b.pause.reply() for b in served) if r is not None]
            reply = replies[-1] if replies else None  # whole values: the last writer wins
        else:
            pieces = [(b.pause.rows, b.pause.reply()) for b in served]
            reply = batching.merge(self.paused_value, pieces, self.size)
        for body in served:
            body.pause = None
        self.paused_value = None
        return reply
