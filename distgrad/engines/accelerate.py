"""accelerate: a model from ``accelerator.prepare(...)``, wrapped as
``distgrad.wrap(model, accelerator=accelerator)``.

* What accelerate prepared decides the rest: on several CPU processes it is a DDP module, so the
  DDP engine handles paths, forward, saves and parameter gradients (see ``ddp.py``).
* Backward: ``accelerator.backward(loss)``, so accelerate's gradient-accumulation division and
  mixed-precision scaling happen as in the user's training loop. The body sees the gradient of
  the tensor the block was opened on; with ``gradient_accumulation_steps=k`` accelerate divides
  the loss by k first, so the body's gradients are 1/k of the unscaled loss's.
* Without ``accelerator=``: a model that ``accelerator.prepare`` returned is marked
  (``_is_accelerate_prepared``), but accelerate keeps no reference to its Accelerator, only its
  shared state (``AcceleratorState``, ``GradientState``). ``PreparedWithoutAccelerator`` reads
  that state at wrap time and at every backward: where ``accelerator.backward(loss)`` is exactly
  ``loss.backward()`` (no gradient accumulation, no fp16 loss scaling, no DeepSpeed or
  Megatron-LM) it runs that; otherwise it raises and asks for ``accelerator=``, since it
  cannot reach accelerate's scaler or DeepSpeed engine.
* Trap: on CPU, ``Accelerator()`` under torchrun without ``cpu=True`` (or ``--multi_gpu`` with
  ``accelerate launch``) runs each process alone (``DistributedType.NO``): every rank trains on
  its own data, unsynchronised. distgrad refuses that combination with the fix in the message.
"""

from __future__ import annotations

import os

from .around import EngineAround
from .base import Engine
from .ddp import DDPEngine


class AccelerateEngine(EngineAround):
    name = "accelerate"

    def __init__(self, wrapped, accelerator, inner: Engine):
        super().__init__(wrapped, inner)
        from accelerate.utils import DistributedType

        world = int(os.environ.get("WORLD_SIZE", "1"))
        kind = accelerator.distributed_type if accelerator is not None else None
        if world > 1 and kind == DistributedType.NO:
            raise ValueError(
                f"distgrad.wrap(..., accelerator=...): this process is one of {world} "
                "(WORLD_SIZE) but the Accelerator is not distributed (DistributedType.NO), so "
                "the ranks would train unsynchronised. On CPU create it as "
                "Accelerator(cpu=True) under torchrun, or use `accelerate launch --multi_gpu`."
            )
        self.accelerator = accelerator

    # everything but the backward is the prepared model's own engine (EngineAround)
    own_backward = True  # accelerator.backward: its scaler, gradient accumulation

    def backward(self, tensor, fn, args, kwargs):
        if isinstance(self.inner, DDPEngine):  # several blocks over one forward: ddp.py
            self.inner.before_backward()
        return self.accelerator.backward(tensor, *args, **kwargs)


class PreparedWithoutAccelerator(AccelerateEngine):
    """A model from ``accelerator.prepare``, wrapped without ``accelerator=``: plain backward
    where accelerate's is the same, a clear error where it is not."""

    def __init__(self, wrapped, inner: Engine):
        super().__init__(wrapped, None, inner)
        refuse_if_backward_differs()

    own_backward = False  # a plain backward (refuse_if_backward_differs)

    def backward(self, tensor, fn, args, kwargs):
        # the steps can change after wrap (a setter on the Accelerator)
        refuse_if_backward_differs()
        if isinstance(self.inner, DDPEngine):
            self.inner.before_backward()
        return fn(tensor, *args, **kwargs)


def refuse_if_backward_differs() -> None:
    """Raise unless ``accelerator.backward(loss)`` would be ``loss.backward()`` now, as read
    from accelerate's shared state (accelerator.py's ``backward`` in accelerate 1.x)."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType

    why = None
    if not AcceleratorState._shared_state or not GradientState._shared_state:
        why = (
            "accelerate's state has been reset since, so distgrad cannot tell what its "
            "backward does"
        )
    else:
        state = AcceleratorState()
        steps = GradientState().num_steps
        if steps != 1:
            why = (
                f"gradient_accumulation_steps={steps}: accelerator.backward(loss) divides the "
                f"loss by {steps}"
            )
        elif state.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            why = f"accelerator.backward runs {state.distributed_type.value}'s own backward"
        elif state.mixed_precision == "fp16":
            why = "mixed_precision='fp16': accelerator.backward(loss) scales the loss"
    if why is not None:
        raise ValueError(
            "distgrad.wrap(model) got a model prepared by accelerate but no accelerator, and "
            f"{why}, which a plain loss.backward() would not. Pass the Accelerator: "
            "distgrad.wrap(model, accelerator=accelerator)."
        )
