"""DistributedDataParallel.

* Paths: the user's model is ``ddp.module``; the forward goes through ``ddp(...)`` so that DDP
  prepares its reducer for the backward.
* Backward: plain autograd. DDP's reducer all-reduces bucket by bucket from autograd hooks as
  parameter gradients become ready; an activation-gradient edit in the body happens inside the
  same backward before the layers upstream of it produce their parameter gradients, so it is
  included in what DDP reduces.
* Parameter gradients: after the backward every rank holds the full gradient averaged over the
  ranks (DDP's default), so ``.grad`` needs no collective and assignment is plain.
"""
from __future__ import annotations

import torch
from .ranks import DistributedEngine


class DDPEngine(DistributedEngine):
    name = "ddp"

    @property
    def model(self) -> torch.nn.Module:
        return self.wrapped.module

