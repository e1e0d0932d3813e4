"""The forward trace: ``with model.trace(inputs):`` and the object ``distgrad.wrap`` returns.

The body runs in place, in the caller's own frame; the model's forward runs as a coroutine of it
(``run.py``), advancing only as far as the body's next request. So a trace that asks for nothing
is one plain forward, and every value the body sees is the real tensor of the run.
"""
from __future__ import annotations

import sys

import greenlet
import torch

from . import batching, capture, engines, generator_body, patches, wrappers
from .config import config
from .envoy import Envoy
from .errors import OutOfOrderError, TraceStateError, drop_context, forget_frames
from .session import BODIES, UNSET, Body, Session, current_body


class Model(Envoy):
    """What ``distgrad.wrap`` returns: an Envoy of the root module that can open traces."""

    __slots__ = ("_engine", "_tokenizer", "_root")

    def __init__(self, engine: engines.Engine, tokenizer=None):
        super().__init__(engine.model, "model", engine=engine)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_tokenizer", tokenizer)
        # model.output is the output of whatever the engine calls (the wrapper, if any).
        root = self if engine.root is engine.model else Envoy(engine.root, "model", engine=engine)
        object.__setattr__(self, "_root", root)

    def trace(self, *args, **kwargs) -> "Trace":
        """Open a trace of one forward. Text is tokenized; tensors and dicts pass through.

        With no inputs, add them with ``tracer.invoke(...)`` blocks (one batch)."""
        return Trace(self, "forward", args, kwargs)

    def generate(self, *args, **kwargs) -> "Trace":
        """Trace ``module.generate(...)``: forward values only (generate runs without gradients)."""
        return Trace(self, "generate", args, kwargs)

    @property
    def output(self):
        """The output of the whole model's forward (of the engine's wrapper, if any)."""
        return Envoy.output.fget(self._root)

    @output.setter
    def output(self, value):
        Envoy.output.fset(self._root, value)

    @property
    def module(self) -> torch.nn.Module:
        return self._engine.model


