"""DeepSpeed: a ``DeepSpeedEngine`` from ``deepspeed.initialize`` (ZeRO stage 0-3).

* Paths: the user's model is ``engine.module``; the forward goes through ``engine(...)`` so that
  ZeRO-3's hooks gather each module's parameters before it runs.
* Backward: ``engine.backward(loss)``. It runs autograd (the body's reads and edits happen
  there), then DeepSpeed's own reduction: ZeRO-2/3 reduce-scatter from gradient hooks as
  parameters finish, ZeRO-0/1 all-reduce when the backward is done. Either way the reduced
  gradients include the body's edits. With fp16 DeepSpeed scales the loss; the body sees the
  scaled gradients of the tensor it opened the block on (use fp32 or bf16 to read true values).
  With ``gradient_accumulation_steps=k`` DeepSpeed divides the loss by k first.
* Parameter gradients: ZeRO keeps them in its own partitioned buffers (``p.grad`` is None under
  ZeRO-3, and a ZeRO-3 weight has shape (0,) outside its module's forward). ``.grad`` through
  distgrad is ``deepspeed.utils.safe_get_full_grad(p)`` and assignment is ``safe_set_full_grad``:
  collectives, so make them on every rank.
* Gradient norms (``distgrad.flow``): each rank's own part, no collective: under ZeRO-3
  ``safe_get_local_grad`` (its partition), under ZeRO-1/2 its fragment of the flat partition
  (the one ``safe_get_full_grad`` would all-reduce), a plain ``.grad`` where DeepSpeed left one
  (the reduced gradient, on every rank). They exist between ``engine.backward`` and
  ``engine.step()``, which consumes and clears them: record before the step.
"""

from __future__ import annotations

import torch

from .ranks import DistributedEngine


class DeepSpeedEngineAdapter(DistributedEngine):
    name = "deepspeed"
    sharded_params = True
    own_backward = True  # engine.backward: its fp16 loss scale, gradient accumulation

    @property
    def model(self) -> torch.nn.Module:
        return self.wrapped.module

    def backward(self, tensor, fn, args, kwargs):
        if args or "gradient" in kwargs:
            raise NotImplementedError(
                "DeepSpeed's engine.backward(loss) takes a scalar loss: open the block on one "
                "(`with loss.backward():`) without gradient=."
            )
        return self.wrapped.backward(tensor, **kwargs)

    def param(self, param, path):
        return ZeroParam(param, path, self.agree)

    def grad_pieces(self, module):
        # each element of a gradient lies in one rank's partition of the data-parallel group
        # (DeepSpeed's _dp_group where it keeps one): other groups hold copies of it
        outside = max(self.job_world // self.world_size, 1)
        pieces = []
        for param in module.parameters():
            grad, copies = local_grad(param), outside
            if grad is None and param.grad is not None:
                grad, copies = param.grad, self.job_world  # reduced, whole on every rank
            if grad is not None:
                pieces.append((grad, copies))
        return pieces


def local_grad(param):
    """This rank's part of ``param``'s reduced gradient under ZeRO (flat), or None: where
    ``deepspeed.utils.safe_get_full_grad`` finds it, without its all-reduce."""
    if getattr(param, "_hp_grad", None) is None and param.grad is not None:
        return None  # a plain gradient (the caller's)
    if hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition
        from deepspeed.utils import safe_get_local_grad

        return safe_get_local_grad(param)
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:  # ZeRO-1/2: no element of it in this rank's partition
        return None
    fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).float().flatten()
    address = mapping.lp_fragment_address
    if param.view(-1).shape == fragment.shape:  # a whole buffer kept on each rank (bf16)
        fragment = fragment.narrow(0, address.start, address.numel)
    return fragment


class ZeroParam:
    """A parameter seen through DeepSpeed's accessors: full gradient, reduced and unpartitioned."""

    def __init__(self, param, path, agree=lambda label: None):
        object.__setattr__(self, "param", param)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "agree", agree)  # before each collective (ranks/agreement.py)

    @property
    def grad(self):
        from deepspeed.utils import safe_get_full_grad

        self.agree(f"{self.path}.grad")
        return safe_get_full_grad(self.param)

    @grad.setter
    def grad(self, value):
        from deepspeed.utils import safe_set_full_grad

        self.agree(f"{self.path}.grad = ...")
        safe_set_full_grad(self.param, value)

    def full_tensor(self):
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(self.param)

    def __getattr__(self, name):
        return getattr(self.param, name)

    def __repr__(self):
        return f"ZeroParam({self.path})"
