"""The forward trace: ``with model.trace(inputs):`` and the object ``distgrad.wrap`` returns.

The body runs in place, in the caller's own frame; the model's forward runs as a coroutine of
it (``interleave/transports.py``), advancing only as far as the body's next request. So a trace
that asks for nothing is one plain forward, and every value the body sees is the real tensor of
the run.
"""

from __future__ import annotations

import sys
import warnings

import greenlet
import torch

from . import capture, engines, patches, wrappers
from .envoy import Envoy
from .errors import StepsEnded, TraceStateError, TraceUsageError, drop_context, forget_frames
from .interleave import batching
from .interleave.forward_requests import ForwardRequests
from .interleave.invoke import Invoke, Invokes
from .interleave.requests import Requests
from .interleave.session import BODIES, Body, current_body
from .interleave.step import StepRequests
from .steps import Steps

_NO_TOKENIZER = (
    "model.tokenizer: this model was wrapped without one, and its module has none. Pass it "
    "when wrapping: model = distgrad.wrap(net, tokenizer=tokenizer)."
)


class Model(Envoy):
    """What ``distgrad.wrap`` returns: an Envoy of the root module that can open traces.

    A name the user's root module lacks is looked up on the engine's wrapper of it
    (``engine.root``: the ``DistributedDataParallel``, FSDP1 or DeepSpeed engine), so that
    ``model.no_sync()`` is the wrapper's own ``no_sync`` and ``accelerator.accumulate(model)``,
    which looks ``no_sync`` up on the model it is given, reaches it. The module's own names come
    first, and submodules below the root never fall back: their wrappers are internal."""

    __slots__ = ("_engine", "_tokenizer", "_root")

    def __init__(self, engine: engines.Engine, tokenizer=None):
        super().__init__(engine.model, "model", engine=engine)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_tokenizer", tokenizer)
        # model.output is the output of whatever the engine calls (the wrapper, if any).
        root = self if engine.root is engine.model else Envoy(engine.root, "model", engine=engine)
        object.__setattr__(self, "_root", root)

    def __getattr__(self, name: str):
        if name == "tokenizer":  # the property found none
            raise AttributeError(_NO_TOKENIZER)
        try:
            return Envoy.__getattr__(self, name)
        except AttributeError as missing:
            wrapper = self._engine.root
            # dunders stay the module's: copy and pickle protocols must not bind to the wrapper
            if wrapper is self._module or name.startswith("__"):
                raise
            try:
                value = getattr(wrapper, name)
            except AttributeError:
                raise AttributeError(
                    f"{missing} Neither has its wrapper ({type(wrapper).__name__})."
                ) from None
        if isinstance(value, torch.nn.Module):  # a module is always an envoy
            return self._forwarded(name, value)
        return value

    def trace(self, *args, **kwargs) -> Trace:
        """Open a trace of one forward. Text is tokenized; tensors and dicts pass through.

        With no inputs, add them with ``tracer.invoke(...)`` blocks (one batch)."""
        return Trace(self, "forward", args, kwargs)

    def trace_step(self, run, backward) -> Trace:
        """Open a trace over another library's training step (Hugging Face ``Trainer``:
        ``distgrad.trainer`` uses this). ``run()`` runs the step's forward and returns the loss
        it would backpropagate, without running the backward; ``backward(loss)`` runs that
        backward the library's own way. In the body ``tr.loss`` is the loss and
        ``with tr.loss.backward():`` runs ``backward(loss)``; a body that opens no block has it
        run when the body ends."""
        return Trace(self, "step", (), {}, step=(run, backward))

    def generate(self, *args, **kwargs) -> Trace:
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

    @property
    def tokenizer(self):
        """The tokenizer given to ``distgrad.wrap(..., tokenizer=...)``, which traces use for
        text (``model.tokenizer`` as on nnsight's ``LanguageModel``); without one, the
        module's own ``tokenizer`` attribute if it has one."""
        if self._tokenizer is not None:
            return self._tokenizer
        own = getattr(self._module, "tokenizer", None)
        if own is not None:
            return own
        # (raised by __getattr__, which Python calls when a property raises AttributeError)
        raise AttributeError(_NO_TOKENIZER)


