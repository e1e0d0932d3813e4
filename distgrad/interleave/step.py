"""``StepRequests``: the requests of a trace over another library's training step
(``model.trace_step(run, backward)``), such as Hugging Face ``Trainer.training_step``.

The library keeps its own step: ``run()`` does its forward and computes its loss its own way
(loss arguments, label smoothing, division for gradient accumulation) and hands that loss back
instead of running the backward; ``backward(loss)`` runs the backward the library would have
run (``accelerator.backward(loss, ...)``). The body reads and edits module values as ``run()``
goes, sees the loss as ``tr.loss``, and opens its backward block on it: the block's run is
``backward(loss)``. A body that opens no block gets the backward after it ends, so the step is
the library's either way, exactly once.
"""

from __future__ import annotations

from ..errors import TraceStateError
from .forward_requests import ForwardRequests
from .session import UNSET, Session


class StepRequests(ForwardRequests):
    """``run`` and ``backward``: the step's two halves (above). ``loss``: what ``run()``
    returned, once it has; ``backward_ran``: whether ``backward`` has been called."""

    mode = "over a training step"
    unscales = False  # the step's own backward scales the loss as the library configured
    invokes_refused = (
        "tracer.invoke(...) splits a batch, but a traced training step runs on "
        "the batch its library gave it: read the values of the whole batch."
    )

    def __init__(self, trace, run, backward):
        super().__init__(trace)
        self.run, self.step_backward = run, backward
        self.loss_value = UNSET
        self.backward_ran = False

    def forward_session(self) -> Session:
        if self.forward is None:
            self.forward = Session("forward", self._run, [self.trace.body], views=self.engine.views)
        return self.forward

    def _run(self):
        self.loss_value = self.run()

    def _loss(self):
        self.finish_forward()
        loss = self.loss_value
        if loss is UNSET or loss is None:
            raise TraceStateError(
                "the traced training step ended without handing over its loss (its run() "
                "returned None): the step's backward cannot be run."
            )
        return loss

    def loss(self, body):
        """``tr.loss``: the step's loss as the library will backpropagate it. Runs the rest
        of the step's forward (read module values before it)."""
        loss = self._loss()
        body.remember(loss, "tracer", ".loss")
        return loss

    def open_backward(self, body, block) -> None:
        loss = self._loss()
        if block.loss is not loss:
            raise TraceStateError(
                f"in a traced training step the backward is the step's own "
                f"({_name(self.step_backward)}), run once on its loss; a block on "
                f"{body.label_of(block.loss)} would run a second one. Open it on the step's "
                f"loss: `with tr.loss.backward():`."
            )
        if block.args or block.kwargs:
            raise TraceStateError(
                "`with tr.loss.backward(...)`: the step runs its backward with its own "
                "arguments; open the block without any."
            )
        if self.backward_ran:
            raise TraceStateError(
                "the training step's backward has already run: open one backward block per step."
            )
        block.backend = self
        super().open_backward(body, block)

    def backward(self, tensor, fn, args, kwargs):
        """A block's run (the block's ``backend``): the step's own backward."""
        self.backward_ran = True
        return self.step_backward(tensor)

    def run_rest(self) -> None:
        loss = self._loss()
        if not self.backward_ran:  # the body opened no block: the step's backward, plainly
            self.backward_ran = True
            self.step_backward(loss)
            self.engine.after_backward([loss])

    def close(self) -> None:
        super().close()
        self.run = self.step_backward = self.loss_value = None


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
