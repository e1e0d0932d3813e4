"""FSDP1: ``FullyShardedDataParallel`` with ``use_orig_params=True``.

* Paths: FSDP1 wraps the root and every auto-wrapped submodule in a ``FullyShardedDataParallel``
  whose child is ``_fsdp_wrapped_module``; ``unwrap`` steps through those (and activation
  checkpoint wrappers), so ``model.transformer.h[0]`` is the user's block and hooks go on it.
* Forward and backward: through the root wrapper, plain autograd; FSDP1 all-gathers flat
  parameters before each unit and reduce-scatters after the unit's backward. ``generate``
  calls the user's module, which bypasses the root wrapper: it runs inside
  ``summon_full_params``, every parameter whole on every rank.
* Parameter gradients: outside ``summon_full_params`` a parameter is a view of this rank's flat
  shard. ``.grad`` through distgrad opens ``summon_full_params(with_grads=True)`` on the root (a
  collective: call it on every rank) and returns a copy of the full gradient; assigning writes the
  full tensor inside the same context, which FSDP writes back to the shards. After a backward
  inside ``no_sync()`` the gradients are unsharded and rank-local until a synchronising
  backward; FSDP1 cannot gather them then, and ``.grad`` raises, saying so.
* Gradient norms (``distgrad.flow``): with ``use_orig_params=True`` each original parameter's
  ``.grad`` is its part in this rank's shard (flat; empty where it lies in other shards), so
  the ranks' squares add up exactly; under NO_SHARD it is the whole reduced gradient on every
  rank. With ``use_orig_params=False`` a block's parameters are gone into flat parameters and
  distgrad.flow refuses.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ..torch_internals import (
    fsdp1_flat_params,
    fsdp1_grad_layout,
    fsdp1_unsharded_grads,
    submodules,
)
from .ranks import DistributedEngine

_WRAPPER_CHILDREN = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


class FSDP1Engine(DistributedEngine):
    name = "fsdp1"
    sharded_params = True

    @property
    def model(self) -> torch.nn.Module:
        return self.unwrap(self.wrapped)

    def unwrap(self, module):
        while True:
            children = submodules(module)
            inner = next((children[n] for n in _WRAPPER_CHILDREN if n in children), None)
            if inner is None:
                return module
            module = inner

    def generate(self, args, kwargs):
        # HF's generate calls the user's module, not the FSDP root, so the root's own flat
        # parameters would stay sharded: gather every parameter whole for the generation (each
        # rank holds the full model meanwhile; no gradients flow in generate)
        with FSDP.summon_full_params(self.wrapped, writeback=False):
            return self.model.generate(*args, **kwargs)

    def param(self, param, path):
        return FullParam(self.wrapped, param, path, self.agree)

    def engine_params(self) -> list:
        # the backward accumulates into the flat parameters the original ones are views of
        return super().engine_params() + fsdp1_flat_params(self.wrapped)

    def refuse_flow(self):
        if not fsdp1_grad_layout(self.wrapped)[0]:
            raise NotImplementedError(
                "distgrad.flow: this FSDP1 model was wrapped with use_orig_params=False, which "
                "folds each block's parameters into flat parameters spanning several of them; "
                "wrap it with FullyShardedDataParallel(..., use_orig_params=True) (the same "
                "training) for per-layer parameter-gradient norms."
            )

    def grad_pieces(self, module):
        self.refuse_flow()
        keeps, sharded, group = fsdp1_grad_layout(self.wrapped)
        if fsdp1_unsharded_grads(self.wrapped):
            raise ValueError(
                "distgrad.flow: step() after a backward inside no_sync(): FSDP1 keeps the "
                "accumulated gradients unsharded on each rank until a backward outside "
                "no_sync() reduces them. Call step() after the synchronising backward."
            )
        # a shard: each element on one rank of its group, other groups (hybrid) hold copies
        copies = max(self.job_world // group, 1) if sharded else self.job_world
        return [(p.grad, copies) for p in module.parameters() if p.grad is not None]


class FullParam:
    def __init__(self, root, param, path, agree=lambda label: None):
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "param", param)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "agree", agree)  # before each collective (ranks/agreement.py)

    @property
    def grad(self):
        self.agree(f"{self.path}.grad")
        self.refuse_unsharded(".grad")
        with FSDP.summon_full_params(self.root, with_grads=True):
            g = self.param.grad
            return None if g is None else g.detach().clone()

    @grad.setter
    def grad(self, value):
        self.agree(f"{self.path}.grad = ...")
        self.refuse_unsharded(".grad = ...")
        with FSDP.summon_full_params(self.root, with_grads=True, writeback=True):
            if self.param.grad is None or value is None:
                raise ValueError(
                    f"{self.path}.grad = ...: FSDP1 can only overwrite an existing "
                    "gradient; assign after the backward."
                )
            self.param.grad.copy_(value)

    def refuse_unsharded(self, what: str) -> None:
        # the same answer on every rank: each accumulated the same backwards under no_sync
        if fsdp1_unsharded_grads(self.root):
            raise ValueError(
                f"{self.path}{what}: after a backward inside no_sync(), FSDP1 keeps the "
                f"accumulated gradients unsharded on each rank until a backward outside "
                f"no_sync() reduces them, and cannot gather them whole before that. Read "
                f"parameter gradients after the synchronising backward (the last micro-batch "
                f"of the accumulation)."
            )

    def __getattr__(self, name):
        return getattr(self.param, name)

    def __repr__(self):
        return f"FullParam({self.path})"
