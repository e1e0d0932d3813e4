"""Lightning, traced: an intervention of the user's runs in every training step of a
``lightning.pytorch.Trainer`` under automatic optimization (``training_step`` returns the loss)::

    from distgrad.lightning import TraceSteps

    def double_first_block(model, tr):      # model: the LightningModule, wrapped
        hidden = model.net.transformer.h[0].output
        with tr.loss.backward():            # Lightning's own backward of its own loss
            grad = hidden.grad
            hidden.grad = grad * 2
        return {"grad": grad}               # kept per step: tracer.saved on rank 0

    tracer = TraceSteps(double_first_block)
    trainer = L.Trainer(..., callbacks=[tracer])
    trainer.fit(lit_module, data)

Everything but the intervention stays Lightning's: its training loop calls ``training_step``,
zeroes the gradients and runs its strategy's backward (precision plugin, DDP's reduction,
DeepSpeed's engine) as it would, in that order; the trace spans the three
(``model.trace_step``: ``training_step`` is the step's forward, ``zero_grad`` and the
strategy's ``backward`` its backward).

* ``model`` is what the strategy trains, wrapped: its engine is the strategy's (DDP, FSDP,
  DeepSpeed; one device: the LightningModule itself), its paths the LightningModule's.
* ``tr.loss`` is the loss Lightning backpropagates: with ``accumulate_grad_batches=k``, the
  returned loss divided by k.
* What the intervention returns is saved (gathered to rank 0) and recorded per training batch
  as a ``TracedStep`` (``distgrad.step_records``): appended to ``saved``, or handed to
  ``on_step(record)`` if given.
* Manual optimization needs no callback: trace inside ``training_step`` with
  ``model.trace_step(lambda: <forward returning the loss>, self.manual_backward)``
  (``docs/recipes.rst``); a plain backward there raises (``engines/in_job.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch

from . import wrap
from .errors import TraceStateError
from .step_records import TracedStep, copies_of_model_state, save_unsaved
from .trace import Model


class TraceSteps(pl.Callback):
    """A Lightning callback: every training step of automatic optimization runs inside a
    distgrad trace whose body is ``intervention(model, tr)``.

    Attributes: ``intervention``; ``on_step``, the callback for each ``TracedStep``, or None;
    ``saved``, the ``TracedStep`` records when there is no callback."""

    def __init__(self, intervention: Callable, on_step: Callable | None = None):
        if not callable(intervention):
            raise TypeError(
                f"TraceSteps(intervention=...) takes a function intervention(model, tr), not "
                f"{type(intervention).__name__}."
            )
        self.intervention = intervention
        self.on_step = on_step
        self.saved: list[TracedStep] = []
        self.traced_model: Model | None = None
        self.traced_for = None  # the strategy's model that traced_model wraps
        self.loop = None  # the automatic optimization loop made to trace, while fitting

    # -- Lightning's hooks -------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if not pl_module.automatic_optimization:
            raise TraceStateError(
                f"TraceSteps traces Lightning's automatic optimization, but "
                f"{type(pl_module).__name__} sets automatic_optimization = False. Trace inside "
                f"its training_step instead: `with model.trace_step(lambda: <forward returning "
                f"the loss>, self.manual_backward) as tr:`."
            )
        loop = getattr(trainer.fit_loop.epoch_loop, "automatic_optimization", None)
        make_closure = getattr(loop, "_make_closure", None)  # one closure per training batch
        if make_closure is None:  # (Lightning's own loop: a release may change it)
            raise RuntimeError(
                f"TraceSteps runs each training step in a trace by way of Lightning's "
                f"automatic-optimization loop (its _make_closure), which Lightning "
                f"{pl.__version__} does not have. It is tested with Lightning 2.6; trace the "
                f"step under manual optimization instead: `with model.trace_step(lambda: "
                f"<forward returning the loss>, self.manual_backward) as tr:`."
            )
        self.loop = loop

        def make_traced_closure(kwargs, optimizer, batch_idx):
            closure = make_closure(kwargs, optimizer, batch_idx)
            # the closure runs training_step, zero_grad and backward in turn; they run in a
            # trace instead (the instance's closure() shadows the class's)
            parts = closure._step_fn, closure._zero_grad_fn, closure._backward_fn
            closure.closure = lambda *args, **kwargs: self.traced_closure(
                trainer, batch_idx, *parts
            )
            return closure

        self.loop._make_closure = make_traced_closure

    def on_train_end(self, trainer, pl_module) -> None:
        self.restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.restore()

    def restore(self) -> None:
        if self.loop is not None:
            vars(self.loop).pop("_make_closure", None)
            self.loop = None

    # -- one training batch ------------------------------------------------------------------
    @torch.enable_grad()
    def traced_closure(self, trainer, batch_idx, step_fn, zero_grad_fn, backward_fn):
        """What Lightning's ``Closure.closure`` does, in a trace with the intervention as its
        body: ``training_step``, then ``zero_grad`` and the backward as the block's backward."""
        traced = self.traced(trainer.strategy.model)
        outputs = []

        def run():
            output = step_fn()
            outputs.append(output)
            if output.closure_loss is None:
                raise TraceStateError(
                    "training_step returned no loss, so Lightning runs no backward and "
                    "TraceSteps has no step to trace: return the loss (or a dict with 'loss')."
                )
            return output.closure_loss

        def backward(loss):
            if zero_grad_fn is not None:
                zero_grad_fn()
            if backward_fn is not None:
                backward_fn(loss)

        with traced.trace_step(run, backward) as tr:
            value = self.intervention(traced, tr)
            if value is not None:
                value = copies_of_model_state(value, traced.module)
                save_unsaved(value)
        self.record(trainer, batch_idx, value)
        return outputs[0]

    def traced(self, model) -> Model:
        # the strategy's model (DDP, FSDP, DeepSpeed's engine, or the LightningModule), the
        # same object every step of a fit
        if self.traced_for is not model:
            self.traced_model = wrap(model)
            self.traced_for = model
        return self.traced_model

    def record(self, trainer, batch_idx: int, value) -> None:
        record = TracedStep(trainer.global_step, batch_idx % trainer.accumulate_grad_batches, value)
        if self.on_step is not None:
            self.on_step(record)
        else:
            self.saved.append(record)


__all__ = ["TraceSteps", "TracedStep"]
