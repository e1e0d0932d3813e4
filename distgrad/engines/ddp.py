"""DistributedDataParallel.

* Paths: the user's model is ``ddp.module``; the forward goes through ``ddp(...)`` so that DDP
  prepares its reducer for the backward.
* Backward: plain autograd. DDP's reducer all-reduces bucket by bucket from autograd hooks as
  parameter gradients become ready; an activation-gradient edit in the body happens inside the
  same backward before the layers upstream of it produce their parameter gradients, so it is
  included in what DDP reduces.
* Parameter gradients: after the backward every rank holds the full gradient averaged over the
  ranks (DDP's default), so ``.grad`` needs no collective and assignment is plain.
* Several backward blocks over one forward: DDP's forward prepares the reducer for one
  backward, which finishes the reduction; a second backward over the same graph accumulates
  this rank's own gradients into the averaged ones, reduced by nothing (PyTorch raises no
  error). distgrad raises before the second backward runs, unless the forward ran inside
  ``no_sync()`` (no backward of it reduces: every rank keeps its own sums, as intended).
* Parameters beside the model (a steering vector, a user's own module applied in the body):
  averaged after a backward that DDP reduced, kept rank-local under ``no_sync()`` as the
  model's are (``ranks/beside.py``).
"""

from __future__ import annotations

import torch

from .ranks import DistributedEngine


class DDPEngine(DistributedEngine):
    name = "ddp"

    def __init__(self, wrapped, *args, **kwargs):
        super().__init__(wrapped, *args, **kwargs)
        self.reducing = False  # the last forward prepared DDP's reducer
        self.backwards = 0  # backward blocks run since that forward

    @property
    def model(self) -> torch.nn.Module:
        return self.wrapped.module

    def forward(self, args, kwargs, call=None):
        # DDP prepares its reducer exactly when grad mode is on and no_sync() is not
        self.reducing = torch.is_grad_enabled() and self.wrapped.require_backward_grad_sync
        self.backwards = 0
        return super().forward(args, kwargs, call)

    def backward(self, tensor, fn, args, kwargs):
        self.before_backward()
        return super().backward(tensor, fn, args, kwargs)

    def plain_backward(self) -> None:
        self.before_backward()  # (a plain backward reduces, or not, as a block's does)

    def reduces_beside(self) -> bool:
        # parameters beside the model are kept rank-local where DDP keeps the model's: inside
        # no_sync() (the trace's forward ran in it, or, for a step whose forward is another
        # library's, it is open now), until the synchronising backward averages the sums. A
        # mean more is never wrong (it is linear), so anything else reduces.
        return self.reducing or self.wrapped.require_backward_grad_sync

    def before_backward(self) -> None:
        """Before a backward block's backward (accelerate's too): raise where DDP would not
        reduce its gradients. Every rank runs the same blocks, so every rank raises."""
        self.backwards += 1
        if self.reducing and self.backwards > 1:
            raise NotImplementedError(
                f"a backward after {self.backwards - 1} other(s) over the same forward under "
                f"DistributedDataParallel: DDP reduces the gradients of the first backward after "
                f"a forward only, so this one's would stay this rank's own, unaveraged. Open one "
                f"block on the sum of the losses (`with (loss1 + loss2).backward():`), or run "
                f"the trace inside `with ddp.no_sync():` (no block reduces; a later backward "
                f"outside no_sync() reduces the accumulated gradients, or all-reduce them "
                f"yourself)."
            )
