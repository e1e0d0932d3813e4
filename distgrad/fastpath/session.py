"""The runs and sessions of a trace body run as a generator (``driver.py`` drives it).

A ``GeneratorRun`` is a forward or backward that the driver calls on its own stack; a
``GeneratorSession`` is its solo session, whose hooks hand each wanted value to the body by
resuming its generator in place (``driver.send``) and return what the body put there.
"""
from __future__ import annotations

import greenlet
import torch

from ..errors import TraceStateError
from ..interleave.paused import FAST_PATH_HELP, PAUSE_STOP
from ..interleave.run import Abort, Outcome, outcome_of
from ..interleave.session import BODIES, UNSET, Session, passed_error

_getcurrent = greenlet.getcurrent
_Tensor = torch.Tensor
_OTHER_THREAD = ("distgrad: a hook fired on another thread or greenlet than the trace's. Set "
                 "distgrad.config.body_mode = 'greenlet' (and, for an accelerator, "
                 "backward_mode = 'thread').")


class GeneratorRun:
    """A forward or backward that the driver calls on its own stack (``resume`` runs it to the
    end); hooks resume the body inside it through ``GeneratorSession.hand``."""

    def __init__(self, fn, driver, session):
        self.fn = fn
        self.driver = driver
        self.session = session
        self.running = False
        self.finished = False
        self.close_later = False

    def resume(self, reply=None) -> Outcome:
        if self.running or self.finished:
            raise TraceStateError(f"distgrad: the {self.session.kind} was asked to run again "
                                  f"while it runs. {FAST_PATH_HELP}")
        driver = self.driver
        self.running = True
        outer, driver.inside = driver.inside, self.session
        glet = driver.glet
        body = BODIES.pop(glet, None)  # the run's other hooks (a library's) see no body
        try:
            event = outcome_of(self.fn)  # an error is handed to the body, as a greenlet run does
        finally:
            self.running = False
            self.finished = True
            driver.inside = outer
            if body is not None:
                BODIES[glet] = body
            if self.close_later:  # the body closed the session while its run was on the stack
                self.close_later = False
                self.session.close()
        return event

    def abort(self) -> None:
        # A run on the stack unwinds by itself: the body's exception leaves the hook as Abort.
        self.finished = True


class GeneratorSession(Session):
    """A solo session whose body is a generator: requests pause by returning ``PAUSE_STOP``."""

    def __init__(self, kind: str, fn, bodies: list, driver):
        super().__init__(kind, fn, bodies)
        self.driver = driver
        self.body = driver.body  # the driver's, kept here too: the hand-offs run per value
        self.glet = driver.glet
        # The one gradient hook the body waits for (driver.grad installs it): its hook dict and
        # id. Only one is ever installed, so the hook needs no id check and removes itself.
        self.want_hooks = None
        self.want_hid = None
        self.grad_ready = self._grad_ready  # the bound method, made once
        self.run = GeneratorRun(fn, driver, self)
        self.resume = self.run.resume
        # A forward's points hand module values; a backward's (GradPoints, rare here: most
        # gradients come through grad_ready) hand gradients.
        self.hand = self._hand_value if kind == "forward" else self._hand

    def request_solo(self, body, key, passed_message, tensor=None, local=False):
        if self.finished:
            raise passed_error(passed_message)
        driver = self.driver
        driver.leave_stop(True)
        self.wanted[key] = 1
        # The body is done with the spare Stop (its reply is taken): fill it for the value to come.
        stop = self.spare
        stop.key = key
        stop.tensor = tensor
        stop.local = local
        stop.replacement = UNSET
        driver.waiting = self
        driver.passed = passed_message
        return PAUSE_STOP

    def drop_want(self) -> None:
        """Remove the gradient hook the body waited for, if it never fired."""
        hooks = self.want_hooks
        if hooks is not None:
            self.want_hooks = None
            hooks.pop(self.want_hid, None)

    # _hand_value and _grad_ready resume the body (``driver.send``) and return what it put at
    # its stop. Each is written out in full: together they run twice per read+edit, and a
    # call layer costs far more than its bytecodes suggest. _hand, the rare general case,
    # reuses them.
    def _hand(self, key, value):
        """A point's hand-off: a module value (the forward's points), or a GradPoint's gradient
        (a backward's, for the requests driver.grad does not take, e.g. ``t.grad = g`` before
        the body is at t's gradient)."""
        if self.spare.tensor is None:
            return self._hand_value(key, value)
        del self.wanted[key]
        self.want_hooks = {}  # nothing for _grad_ready to remove: the GradPoint goes at close
        return self._grad_ready(value)

    def _hand_value(self, key, value):
        """_hand for a forward's module point."""
        glet = self.glet
        if _getcurrent() is not glet:
            raise RuntimeError(_OTHER_THREAD)
        driver = self.driver
        driver.waiting = None
        del self.wanted[key]
        body = self.body
        if value.__class__ is _Tensor:  # named for error messages
            point = key[0]
            body.labels[id(value)] = (value, point.path, point.suffix)
        stop = self.spare
        stop.view = value
        body.stop = stop
        BODIES[glet] = body  # while the body runs (not while the run does: see GeneratorRun)
        try:
            driver.send(value)
        except StopIteration:
            driver.mark_ended()
        except BaseException as exc:
            driver.ended = True
            driver.error = exc
            raise Abort() from None
        finally:
            del BODIES[glet]
        reply = driver.reply
        driver.reply = None
        return reply

    def _grad_ready(self, grad):
        """The hook driver.grad installs on the tensor whose gradient the body waits for."""
        glet = self.glet
        if _getcurrent() is not glet:
            raise RuntimeError(_OTHER_THREAD)
        hooks = self.want_hooks
        if hooks is None:  # not waited for any more
            return None
        hooks.pop(self.want_hid, None)  # one-shot (PyTorch iterates over a copy of the hooks)
        self.want_hooks = None
        driver = self.driver
        driver.waiting = None
        value = grad.clone()  # the body's own copy (see Stop)
        stop = self.spare
        # torch_internals.version, inline: this runs for every gradient read
        stop.version = value._version
        stop.view = value
        body = self.body
        body.stop = stop
        BODIES[glet] = body
        try:
            driver.send(value)
        except StopIteration:
            driver.mark_ended()
        except BaseException as exc:
            driver.ended = True
            driver.error = exc
            raise Abort() from None
        finally:
            del BODIES[glet]
        reply = driver.reply
        driver.reply = None
        return reply

    def close(self) -> None:
        if self.run.running:
            self.run.close_later = True
            return
        self.drop_want()
        super().close()
        self.driver = self.body = self.grad_ready = None  # see Session.close
