"""A trace body run as a generator that the run's own hooks resume, with no stack switching.

The greenlet design (``interleave/run.py``) pauses the model's run in a second greenlet and
switches stacks twice per value the body asks for. ``benchmarks/marginal.py`` measures that switching alone
at about what a read+edit may cost in all (``docs/performance.md``). So where a body
allows it (``survey.py`` decides; ``rewrite.py`` rewrites each ``.output`` /
``.grad`` into a ``yield``), the roles turn round: the trace calls the forward (and later the
backward) itself, on its own stack, and the hook that produces a wanted value resumes the body
in place with ``gen.send(value)`` (``session.py``). The body runs until it asks for its
next value and yields; the hook returns what the body put at its stop, and the run goes on.

The protocol with the body, in three marks:

* a request the run cannot serve yet returns ``PAUSED`` (the general path returns
  ``PAUSE_STOP``, whose view it is), which the rewritten body yields. ``driver.waiting`` is the
  session whose value it waits for: that session's one wanted key, or for a gradient its one
  installed gradient hook (``session.want_hooks``);
* ``leave()``: the body needs the run it is inside to finish (before a backward block opens, and
  when one closes). The hook returns and the run goes on to its end;
* the body's end, or its exception. An exception inside a hook unwinds the run with ``Abort``
  and is raised again from the trace, with the body's own lines in its traceback.

``PAUSED`` is poisoned: code that was not rewritten (a helper function the body calls) that gets
it fails at its first use, with a message that says what to do.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import partial

import greenlet
import torch
from torch.utils.hooks import RemovableHandle

from .. import capture
from ..envoy import Envoy
from ..errors import TraceStateError, check_replacement_grad
from ..gradpatch import served
from ..interleave.gradients import grad_passed, grad_stop
from ..interleave.in_place import InPlace
from ..interleave.paused import FAST_PATH_HELP, LEAVE, PAUSE_STOP, PAUSED
from ..interleave.session import UNSET, passed_error
from . import rewrite
from .session import GeneratorSession

_getcurrent = greenlet.getcurrent
_Tensor = torch.Tensor
_GRAD_KEY = (None, None)  # a gradient stop's key: driver.grad's stops need none


class GeneratorDriver(InPlace):
    """The requests of a trace body run as a generator: runs the body's generator, starting
    the runs it waits for (``GeneratorSession``: called on this stack) and resuming it after
    each. ``plan``: the rewritten body (``rewrite.Plan``); ``body``: the trace's Body,
    once the body runs."""

    mode = "generator"

    def __init__(self, trace, plan):
        super().__init__(trace)
        self.plan = plan
        self.body = None
        self.gen = self.send = None
        self.glet = _getcurrent()
        self.inside = None    # the session whose run is on the stack, if any
        self.waiting = None   # the session whose next value the body waits for, LEAVE or None
        self.passed = None    # words the error if that session's run ends first
        self.reply = None     # for the hook the body is leaving
        self.ended = False
        self.error = None     # the body's exception, when it ended the body inside a run

    def attach(self, gen) -> None:
        self.gen = gen
        self.send = gen.send

    def leave_stop(self, asking: bool) -> None:
        """The body leaves its stop: keep what it put there for the hook to return. ``asking``:
        for a new request, which is refused if the last one never reached the body's yield."""
        if asking and self.waiting is not None:
            self.waiting = None
            raise TraceStateError(FAST_PATH_HELP)
        body = self.body
        stop = body.stop
        if stop is not None:
            body.stop = None
            self.reply = stop.reply()

    # -- what the rewritten body calls --------------------------------------------------
    # output and grad are the body's reads with the common case written out: the request, and
    # leaving the stop the body was at, inline (a call layer costs far more than its
    # bytecodes suggest, and these run once per value). Anything else, errors included, goes
    # through the property, which does the same in general.
    def read_output(self, envoy):
        """``envoy.output`` in the body: a plain envoy whose point is kept between traces."""
        if envoy.__class__ is not Envoy:
            return envoy.output
        body = self.body
        session = self.forward
        if session is None or session.finished or body.block is not None:
            return envoy.output
        # The point this envoy keeps between traces (Trace._new_point made it), if this session
        # armed it or may arm it now; any other case takes the property. (`.call(i)` and
        # `.local` envoys keep no point.)
        kept = envoy._kept
        point = kept.get("output") if kept is not None else None
        if point is None:
            return envoy.output
        stop = body.stop
        armed = point.session
        if armed is None:  # Trace._new_point's common case: arm the kept point
            covered = session.covered
            parent = envoy._parent
            if (not covered or (parent is not None and parent._path not in covered)
                    or point.key in session.points):  # another envoy's point has the module
                return envoy.output
            point.arm(session)
        elif armed is not session:
            return envoy.output
        elif stop is not None and stop.key[0] is point:  # at it already
            if stop.local:
                return envoy.output  # raises: one value asked for in two forms
            value = stop.replacement
            return stop.view if value is UNSET else value
        if self.waiting is not None:  # the last request never reached the body's yield
            self.waiting = None
            raise TraceStateError(FAST_PATH_HELP)
        if stop is not None:  # leave it: the hook returns what the body put there
            body.stop = None
            reply = stop.replacement
            if reply is UNSET:
                reply = stop.edited() if stop.tensor is not None else None
            self.reply = reply
        key = (point, point.calls)
        session.wanted[key] = 1
        stop = session.spare
        stop.key = key
        stop.tensor = None
        stop.local = False
        stop.replacement = UNSET
        self.waiting = session
        self.passed = point.passed
        return PAUSED

    def read_grad(self, tensor):
        """``tensor.grad`` in the body: at that gradient, or a graph tensor in an open block.
        Waiting for a gradient takes a one-shot tensor hook (``session.grad_ready``), not a
        GradPoint: a tensor's gradient arrives once per backward, so it needs no call count."""
        body = self.body
        stop = body.stop
        if stop is not None and stop.tensor is tensor:
            value = stop.replacement
            return stop.view if value is UNSET else value
        block = body.block
        if (tensor.__class__ is not _Tensor or block is None or tensor.retains_grad
                or not tensor.requires_grad):
            return tensor.grad
        session = block.session
        if session is None or session.finished:
            return tensor.grad
        if self.waiting is not None:
            self.waiting = None
            raise TraceStateError(FAST_PATH_HELP)
        if stop is not None:
            body.stop = None
            reply = stop.replacement
            if reply is UNSET:
                reply = stop.edited() if stop.tensor is not None else None
            self.reply = reply
        # torch_internals.add_tensor_hook written out: a call here would cost every .grad read
        hooks = tensor._backward_hooks
        if hooks is None:
            hooks = tensor._backward_hooks = OrderedDict()
            if tensor.grad_fn is not None:
                tensor.grad_fn._register_hook_dict(tensor)
        hid = RemovableHandle.next_id
        RemovableHandle.next_id = hid + 1
        hooks[hid] = session.grad_ready
        session.want_hooks = hooks
        session.want_hid = hid
        stop = session.spare
        stop.key = _GRAD_KEY
        stop.tensor = tensor
        stop.replacement = UNSET
        self.waiting = session
        # (a partial, not a lambda: a closure would make cells of three locals on every call)
        self.passed = partial(grad_passed, block.tensor, tensor, body)
        return PAUSED

    def save(self, obj):
        """``obj.save()`` in the body (Tensor.save's common case, written out)."""
        if obj.__class__ is _Tensor:
            self.body.saves.append((obj, "rank0", 0))
            return obj
        return obj.save()

    def set_grad(self, stop, tensor, value) -> None:
        """``tensor.grad = value`` in the body while the body is at that gradient."""
        old = stop.view
        if not (value.__class__ is _Tensor and value.shape == old.shape
                and value.dtype == old.dtype and value.device == old.device):
            check_replacement_grad(lambda: self.body.label_of(tensor) + ".grad", old, value)
        stop.replacement = value

    def leave(self):
        """Before a backward block opens and when it closes: if the body is inside a run, let
        that run finish first (the body yields what this returns)."""
        if self.inside is None:
            return None
        self.leave_stop(False)
        self.waiting = LEAVE
        return LEAVE

    def ready(self, obj, attr: str):
        """Before ``obj.<attr> = value``: stop the run at ``obj``'s value first, so that the
        assignment itself needs no pause. Returns what the body must yield, or None."""
        body = self.body
        stop = body.stop
        if stop is not None and stop.tensor is obj:  # `t.grad = t.grad * 2`: at it already
            return None
        if attr == "grad":
            if not isinstance(obj, _Tensor) or body.block is None:
                return None
            if not (served(obj) and obj.requires_grad):
                return None
            return PAUSED if grad_stop(body, obj) is PAUSE_STOP else None
        if not isinstance(obj, Envoy):
            return None
        return PAUSED if getattr(obj, attr) is PAUSED else None

    # -- the trace side -----------------------------------------------------------------
    def open_session(self, bodies, args, kwargs):
        if self.gen is None:  # after the body (it asked for nothing): a plain forward
            return super().open_session(bodies, args, kwargs)
        return GeneratorSession("forward", self.forward_call(args, kwargs), bodies, self)

    def backward_session(self, body, block):
        return GeneratorSession("backward", block.run, [body], self)

    def run_rest(self) -> None:
        """Run the skipped body as a generator, give its names back, finish the forward."""
        plan, frame = self.plan, self.trace.frame
        self.body = self.trace.body
        gen, out = rewrite.start(plan, frame, frame.f_locals, self)
        self.attach(gen)
        try:
            self.drive()
        finally:
            capture.write_back(frame, {name: out[name] for name in plan.names if name in out})
            out.clear()  # the body's locals() also hold this dict itself: a cycle
        self.finish_forward()

    def close(self) -> None:
        super().close()
        self.body = self.plan = None

    def drive(self) -> None:
        """Run the body to its end, starting each run it waits for."""
        try:
            self._step(self.send, None)
            while not self.ended:
                waiting = self.waiting
                if waiting is None or waiting is LEAVE:
                    raise TraceStateError(FAST_PATH_HELP)
                session = waiting
                event = session.resume(None)
                session.finished = True
                self._after(session, event)
        finally:
            if not self.ended:  # unwind the body's own with-blocks (a backward block aborts)
                self.ended = True
                self.gen.close()
            self.gen = self.send = None

    def _after(self, session, event) -> None:
        if event.kind == "aborted":
            error, self.error = self.error, None  # held here, it would be a cycle through its frames
            raise error
        if self.ended:
            if event.kind == "error":
                raise event.value
            return
        waiting = self.waiting
        if waiting is LEAVE:
            self.waiting = None
            if event.kind == "error":
                self._step(self.gen.throw, event.value)
            else:
                self._step(self.send, None)
        elif waiting is session:  # the run ended before the key the body waits for
            self.waiting = None
            session.wanted.clear()
            session.drop_want()
            self._step(self.gen.throw,
                       event.value if event.kind == "error" else passed_error(self.passed))
        elif event.kind == "error":
            raise event.value

    def _step(self, how, arg) -> None:
        try:
            how(arg)
        except StopIteration:
            self.mark_ended()

    def mark_ended(self) -> None:
        self.ended = True
        self.waiting = None
        self.leave_stop(False)

