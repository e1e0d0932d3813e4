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
                "(`with loss.backward():`) without gradient=.")
        return self.wrapped.backward(tensor, **kwargs)

    def param(self, param, path):
        return ZeroParam(param, path, self.agree)


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
