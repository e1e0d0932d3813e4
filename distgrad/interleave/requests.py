"""The one seam between a with-block body and the run that answers it.

A body asks for seven things: a module's value (``.output``, ``.input``, ``.inputs``), opening
a backward block, a tensor's gradient inside it (``.grad``, read or assigned), closing the block,
under a pipeline schedule the microbatch's loss (``tr.loss``), in a generate trace what
``generate()`` returned (``tracer.result``), and it tells of a plain ``loss.backward()`` call
about to run. Every ``Body`` holds the object that serves it (``Body.requests``); the envoy, the
backward block, ``Tensor.backward`` and the ``.grad`` property call that object and nothing
else. Which kind of trace this is - a body in place, a
batch of invokes, a pipeline step - is decided once, when the trace
opens (``Trace.__enter__``), by choosing the object; no caller tests it again.

The objects, from the simplest:

* ``NoTraceRequests`` (``backward.py``): a backward block opened outside any trace; it serves
  gradients only.
* ``ForwardRequests`` (``forward_requests.py``): the trace body in the caller's frame over one
  forward, each value handed over by a greenlet or a worker thread (``session.py``,
  ``transports.py``).
* ``Invokes`` (``invoke.py``): several bodies over one batch, served in invoke order.
* ``StepRequests`` (``step.py``): a body over another library's training step
  (``model.trace_step``), whose loss and backward are the library's.
* ``BodyRequests`` (``engines/pipeline/body_requests.py``): one body per microbatch of a pipeline
  schedule, values of other ranks' stages received.
"""

from __future__ import annotations

from ..errors import TraceStateError, TraceUsageError


class Requests:
    """What serves one trace's bodies. Subclasses override what their trace can serve; the
    defaults here refuse, each with the error a user of that trace needs.

    Methods (``body``: the asking ``session.Body``):

    * ``module_value(body, envoy, kind)``: the ``Pause`` at ``envoy``'s module value, ``kind``
      "output" or "input"; the body reads ``pause.view`` and assigns through ``pause.replace``.
    * ``open_backward(body, block)``: ``with loss.backward():`` opens (``block``: the
      ``BackwardTracer``); returns once gradients can be asked for.
    * ``grad(body, tensor)``: the ``Pause`` at the gradient flowing into ``tensor``, inside the
      body's open block.
    * ``close_backward(body, block, error)``: the block ends, ``error`` the exception leaving
      it or None.
    * ``plain_backward(body, tensor)``: ``tensor.backward()`` is called in the body as a
      plain call, not a block; it runs right after this returns (PyTorch's own backward).
      ``torch.autograd.backward`` and ``torch.autograd.grad`` in an invoke body call it too.
    * ``backward_done(body, roots)``: that plain backward of the tensors ``roots`` (a list)
      has finished; the engine hears of it (``Engine.after_backward``).
    * ``grad_inputs(body, inputs)``: ``torch.autograd.grad(..., inputs)`` in the body: the
      tensors to differentiate instead, and for each result the rows that are the body's
      (``(inputs, None)``: differentiate ``inputs`` themselves).
    * ``loss(body)``: ``tr.loss``, the microbatch's loss under a pipeline schedule.
    * ``result(body)``: ``tracer.result``, what ``generate()`` returned, once it has returned.
    * ``run_rest()``: the body has ended; run what is left of the trace.
    * ``close()``: the trace ends (normally or not): end the runs still open.

    Attributes: ``mode``, how the bodies run, in words (``Trace.mode`` shows it); ``engine``,
    the engine the trace runs on (None outside a trace); ``backward_refused``, the message a
    backward block opened in this trace raises, or None; ``unscales``, whether a block's
    ``scaler=`` is served (its session is built with ``scale=``: ``scaling.py``).
    """

    mode = "outside a trace"
    engine = None
    backward_refused = None
    unscales = False
    invokes_refused = (
        "tracer.invoke(...) splits the batch of a trace run in place; under a "
        "pipeline schedule the schedule splits it into microbatches: pass the "
        "whole batch to model.trace(...)."
    )

    def module_value(self, body, envoy, kind: str):
        raise TraceUsageError(
            f"{envoy._path}.{kind} can only be used inside `with model.trace(...):`."
        )

    def open_backward(self, body, block) -> None:
        raise NotImplementedError(f"{type(self).__name__} serves no backward block.")

    def grad(self, body, tensor):
        raise NotImplementedError(f"{type(self).__name__} serves no gradient.")

    def close_backward(self, body, block, error) -> None:
        return None

    def plain_backward(self, body, tensor) -> None:
        return None

    def backward_done(self, body, roots: list) -> None:
        return None

    def grad_inputs(self, body, inputs: list) -> tuple[list, list | None]:
        return inputs, None

    def loss(self, body):
        raise TraceStateError(
            "tracer.loss exists only in a pipeline trace; elsewhere compute "
            "the loss in the body (loss = model.output.logits.sum())."
        )

    def result(self, body):
        raise TraceStateError(
            "tracer.result is what generate() returned: read it in the body "
            "of `with model.generate(...) as tracer:`; in model.trace(...) "
            "read model.output."
        )

    def name_for_steps(self, envoy, kind: str) -> None:
        """A ``tracer.iter`` loop names ``envoy``'s module (``steps.py``): where steps are
        counted, let its calls count from the start of the run."""
        return None

    def run_ended(self) -> bool:
        """Whether the run the body's module values come from has ended (``steps.py``)."""
        return False

    def steps_made(self, module):
        """In a ``generate`` trace, the calls of the model that have ended, so the step the
        run is in when ``module`` (not the model) is served; None where steps are not counted."""
        return None

    def run_rest(self) -> None:
        return None

    def close(self) -> None:
        return None