def engine_of(model: Model) -> engines.Engine:
    """The engine ``model`` runs on, for tools built on distgrad (``distgrad.flow``) that need its
    ranks or its module tree outside a trace."""
    return model._engine


class Trace:
    """One ``with model.trace(...):`` block: a forward whose values the body reads and edits.

    Returned by :meth:`Model.trace` and :meth:`Model.generate`; use it as a context manager and,
    for batched inputs, open :meth:`invoke` blocks inside it. What serves the body's requests
    is chosen as the block opens (``requests``; see ``interleave/requests.py``)."""

    def __init__(
        self, model: Model, method: str, args: tuple, kwargs: dict, step: tuple | None = None
    ):
        self.model = model
        self.engine = model._engine
        self.tokenizer = model._tokenizer
        self.method = method
        self.raw_inputs = (args, kwargs)
        self.step = step  # trace_step's (run, backward), or None
        self.invokes: list = []
        self.body: Body | None = None
        self.requests = None  # what serves the body's requests while open (interleave/requests.py)
        self.mode = None  # how the body ran: "in place", "invokes", "per microbatch", ...
        self.frame = None  # the caller's frame, while the trace runs a body lifted out of it

    # -- the with-block -------------------------------------------------------------------
    def __enter__(self) -> Trace:
        patches.keep_on_top()  # a library imported since may have replaced Tensor.backward
        self._glet = greenlet.getcurrent()
        if self._glet in BODIES:
            raise TraceStateError(
                "a trace is already open in this body; traces do not nest. "
                "Close the first `with model.trace(...)` block before opening another."
            )
        skip_from = None
        if self.step is not None:
            if self.engine.captures_body:
                raise NotImplementedError(
                    f"model.trace_step(...): the {self.engine.name} engine runs the step itself "
                    f"(a pipeline schedule); trace it with model.trace(inputs)."
                )
            self.requests = StepRequests(self, *self.step)
        elif self.engine.captures_body:
            # before anything is registered: if the body cannot be captured, __exit__ never
            # runs, and nothing may be left to make the next trace think this one is open
            frame = sys._getframe(1)
            code, names, skip_from = capture.capture(frame, capture.PIPELINE_BODY)
            self.requests, self.frame = PerMicrobatch(self, code, names, frame), frame
        if self.requests is None:
            self.requests = ForwardRequests(self)
        self.body = Body(self.requests)
        self.mode = self.requests.mode
        BODIES[self._glet] = self.body
        self.engine.begin_trace()
        self.eager = wrappers.EAGER.enter()  # compiled code runs eager while traced (wrappers.py)
        if skip_from is not None:
            capture.skip(self.frame, skip_from)
        return self

    def __exit__(self, exc_type, exc, tb):
        skipped = exc_type is capture.SkipBody and self.frame is not None
        ended = exc_type is StepsEnded  # a tracer.iter loop outran the run: the body ends here
        if ended:
            warnings.warn(str(exc), stacklevel=2)
            exc = None
        elif skipped:
            capture.resume_tracing(exc)
            skip, exc = exc, None  # the body was lifted out, to run per microbatch
        elif exc is not None:
            forget_frames(exc)
        error = exc
        try:
            if exc is None:
                self.requests.run_rest()
        except BaseException as late:  # the rest of the forward failed: the engine must know
            error = late
            if skipped:  # raised while SkipBody was being handled: it is not the user's context
                drop_context(late, skip)
            forget_frames(late)
            raise
        finally:
            try:
                wrappers.EAGER.leave(self.eager)
                self.requests.close()
                BODIES.pop(self._glet, None)
                # the objects given .save() are of their own class again before the engine
                # gathers the saves (a gather may rebuild one from its class)
                self.body.release_held()
                try:
                    instead = self.engine.end_trace(self.body.saves, error)
                finally:
                    self._release()
                if instead is not None:
                    raise instead from error
            finally:
                # This frame joins the traceback of whatever leaves it; locals that hold that
                # exception would make a cycle through it.
                error = exc = skip = tb = None  # noqa: F841
        return skipped or ended

    def _release(self) -> None:
        """Let go of everything the trace ran with. The body, the requests, the invokes and
        the caller's frame (kept to run a body later) all link back to this trace; left as
        they are, those cycles would keep every tensor of the step alive until the cycle
        collector runs, step after step (on a GPU, memory held across steps)."""
        self.body.requests = None
        self.body = None  # its saves too: they belong to the user now
        for invoke in self.invokes:
            if invoke.frame is not None:
                capture.release_locals(invoke.frame)
            invoke.frame = invoke.trace = invoke.space = None
        if self.frame is not None:
            capture.release_locals(self.frame)
        self.requests = self.frame = self._glet = self.step = None

    def has_inputs(self) -> bool:
        """Whether the trace was given model inputs, not only options of the call
        (``model.generate(max_new_tokens=3)`` has none: its invokes give them)."""
        args, kwargs = self.raw_inputs
        return bool(args) or any(batching.is_input(k, v) for k, v in kwargs.items())

    def invoke(self, *args, **kwargs):
        """One input of a batched trace; with no arguments, a body over the whole batch. See
        docs/concepts.rst ("Invokes")."""
        body = current_body()
        if body is not None and body.index is not None:  # run by the scheduler: an invoke's
            raise TraceUsageError(
                f"tracer.invoke(...) was opened inside the body of invoke {body.index}: an "
                f"invoke cannot be opened inside another invoke's body. Close the first "
                f"`with tracer.invoke(...):` block before opening the next, each directly in "
                f"the trace's body."
            )
        if (args or kwargs) and self.has_inputs():
            raise TraceUsageError(
                "model.trace(inputs) already has inputs: either pass inputs to trace() or to "
                "tracer.invoke(...) blocks, not both. (An empty tracer.invoke() in it sees "
                "the trace's whole batch.)"
            )
        refused = self.requests.invokes_refused
        if refused:
            raise TraceStateError(refused)
        if not self.invokes:  # the invokes serve the bodies from now on
            if self.requests.forward is not None:
                raise TraceUsageError(
                    "tracer.invoke(...) must come before the body reads any "
                    "value: the forward has started on no inputs. Open the "
                    "invokes first and read values inside them."
                )
            self.requests = self.body.requests = Invokes(self)
            self.mode = self.requests.mode
        return Invoke(self, args, kwargs)

    @property
    def iter(self) -> Steps:
        """nnsight's loop over the steps of the run: ``for step in tracer.iter[1:3]:`` reads
        each module's value at those steps (``steps.py``; docs/nnsight.rst)."""
        return Steps()

    def all(self) -> Steps:
        """Every step: ``tracer.iter[:]``."""
        return Steps()[:]

    def next(self, *args, **kwargs):
        raise AttributeError(
            "tracer.next(): nnsight 0.8.1 has no next() either; loop over the steps with "
            "`for step in tracer.iter[...]:` (or tracer.all()), or name a module's i-th call "
            "with model.<module>.call(i)."
        )

    @property
    def result(self):
        """In ``with model.generate(...) as tracer:``, what ``generate()`` returned (the
        generated ids). Reading it runs generation to its end, so read module values before
        it; ``.save()`` it to keep it after the block (``ids = tracer.result.save()``)."""
        body = current_body()
        requests = body.requests if body is not None else None
        requests = getattr(requests, "inner", requests)  # (in a tracer.iter loop: steps.py)
        if requests is None or self.requests is None or requests is not self.requests:
            raise TraceStateError(
                "tracer.result was read outside the body of its trace: it is served inside "
                "`with model.generate(...) as tracer:`, once generate() has returned. Save it "
                "there to keep it: ids = tracer.result.save()."
            )
        return self.requests.result(body)

    @property
    def loss(self):
        """Under a pipeline schedule: this microbatch's loss, as the schedule's ``loss_fn``
        computed it on the last stage; in ``model.trace_step``: the step's loss. Open the
        backward block on it."""
        body = current_body()
        requests = body.requests if body is not None else None
        return (requests or Requests()).loss(body)


class PerMicrobatch(Requests):
    """The requests of a trace whose body the engine runs itself, once per microbatch (a
    pipeline schedule): the engine's own object serves those bodies (``Engine.run_captured``)."""

    mode = "per microbatch"

    def __init__(self, trace: Trace, code, names, frame):
        self.trace, self.engine, self.body = trace, trace.engine, (code, names, frame)

    def run_rest(self) -> None:
        self.engine.run_captured(self.trace, *self.body)

    def close(self) -> None:
        self.trace = self.body = None
