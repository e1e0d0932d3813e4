"""``ForwardRequests``: the requests of a trace body that runs in the caller's own frame.

The trace's one forward (and each backward block's backward) is a ``Session``: a run that
advances only as far as the body's next request, each value handed over at a hook by a
greenlet switch or, where hooks fire on other threads, a worker thread (``run.py``). The
invokes (``invoke.py``) build on this class.
"""

from __future__ import annotations

import torch

from ..errors import OutOfOrderError, TraceStateError, TraceUsageError
from . import batching
from .gradients import backward_threaded, close_session, grad_pause
from .requests import Requests
from .session import UNSET, Session


class ForwardRequests(Requests):
    """The requests of one trace's body, in place. ``trace``: the Trace (its inputs, its
    model); ``forward``: the forward's Session once the body has asked for a value."""

    mode = "in place"
    unscales = True
    invokes_refused = None
    session_type = Session  # what runs the forward and the backward (invokes: in_order.py)

    def __init__(self, trace):
        self.trace = trace
        self.engine = trace.engine
        self.forward: Session | None = None
        self.generated = UNSET  # what generate() returned, once it has (tracer.result)
        if trace.method == "generate":
            self.backward_refused = (
                "a backward block cannot be opened in a model.generate() trace: generate() runs "
                "under torch.no_grad(), so there is no graph. Use model.trace(...) for gradients."
            )

    # -- the forward ----------------------------------------------------------------------

    def forward_session(self) -> Session:
        if self.forward is None:
            trace = self.trace
            args, kwargs = batching.prepare(*trace.raw_inputs, trace.tokenizer, self.engine.model)
            self.forward = self.open_session([trace.body], args, kwargs)
        return self.forward

    def open_session(self, bodies, args, kwargs) -> Session:
        if not args and not kwargs:
            raise TraceUsageError(
                "model.trace() has no inputs: pass them to trace(...) or add "
                "`with tracer.invoke(...):` blocks."
            )
        size = batching.batch_size(args, kwargs) if bodies[0].rows is not None else 0
        return self.session_type(
            "forward", self.forward_call(args, kwargs), bodies, size=size, views=self.engine.views
        )

    def forward_call(self, args, kwargs):
        """The forward as a function of nothing: what the session runs."""
        if self.trace.method == "generate":
            engine = self.engine

            def generate():  # keeps the ids for tracer.result (the run hands on no return value)
                self.generated = engine.generate(args, kwargs)
                return self.generated

            return generate
        call = self.engine.forward
        return lambda: call(args, kwargs)

    def finish_forward(self) -> None:
        (self.forward or self.forward_session()).finish()

    def run_rest(self) -> None:
        self.finish_forward()

    def close(self) -> None:
        if self.forward is not None:
            if not self.forward.finished:
                self.forward.abort()
            self.forward.close()
        self.forward = self.trace = self.generated = None

    def result(self, body):
        """``tracer.result``: runs ``generate()`` to its end (the body's edits at the value it
        is paused at go back first), then hands over what it returned."""
        if self.trace.method != "generate":
            Requests.result(self, body)  # raises: a forward trace has model.output
        self.finish_forward()
        if self.generated is UNSET:  # (finish raises generate's own error, if any)
            raise TraceStateError("tracer.result: generate() did not return.")
        body.remember(self.generated, "tracer", ".result")
        return self.generated

    def run_ended(self) -> bool:
        return self.forward is not None and self.forward.finished

    def steps_made(self, module):
        model = self.engine.model
        if self.trace.method != "generate" or module is model or self.forward is None:
            return None
        # the model's output point, set by the first request before the run started (_new_point)
        point = self.forward.points.get((id(model), "output"))
        return None if point is None else point.calls

    def name_for_steps(self, envoy, kind: str) -> None:
        """In a ``generate`` trace, a module a ``tracer.iter`` loop names first counts its calls
        from the start of generation: its point, made now, starts at the steps the model has
        ended (one call a step; if the module already ran in the step under way, the check of
        ``steps.at_step`` finds its calls one step late and raises)."""
        model = self.engine.model
        if self.trace.method != "generate":
            return
        session = self.forward or self.forward_session()
        module = envoy._module
        if module is model or (id(module), kind) in session.points:
            return
        point = self._new_point(session, envoy, kind)
        point.calls = session.points[(id(model), "output")].calls

    # -- module values --------------------------------------------------------------------
    def module_value(self, body, envoy, kind: str):
        module, call = envoy._module, envoy._call
        session = self.forward or self.forward_session()
        if session.finished and self.trace.method == "generate":
            raise OutOfOrderError(
                f"{plain_path(envoy)}.{kind} was requested after generate() had finished "
                f"(tracer.result runs it to the end). Read module values before tracer.result."
            )
        if body.block is not None or session.finished:
            raise OutOfOrderError(
                f"{plain_path(envoy)}.{kind} was requested after the forward had finished. Read "
                f"forward values before `with loss.backward():` and keep them in variables."
            )
        point = session.points.get((id(module), kind))
        if point is None:
            point = self._new_point(session, envoy, kind)
        if call is None:
            pause = body.pause
            if pause is not None and pause.key[0] is point:
                if pause.local != envoy._local:
                    path = point.path
                    raise TraceStateError(
                        f"{path}.{kind} and {path}.local.{kind} name one value in two forms "
                        f"(whole and this rank's shard); read one of them per call."
                    )
                return pause  # the body is at this very call: read/write it again
            if session.single_body:
                return session.request_single(
                    body, (point, point.calls), point.passed, None, envoy._local
                )
            call = point.calls
        elif call < point.calls and not (
            body.pause is not None and body.pause.key == (point, call)
        ):
            raise OutOfOrderError(
                f"{point.path}.{kind} (call {call}) was requested after the run had already "
                f"passed it (the module has run {point.calls} time(s) since the trace first named "
                f"it). Name repeated modules before the forward reaches them."
            )
        return session.request(body, (point, call), point.passed, UNSET, None, envoy._local)

    def _new_point(self, session: Session, envoy, kind: str):
        kept = envoy._kept  # this envoy's points from earlier traces, by kind
        point = kept.get(kind) if kept is not None else None
        if point is not None and point.session is None:
            point.arm(session)
        elif envoy._call is None and not envoy._local:
            point = session.module_point(envoy._module, envoy._path, kind, new=True)
            if kept is None:
                object.__setattr__(envoy, "_kept", {kind: point})
            else:
                kept[kind] = point
        else:  # .call(i) and .local envoys are made per use: nothing to keep
            point = session.module_point(envoy._module, plain_path(envoy), kind, new=True)
        # PyTorch decides at the start of a module's call whether to run its forward hooks; a
        # module with no hook then never sees one added mid-call. Giving every enclosing module
        # a (counting, silent) output point before the run enters it keeps `model.output` and
        # other enclosing outputs reachable later in the body. The walk stops at the first
        # ancestor already watched in this session.
        watched = session.outputs_watched
        if not watched:
            session.module_point(self.engine.root, "model", "output")
            if self.trace.method == "generate":
                # generate() calls the model, not a wrapper around it (DDP's): the model's
                # calls are the steps a tracer.iter loop counts (steps.py)
                session.module_point(self.engine.model, "model", "output")
        outer = envoy._parent
        # by path, not module: a module reachable along two paths has two sets of ancestors
        while outer is not None and outer._path not in watched:
            watched.add(outer._path)
            if not isinstance(outer._module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                session.module_point(outer._module, outer._path, "output")
            outer = outer._parent
        return point

    # -- backward blocks ------------------------------------------------------------------
    def plain_backward(self, body, tensor) -> None:
        self.engine.plain_backward()  # (DDP counts the backwards over one forward)

    def backward_done(self, body, roots: list) -> None:
        self.engine.after_backward(roots)

    def open_backward(self, body, block) -> None:
        if block.backend is None:
            block.backend = self.engine
        self.finish_forward()
        block.session = self.backward_session(body, block)

    def backward_session(self, body, block) -> Session:
        return Session(
            "backward",
            block.run,
            [body],
            threaded=backward_threaded(block.tensor),
            views=self.engine.views,
            scale=block.scale,
        )

    grad = staticmethod(grad_pause)  # (a call layer less on the hottest path of a block)

    def close_backward(self, body, block, error) -> None:
        close_session(block.session, error)
        if error is None:  # the backward has run to its end
            self.engine.after_backward([block.tensor])


def plain_path(envoy) -> str:
    """The envoy's path without the ``.call(i)`` / ``.local`` it was addressed through."""
    path = envoy._path
    if envoy._call is not None:
        path = path.rsplit(".call(", 1)[0]
    if envoy._local and path.endswith(".local"):
        path = path[: -len(".local")]
    return path