class Trace:
    """One ``with model.trace(...):`` block: a forward whose values the body reads and edits.

    Returned by :meth:`Model.trace` and :meth:`Model.generate`; use it as a context manager and,
    for batched inputs, open :meth:`invoke` blocks inside it."""

    def __init__(self, model: Model, method: str, args: tuple, kwargs: dict):
        self.model = model
        self.engine = model._engine
        self.method = method
        self.raw_inputs = (args, kwargs)
        self.invokes: list = []
        self.body: Body | None = None
        self.forward: Session | None = None
        self.backward: Session | None = None  # the batch's backward, in a trace with invokes
        self.slices: dict = {}
        self.captured = None   # (code, names, frame): a body the engine runs per microbatch
        self.pipeline = None   # the engine's per-microbatch run while it runs
        self.generator = None  # the Plan of a body run as a generator (generator_body.py)
        self.frame = None      # the caller's frame, while the trace runs a body lifted out of it

    # -- the with-block -------------------------------------------------------------------
    def __enter__(self) -> "Trace":
        patches.keep_on_top()  # a library imported since may have replaced Tensor.backward
        self.body = Body(self)
        self._glet = greenlet.getcurrent()
        if self._glet in BODIES:
            raise TraceStateError("a trace is already open in this body; traces do not nest. "
                                  "Close the first `with model.trace(...)` block before opening another.")
        if self.engine.captures_body:
            # before anything is registered: if the body cannot be captured, __exit__ never
            # runs, and nothing may be left to make the next trace think this one is open
            frame = sys._getframe(1)
            code, names, first_line = capture.capture(frame, capture.PIPELINE_BODY)
            self.captured = (code, names, frame)
        elif (self.engine.generator_bodies and self.engine.views is None
              and _generator_bodies(self)):  # (views: values shown whole, the general path)
            frame = sys._getframe(1)
            plan = generator_body.plan_for(frame)
            if plan is not None and plan.allowed(frame.f_locals, frame):
                self.generator, self.frame = plan, frame
                first_line = plan.first_line
        BODIES[self._glet] = self.body
        self.engine.begin_trace()
        self.eager = wrappers.EAGER.enter()  # compiled code runs eager while traced (wrappers.py)
        if self.captured is not None:
            capture.skip(self.captured[2], first_line)
        elif self.generator is not None:
            capture.skip(self.frame, first_line)
        return self

    def __exit__(self, exc_type, exc, tb):
        skipped = exc_type is capture.SkipBody and (self.captured is not None
                                                    or self.generator is not None)
        if skipped:
            capture.resume_tracing(exc)
            skip, exc = exc, None  # the body was lifted out, to run per microbatch or as a generator
        elif exc is not None:
            forget_frames(exc)
        error = exc
        try:
            if exc is None:
                if self.captured is not None:
                    self.engine.run_captured(self, *self.captured)
                elif self.generator is not None:
                    self._run_generator()
                elif self.invokes:
                    from .invoke import run_invokes
                    run_invokes(self)
                else:
                    self.finish_forward()
        except BaseException as late:  # the rest of the forward failed: the engine must know
            error = late
            if skipped:  # raised while SkipBody was being handled: it is not the user's context
                drop_context(late, skip)
            forget_frames(late)
            raise
        finally:
            try:
                wrappers.EAGER.leave(self.eager)
                if self.forward is not None:
                    if not self.forward.finished:
                        self.forward.abort()
                    self.forward.close()
                BODIES.pop(self._glet, None)
                try:
                    instead = self.engine.end_trace(self.body.saves, error)
                finally:
                    self._release()
                if instead is not None:
                    raise instead from error
            finally:
                # This frame joins the traceback of whatever leaves it; locals that hold that
                # exception would make a cycle through it.
                error = exc = skip = tb = None
        return skipped

    def _release(self) -> None:
        """Let go of everything the trace ran with. The body, the sessions, the invokes and the
        caller's frame (kept to run a body later) all link back to this trace; left as they
        are, those cycles would keep every tensor of the step alive until the cycle collector
        runs, step after step (on a GPU, memory held across steps)."""
        self.body.trace = None
        self.body = None  # its saves too: they belong to the user now
        for invoke in self.invokes:
            if invoke.frame is not None:
                capture.release_locals(invoke.frame)
            invoke.frame = invoke.trace = None
        if self.frame is not None:
            capture.release_locals(self.frame)
        self.forward = self.backward = self.captured = self.frame = self.pipeline = None
        self._glet = None

    def _run_generator(self) -> None:
        """Run the skipped body as a generator (generator_run.py), then give its names back."""
        from .generator_run import GeneratorDriver
        plan, frame = self.generator, self.frame
        driver = GeneratorDriver(self.body)
        gen, out = generator_body.start(plan, frame, frame.f_locals, driver)
        driver.attach(gen)
        self.body.driver = driver
        try:
            driver.drive()
        finally:
            self.body.driver = None
            capture.write_back(frame, {name: out[name] for name in plan.names if name in out})
            out.clear()  # the body's locals() also hold this dict itself: a cycle
        self.finish_forward()

    def invoke(self, *args, **kwargs):
        """One input of a batched trace; see docs/concepts.rst ("Invokes")."""
        from .invoke import Invoke
        if self.raw_inputs[0] or self.raw_inputs[1]:
            raise TraceStateError("model.trace(inputs) already has inputs: either pass inputs to "
                                  "trace() or use tracer.invoke(...) blocks, not both.")
        if self.forward is not None:
            raise TraceStateError("tracer.invoke(...) must come before the body reads any value.")
        return Invoke(self, args, kwargs)

    # -- the forward ----------------------------------------------------------------------
    def forward_session(self, bodies: list[Body] | None = None, rows=None) -> Session:
        if self.forward is None:
            if self.invokes:
                raise TraceStateError("in a trace with invokes, read model values inside the "
                                      "`with tracer.invoke(...):` blocks.")
            args, kwargs = batching.prepare(*self.raw_inputs, self.model._tokenizer)
            self.forward = self.open_session([self.body], args, kwargs)
        return self.forward

    # -- invokes (invoke.py runs them) -------------------------------------------------------
    @property
    def loss(self):
        """Under a pipeline schedule: this microbatch's loss, as the schedule's ``loss_fn``
        computed it on the last stage; open the backward block on it."""
        if self.pipeline is None:
            raise TraceStateError("tracer.loss exists only in a pipeline trace; elsewhere compute "
                                  "the loss in the body (loss = model.output.logits.sum()).")
        return self.pipeline.loss(current_body())

    def invoke_backward(self, body, block):
        if self.pipeline is not None:
            return self.pipeline.backward_block(body, block)
        from .invoke import invoke_backward
        invoke_backward(self, body, block)

    def invoke_backward_done(self, body, block):
        if self.pipeline is not None:
            return None
        from .invoke import invoke_backward_done
        invoke_backward_done(self, body, block)

    def invoke_grad(self, body, tensor):
        if self.pipeline is not None:
            return self.pipeline.grad(body, tensor)
        from .invoke import invoke_grad
        return invoke_grad(self, body, tensor)

    def open_session(self, bodies, args, kwargs) -> Session:
        if not args and not kwargs:
            raise TraceStateError("model.trace() has no inputs: pass them to trace(...) or add "
                                  "`with tracer.invoke(...):` blocks.")
        call = self.engine.generate if self.method == "generate" else self.engine.forward
        size = batching.batch_size(args, kwargs) if bodies[0].rows is not None else 0
        if bodies[0].driver is not None:  # a body run as a generator
            from .generator_session import GeneratorSession
            return GeneratorSession("forward", lambda: call(args, kwargs), bodies,
                                    bodies[0].driver)
        return Session("forward", lambda: call(args, kwargs), bodies, size=size,
                       views=self.engine.views)

    def finish_forward(self) -> None:
        if self.forward is None and not self.invokes:
            self.forward_session()
        if self.forward is not None:
            self.forward.finish()

    def stop_at(self, body: Body, envoy: Envoy, kind: str):
        if self.pipeline is not None:
            return self.pipeline.module_value(body, envoy, kind)
        module, call = envoy._module, envoy._call
        session = self.forward if body.rows is not None else (self.forward or self.forward_session())
        if body.block is not None or (session is not None and session.finished):
            raise OutOfOrderError(
                f"{_plain_path(envoy)}.{kind} was requested after the forward had finished. Read "
                f"forward values before `with loss.backward():` and keep them in variables.")
        point = session.points.get((id(module), kind))
        if point is None:
            point = self._new_point(session, envoy, kind)
        if call is None:
            stop = body.stop
            if stop is not None and stop.key[0] is point:
                if stop.local != envoy._local:
                    path = point.path
                    raise TraceStateError(
                        f"{path}.{kind} and {path}.local.{kind} name one value in two forms "
                        f"(whole and this rank's shard); read one of them per call.")
                return stop  # the body is at this very call: read/write it again
            if session.solo:
                return session.request_solo(body, (point, point.calls), point.passed, None,
                                            envoy._local)
            call = point.calls
        elif call < point.calls and not (body.stop is not None and body.stop.key == (point, call)):
            raise OutOfOrderError(
                f"{point.path}.{kind} (call {call}) was requested after the run had already "
                f"passed it (the module has run {point.calls} time(s) since the trace first named "
                f"it). Name repeated modules before the forward reaches them.")
        return session.request(body, (point, call), point.passed, UNSET, None, envoy._local)

    def _new_point(self, session: Session, envoy: Envoy, kind: str):
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
            point = session.module_point(envoy._module, _plain_path(envoy), kind, new=True)
        # PyTorch decides at the start of a module's call whether to run its forward hooks; a
        # module with no hook then never sees one added mid-call. Giving every enclosing module
        # a (counting, silent) output point before the run enters it keeps `model.output` and
        # other enclosing outputs reachable later in the body. The walk stops at the first
        # ancestor already covered in this session.
        covered = session.covered
        if not covered:
            session.module_point(self.engine.root, "model", "output")
        outer = envoy._parent
        # by path, not module: a module reachable along two paths has two sets of ancestors
        while outer is not None and outer._path not in covered:
            covered.add(outer._path)
            if not isinstance(outer._module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                session.module_point(outer._module, outer._path, "output")
            outer = outer._parent
        return point


def _generator_bodies(trace: Trace) -> bool:
    """Whether this trace may run its body as a generator: a forward with inputs, with every
    hook on this thread (no accelerator), unless the user asked for bodies in place."""
    mode = config.body_mode
    if mode != "auto":
        if mode != "greenlet":
            raise ValueError(f"distgrad.config.body_mode must be 'auto' or 'greenlet', not "
                             f"{mode!r}.")
        return False
    return (trace.method == "forward" and bool(trace.raw_inputs[0] or trace.raw_inputs[1])
            and config.backward_mode != "thread" and not torch.cuda.is_initialized())


def _plain_path(envoy: Envoy) -> str:
    """The envoy's path without the ``.call(i)`` / ``.local`` it was addressed through."""
    path = envoy._path
    if envoy._call is not None:
        path = path.rsplit(".call(", 1)[0]
    if envoy._local and path.endswith(".local"):
        path = path[: -len(".local")]
    return path
