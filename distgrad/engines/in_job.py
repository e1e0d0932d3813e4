"""A plain module traced in a job of several processes: ``self.net`` of a LightningModule under
Lightning's DDP strategy, the module a Fabric or torchrun script wraps itself, or one wrapped
before ``torch.distributed.init_process_group`` ran.

The one-process engine (``local.py``) decides at each trace, not at wrap, whether its module
runs in such a job; if it does, the trace is served by ``ModuleInJob``:

* Saves: gathered to rank 0 as the global batch, as under DDP (``ranks/gather.py``): every
  rank's own rows joined in rank order. Before the gather the ranks meet through the job's
  store (``meet``): a trace that ran on one rank only (an evaluation on rank 0) raises after
  ``distgrad.config.peer_timeout`` seconds instead of waiting for ever; saves made with
  ``gather="none"`` need no peer, so such a trace keeps them and meets nobody.
* Parameter gradients: the module's parents are found once (``enclosing_modules``, below). Under
  a sharding parent (FSDP1, ``fully_shard``, a DeepSpeed engine) ``.grad`` is that engine's
  full gradient, as on its own engine; a plain parameter's ``.grad`` is returned where every
  rank holds the same tensor (reduced by DDP, or by the user), and raises where the ranks hold
  different ones (this rank's own sums, which the body would take for the job's).
* Backward: under Lightning or Fabric (a ``LightningModule`` attached to a Trainer, or a
  Fabric module, among the parents) the backward must be the library's own
  (``self.manual_backward(loss)``, ``fabric.backward(loss)``), which reduces the gradients
  across ranks and scales the loss; a ``with loss.backward():`` block or a plain ``.backward()``
  in the body would bypass it, leaving every rank with its own gradients. Both raise, saying
  how to open the block on the library's backward (``model.trace_step``). Under a DDP, FSDP
  or DeepSpeed parent outside those libraries the trace's forward called the module itself,
  bypassing the parent's forward, so its backward would not reduce either: both raise, naming
  the parent to wrap instead.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..config import config
from ..errors import TraceStateError
from .deepspeed import ZeroParam
from .fsdp2 import ShardedParam
from .owners import (
    called_by_library_backward,
    enclosing_modules,
    library_holding,
    library_refusal,
    parallel_kind,
    sharding_kind,
)
from .ranks import DistributedEngine


class Meetings:
    """The meetings this process's ranks reached together (``ModuleInJob.meet``), counted over
    every module it traces: the ranks run their gathering traces in the same order whatever
    modules a rank traces on its own (an evaluation model on rank 0 with ``gather="none"``
    meets nobody), so one counter in the job's store lines them up. Counted afresh for each
    store (a new process group)."""

    key = "distgrad/in_job/meetings"

    def __init__(self):
        self.store, self.met = None, 0

    def target(self, store, world: int) -> int:
        """The count the store's counter reaches when every rank is at this meeting."""
        if store is not self.store:
            self.store, self.met = store, 0
        return world * (self.met + 1)


MEETINGS = Meetings()


