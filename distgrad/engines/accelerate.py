"""accelerate: a model from ``accelerator.prepare(...)``, wrapped as
``distgrad.wrap(model, accelerator=accelerator)``.

* What accelerate prepared decides the rest: on several CPU processes it is a DDP module, so the
  DDP engine handles paths, forward, saves and parameter gradients (see ``ddp.py``).
* Backward: ``accelerator.backward(loss)``, so accelerate's gradient-accumulation division and
  mixed-precision scaling happen as in the user's training loop. The body sees the gradient of
  the tensor the block was opened on; with ``gradient_accumulation_steps=k`` accelerate divides
  the loss by k first, so the body's gradients are 1/k of the unscaled loss's.
* Trap: on CPU, ``Accelerator()`` under torchrun without ``cpu=True`` (or ``--multi_gpu`` with
  ``accelerate launch``) runs each process alone (``DistributedType.NO``): every rank trains on
  its own data, unsynchronised. distgrad refuses that combination with the fix in the message.
"""
from __future__ import annotations

import os

from .base import Engine


class AccelerateEngine(Engine):
    name = "accelerate"

    def __init__(self, wrapped, accelerator, inner: Engine):
        super().__init__(wrapped)
        from accelerate.utils import DistributedType
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and accelerator.distributed_type == DistributedType.NO:
            raise ValueError(
                f"distgrad.wrap(..., accelerator=...): this process is one of {world} "
                "(WORLD_SIZE) but the Accelerator is not distributed (DistributedType.NO), so "
                "the ranks would train unsynchronised. On CPU create it as "
                "Accelerator(cpu=True) under torchrun, or use `accelerate launch --multi_gpu`.")
        self.accelerator = accelerator
        self.inner = inner

    # everything but the backward is the prepared model's own engine
    model = property(lambda self: self.inner.model)
    root = property(lambda self: self.inner.root)
    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)
    views = property(lambda self: self.inner.views)
    generator_bodies = property(lambda self: self.inner.generator_bodies)

    def forward(self, args, kwargs):
        return self.inner.forward(args, kwargs)

    def unwrap(self, module):
        return self.inner.unwrap(module)

    def param(self, param, path):
        return self.inner.param(param, path)

    def owns(self, module):
        return self.inner.owns(module)

    def begin_trace(self):
        self.inner.begin_trace()

    def end_trace(self, saves, error):
        return self.inner.end_trace(saves, error)

    def backward(self, tensor, fn, args, kwargs):
        return self.accelerator.backward(tensor, *args, **kwargs)
