"""Who holds a module: the modules above it (a module does not know its parents), and the
training library among them whose backward a trace must use (Lightning, Fabric). Read by the
engines of plain modules (``local.py``, ``in_job.py``) and Fabric's (``fabric.py``)."""

from __future__ import annotations

import gc
import sys

import torch

from ..errors import TraceStateError
from ..torch_internals import submodules

# where Lightning's and Fabric's own backward functions live (called_by_library_backward)
_LIBRARY_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")


def library_imported() -> bool:
    """Whether Lightning or Fabric is imported in this process (else no module can be theirs)."""
    return any(
        name in sys.modules for name in ("lightning", "pytorch_lightning", "lightning_fabric")
    )


def enclosing_modules(module: torch.nn.Module) -> list:
    """The modules that hold ``module`` as a submodule, nearest first, up to the roots (a module
    does not know its parents: every module object of the process is looked at once, a
    fraction of a second, once per engine)."""
    parents: dict[int, list] = {}
    module_class = torch.nn.Module
    for obj in gc.get_objects():
        # by type, not isinstance: isinstance reads __class__, which some objects compute (a
        # deprecated torch alias warns when touched)
        if issubclass(type(obj), module_class):
            for child in submodules(obj).values():
                if child is not None:
                    parents.setdefault(id(child), []).append(obj)
    found, todo, seen = [], [module], {id(module)}
    while todo:
        for parent in parents.get(id(todo.pop(0)), []):
            if id(parent) not in seen:
                seen.add(id(parent))
                found.append(parent)
                todo.append(parent)
    return found


def called_by_library_backward() -> bool:
    """Whether the ``.backward()`` being called comes from Lightning's or Fabric's own backward
    (``self.manual_backward(loss)``, ``fabric.backward(loss)`` called in a body run it there)."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name in ("backward", "manual_backward") and module.startswith(
            _LIBRARY_PACKAGES
        ):
            return True
        frame = frame.f_back
    return False


def library_of(module) -> str | None:
    """``"Lightning"`` where ``module`` is a LightningModule attached to a Trainer,
    ``"Fabric"`` where it is a module ``fabric.setup`` returned; else None."""
    kind = type(module)
    if kind.__name__ == "_FabricModule":
        return "Fabric"
    if any(c.__name__ == "LightningModule" for c in kind.__mro__):
        return "Lightning" if vars(module).get("_trainer") is not None else None
    return None


def library_holding(owners: list):
    """The first of ``owners`` (the module, then its parents) that is a library's, or None."""
    return next((owner for owner in owners if library_of(owner) is not None), None)


def library_refusal(what: str, module, library, world: int) -> TraceStateError:
    """The error for ``what`` (a plain backward) on ``module``, held by ``library`` (a
    LightningModule or a Fabric module), in a job of ``world`` processes."""
    name = library_of(library)
    where = f"under {name}" + (f" on {world} ranks" if world > 1 else "")
    if name == "Lightning" and library.automatic_optimization:
        return TraceStateError(
            f"{what} on {type(module).__name__}, which runs {where} with automatic "
            f"optimization: Lightning runs its own backward of the loss training_step "
            f"returns, so this one would be a second (its gradients accumulated twice, or "
            f"PyTorch's 'backward through the graph a second time'). Return the loss from "
            f"training_step and trace the step with the callback "
            f"distgrad.lightning.TraceSteps(intervention), whose `with tr.loss.backward():` "
            f"is Lightning's backward."
        )
    backward = "self.manual_backward" if name == "Lightning" else "fabric.backward"
    apart = (
        "the ranks would train apart" if world > 1 else "on several ranks they would train apart"
    )
    return TraceStateError(
        f"{what} on {type(module).__name__}, which runs {where}: a plain backward bypasses "
        f"{name}'s own ({backward}), which reduces the gradients across ranks and scales the "
        f"loss under mixed precision, so {apart}. Trace the step with the "
        f"library's backward: `with model.trace_step(lambda: <forward returning the loss>, "
        f"{backward}) as tr:` and open the block on `tr.loss` (`with tr.loss.backward():`)."
    )


def parallel_kind(module) -> str | None:
    """How ``module`` runs data parallel over the ranks: ``"ddp"`` or a ``sharding_kind``."""
    if type(module).__name__ == "DistributedDataParallel":
        return "ddp"
    return sharding_kind(module)


def sharding_kind(module) -> str | None:
    """How ``module`` shards the parameters below it: ``"fsdp1"``, ``"fsdp2"``,
    ``"deepspeed"``, or None."""
    name = type(module).__name__
    if name == "FullyShardedDataParallel":
        return "fsdp1"
    if name == "DeepSpeedEngine":
        return "deepspeed"
    if any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
        return "fsdp2"
    return None