def job_world() -> int:
    """The number of processes of the job this one belongs to (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def engine_for_job(current, module: torch.nn.Module):
    """The ``ModuleInJob`` a trace of the plain ``module`` runs on now: ``current`` while the
    process group it was made in is still the job's, a new one where a process group of
    several ranks exists (one made since the last trace, or since wrap), None where none
    does."""
    if job_world() == 1:
        return None
    if current is not None and current.group is dist.group.WORLD:
        return current
    return ModuleInJob(module)


class ModuleInJob(DistributedEngine):
    name = "module in a multi-process job"

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.met_in_trace = False  # this trace met the other ranks (meet)
        parents = enclosing_modules(module)
        self.library = library_holding([module, *parents])
        self.sharding = next((p for p in reversed(parents) if sharding_kind(p)), None)
        self.parallel = next((p for p in parents if parallel_kind(p)), None)

    # -- backward: the library's own, where there is one -------------------------------------
    def backward(self, tensor, fn, args, kwargs):
        self.refuse_plain_backward("a `with loss.backward():` block")
        return fn(tensor, *args, **kwargs)

    def plain_backward(self) -> None:
        if not called_by_library_backward():
            self.refuse_plain_backward("a plain `.backward()` in the trace's body")

    def refuse_plain_backward(self, what: str) -> None:
        if self.library is None and self.parallel is not None:
            wrapper = type(self.parallel).__name__
            raise TraceStateError(
                f"{what} on {type(self.wrapped).__name__}, which sits inside a {wrapper} on "
                f"{self.world_size} ranks: the trace called {type(self.wrapped).__name__} "
                f"itself, bypassing the {wrapper}'s forward, so this backward would not reduce "
                f"the gradients and the ranks would train apart. Wrap the {wrapper} instead: "
                f"distgrad.wrap({wrapper.lower()}_model) (paths then start at the module it "
                f"wraps)."
            )
        if self.library is not None:
            raise library_refusal(what, self.wrapped, self.library, self.world_size)

    # -- parameter gradients -----------------------------------------------------------------
    def param(self, param, path):
        kind = sharding_kind(self.sharding) if self.sharding is not None else None
        if kind == "fsdp1":
            from .fsdp1 import FullParam  # (imports torch.distributed.fsdp: only when used)

            return FullParam(self.sharding, param, path, self.meet)
        if kind == "deepspeed":
            return ZeroParam(param, path, self.meet)
        if type(param).__name__ == "DTensor" or kind == "fsdp2":
            return ShardedParam(param, path, self.meet)
        return AgreedParam(param, path, self)

    # -- the end of a trace ------------------------------------------------------------------
    def end_trace(self, saves: list, error: BaseException | None):
        alone = None
        if error is None and any(mode != "none" for _, mode, _ in saves):
            try:
                self.meet("the end-of-trace gather of its saves")
            except TraceStateError as exc:
                alone = exc
        if alone is None and (error is not None or self.met_in_trace):
            return super().end_trace(saves, error)
        # nothing to send (saves kept per rank), or no peer to send it to: the trace ends on
        # this rank alone, and the process group stays as it is
        gather, self.saves_gather = self.saves_gather, None
        try:
            super().end_trace(saves, None)
        finally:
            self.saves_gather = gather
        return alone

    def begin_trace(self) -> None:
        self.met_in_trace = False
        super().begin_trace()

    def meet(self, what: str) -> None:
        """Return once every rank has reached this point of its trace, through one counter in
        the store; raise ``TraceStateError`` after ``peer_timeout`` seconds without them
        (this rank's arrival taken back, so that the next meeting counts right)."""
        key = MEETINGS.key
        target = MEETINGS.target(self.store, self.job_world)
        arrived = self.store.add(key, 1)
        deadline = time.monotonic() + config.peer_timeout
        pause = 1e-4  # doubled up to 10 ms: ranks in step meet within a few round trips
        while arrived < target:
            if time.monotonic() > deadline:
                if self.store.add(key, -1) == target - 1:  # the last rank came meanwhile
                    self.store.add(key, 1)
                    break
                raise TraceStateError(
                    f"rank {self.job_rank} reached {what} in a trace of "
                    f"{type(self.wrapped).__name__}, but not every one of the {self.job_world} "
                    f"ranks did within {config.peer_timeout:g} s "
                    f"(distgrad.config.peer_timeout). A trace of a module in a multi-process "
                    f"job gathers its saves to rank 0, so every rank runs it. To trace on some "
                    f"ranks only (an evaluation on rank 0), save with `.save(gather='none')` "
                    f"(kept on this rank, nothing sent) and read no parameter .grad."
                )
            self.check_failure()
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
            arrived = self.store.add(key, 0)
        MEETINGS.met += 1
        self.met_in_trace = True


class AgreedParam:
    """A plain parameter of a module in a multi-process job: ``.grad`` is returned where every
    rank holds the same gradient (reduced), and raises where they differ."""

    def __init__(self, param, path: str, engine: ModuleInJob):
        object.__setattr__(self, "param", param)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "engine", engine)

    @property
    def grad(self):
        grad = self.param.grad
        group, device = self.engine.group, self.param.device
        self.engine.meet(f"{self.path}.grad")
        # whether every rank holds a gradient, then its elementwise max and min over the ranks:
        # equal to this rank's own on every rank exactly when the ranks agree
        held = torch.tensor([grad is not None, grad is None], dtype=torch.float32, device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=group)
        same = held.sum().item() == 1
        if same and grad is not None:
            high, low = grad.detach().clone(), -grad.detach()
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
            agreed = torch.tensor([torch.equal(high, -low)], dtype=torch.float32, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
            same = agreed.item() == 1
        if not same:
            raise ValueError(
                f"{self.path}.grad: the ranks hold different gradients for this parameter, "
                f"each its own rows' sums: nothing reduced them (the module was traced without "
                f"the DDP, FSDP or DeepSpeed wrapper that would). Wrap that wrapper "
                f"(distgrad.wrap(ddp_model); paths then start at the module it wraps), or "
                f"all-reduce the gradients before reading them."
            )
        return grad

    @grad.setter
    def grad(self, value):
        self.param.grad = value

    def __getattr__(self, name):
        return getattr(self.param, name)

    def __repr__(self):
        return f"AgreedParam({self.path})"
