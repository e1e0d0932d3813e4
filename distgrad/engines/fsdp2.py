"""FSDP2: ``torch.distributed.fsdp.fully_shard``.

* Paths: ``fully_shard`` changes the module classes in place and adds no wrapper, so the user's
  paths are the module's own.
* Forward and backward: the module itself and plain autograd; FSDP2's hooks all-gather
  parameters before each sharded module runs and reduce-scatter gradients after.
* Parameter gradients: parameters and gradients are DTensors sharded on dim 0. ``.grad`` through
  distgrad returns ``grad.full_tensor()`` (an all-gather: call it on every rank) and assigning a
  full tensor stores this rank's shard of it.
"""

from __future__ import annotations

from ..torch_internals import fsdp2_unsharded_params
from .ranks import DistributedEngine


class FSDP2Engine(DistributedEngine):
    name = "fsdp2"
    sharded_params = True

    def param(self, param, path):
        return ShardedParam(param, path, self.agree)

    def engine_params(self) -> list:
        # the backward accumulates into the unsharded parameters FSDP2 swaps in for the forward
        return super().engine_params() + fsdp2_unsharded_params(self.wrapped)


def is_fully_sharded(obj) -> bool:
    """Whether ``obj`` is a module ``fully_shard`` has sharded."""
    # torch.distributed.fsdp takes half a second to import: only when a model is checked
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(obj, FSDPModule)


class ShardedParam:
    """A DTensor parameter seen whole: ``.grad`` gathers, ``.grad = full`` scatters locally."""

    def __init__(self, param, path: str, agree=lambda label: None):
        object.__setattr__(self, "param", param)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "agree", agree)  # before each collective (ranks/agreement.py)

    @property
    def grad(self):
        g = self.param.grad
        if g is None:
            return None
        self.agree(f"{self.path}.grad")
        return g.full_tensor()

    @grad.setter
    def grad(self, value):
        from torch.distributed.tensor import distribute_tensor

        if value is None:
            self.param.grad = None
            return
        if tuple(value.shape) != tuple(self.param.shape):
            raise ValueError(
                f"{self.path}.grad = ...: expected the full shape "
                f"{list(self.param.shape)}, got {list(value.shape)}."
            )
        self.agree(f"{self.path}.grad = ...")
        self.param.grad = distribute_tensor(
            value.detach().to(self.param.dtype), self.param.device_mesh, self.param.placements
        )

    def full_tensor(self):
        return self.param.full_tensor()

    def __getattr__(self, name):
        return getattr(self.param, name)

    def __setattr__(self, name, value):
        if name == "grad":  # a custom __setattr__ bypasses the property: route it by hand
            ShardedParam.grad.fset(self, value)
        else:
            setattr(self.param, name, value)

    def __repr__(self):
        return f"ShardedParam({self.path}, shape={list(self.param.shape)})"
