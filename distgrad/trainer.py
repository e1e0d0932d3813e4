"""Hugging Face ``Trainer``, traced: an intervention of the user's runs in every training step::

    from distgrad.trainer import TracedTrainer

    def double_first_block(model, tr):
        hidden = model.transformer.h[0].output
        with tr.loss.backward():            # the Trainer's own backward of its own loss
            grad = hidden.grad
            hidden.grad = grad * 2
        return {"grad": grad}               # kept per step: trainer.saved on rank 0

    trainer = TracedTrainer(model=net, args=args, train_dataset=data,
                            intervention=double_first_block)
    trainer.train()

Everything but the intervention stays the Trainer's: ``training_step`` runs as written in
transformers (input preparation, ``compute_loss`` with ``num_items_in_batch`` and label
smoothing, the division for gradient accumulation, autocast) and its
``accelerator.backward(loss, ...)`` runs once per step, with the same arguments, as the
backward of the intervention's block (``model.trace_step``). So accelerate's wrapping (DDP,
FSDP, DeepSpeed), its loss scaling and gradient accumulation are what they are without distgrad.

* ``tr.loss`` is the loss the Trainer backpropagates: with ``gradient_accumulation_steps=k``
  and a loss not already normalised over the accumulated tokens, ``loss / k``; the gradients
  the block shows are those of that loss, as a raw hook would see them.
* What the intervention returns is saved (a parameter, its ``.grad`` or a buffer as a copy
  taken when the step's backward has run) and recorded once per call of ``training_step`` (one
  micro-batch) as a ``TracedStep``: appended to ``trainer.saved``, or handed to
  ``on_step(record)`` if given (nothing is kept then: a long run keeps only what the callback
  keeps).
* On several ranks its tensors are gathered as ``.save()`` gathers, when each step's trace
  ends: rank 0's record holds every rank's rows joined in rank order, the other ranks' their
  own. Where the ranks' batches have different lengths (each padded to its own longest row)
  the joined value is padded with NaN and ``distgrad.rank_parts(value)`` gives each rank's
  part. A tensor the intervention saved itself (``.save(gather="none")``: each rank keeps its
  own) is recorded as it saved it.
* The intervention may open no backward block (forward reads and edits only): the Trainer's
  backward runs after it, as without distgrad.
* Only training steps are traced; evaluation and prediction run untouched.

To trace another ``Trainer`` subclass (TRL's ``SFTTrainer``, your own), put ``TraceSteps``
first among its bases: ``class MyTrainer(TraceSteps, SFTTrainer): pass``.
"""

from __future__ import annotations

from collections.abc import Callable

import transformers

from . import wrap
from .step_records import TracedStep, copies_of_model_state, save_unsaved
from .trace import Model


class TraceSteps:
    """A ``transformers.Trainer`` mixin: every ``training_step`` runs inside a distgrad trace
    whose body is ``intervention(model, tr)`` (``model``: the wrapped model being trained;
    ``tr``: the trace, with the step's loss as ``tr.loss``).

    Attributes: ``intervention``; ``on_step``, the callback for each ``TracedStep``, or None;
    ``saved``, the ``TracedStep`` records when there is no callback.
    """

    def __init__(self, *args, intervention: Callable, on_step: Callable | None = None, **kwargs):
        if not callable(intervention):
            raise TypeError(
                f"{type(self).__name__}(intervention=...) takes a function "
                f"intervention(model, tr), not {type(intervention).__name__}."
            )
        super().__init__(*args, **kwargs)
        self.intervention = intervention
        self.on_step = on_step
        self.saved: list[TracedStep] = []
        self.traced_model: Model | None = None  # distgrad's model of the prepared one
        self.traced_for = None  # ...and the prepared model it wraps
        self.micro_batch = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's own training step, with the intervention as the body of its trace."""
        traced = self._traced(model)
        accelerator = self.accelerator
        deferred: dict = {}
        returned: list = []

        def backward_later(loss, **kwargs):  # the Trainer's backward, for the block to run
            deferred["loss"], deferred["kwargs"] = loss, kwargs

        def run():
            accelerator.backward = backward_later  # on the instance, for this call only
            try:
                returned.append(
                    super(TraceSteps, self).training_step(model, inputs, num_items_in_batch)
                )
            finally:
                del accelerator.backward
            if "loss" not in deferred:
                raise RuntimeError(
                    f"{type(self).__name__}.training_step returned without calling "
                    f"accelerator.backward(loss): distgrad finds the step's loss there. Trace "
                    f"steps of a Trainer whose training_step runs accelerate's backward."
                )
            return deferred["loss"]

        def backward(loss):
            accelerator.backward(loss, **deferred["kwargs"])

        with traced.trace_step(run, backward) as tr:
            value = self.intervention(traced, tr)
            if value is not None:
                value = copies_of_model_state(value, traced.module)
                save_unsaved(value)
        self._record(value)
        return returned[0]

    def _traced(self, model) -> Model:
        # ``model`` is what the Trainer trains: its accelerate-prepared wrapper
        # (``model_wrapped``), the same object every step
        if self.traced_for is not model:
            self.traced_model = wrap(model, accelerator=self.accelerator)
            self.traced_for = model
        return self.traced_model

    def _record(self, value) -> None:
        record = TracedStep(self.state.global_step, self.micro_batch, value)
        # the optimizer steps after the micro-batch that syncs: the next one starts a step
        self.micro_batch = 0 if self.accelerator.sync_gradients else self.micro_batch + 1
        if self.on_step is not None:
            self.on_step(record)
        else:
            self.saved.append(record)


class TracedTrainer(TraceSteps, transformers.Trainer):
    """``transformers.Trainer`` with ``intervention=`` (and ``on_step=``): see ``TraceSteps``."""


__all__ = ["TracedTrainer", "TraceSteps", "TracedStep"]
