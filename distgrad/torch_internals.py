"""Every private PyTorch internal distgrad relies on, in one place to audit when torch changes.

Each entry names the internal and why the public API does not do. Most callers call these
functions. A few hot paths (a hook that fires on every call of a module, the per-read hook
installs) cannot afford a Python call per access: they read the same attribute inline, on a
line that names the entry here (``# torch internal: torch_internals.NAME``), and
``tests/test_hygiene.py`` checks that no other line in distgrad/ touches a torch internal.
"""

from __future__ import annotations

import ctypes
import sys
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree  # noqa: F401  (flatten/unflatten of nested values)
from torch.utils.hooks import RemovableHandle

# -- autograd state, bound at import (read inside every module hook) ---------------------------
# The (pack, unpack) pair of the innermost saved-tensor hooks, or None: tells a hook that fires
# inside torch.utils.checkpoint apart from one in a plain forward. torch exposes no public getter.
top_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
# torch.is_grad_enabled and its setter without the Python wrappers around them.
grad_enabled = torch._C.is_grad_enabled
set_grad_enabled = torch._C._set_grad_enabled
# Copies a list of tensors into a list of views in one kernel launch (no public foreach copy).
foreach_copy_ = torch._foreach_copy_
# The C descriptor of Tensor.grad: distgrad's .grad property falls back to it.
PLAIN_GRAD = torch._C.TensorBase.__dict__["grad"]
# The file that defines Tensor.backward: tells torch's own backward apart from a user's.
TENSOR_MODULE_FILE = torch._tensor.__file__


# -- hook dicts (written directly: a RemovableHandle costs a weakref per hook) ----------------
def new_hook_id() -> int:
    """An id from ``RemovableHandle.next_id``, the counter torch's own handles draw from, so an
    entry distgrad writes never collides with a user's hook."""
    hid = RemovableHandle.next_id
    RemovableHandle.next_id = hid + 1
    return hid


def add_tensor_hook(tensor: torch.Tensor, hook):
    """``tensor.register_hook(hook)`` without the handle, for a plain tensor: writes
    ``tensor._backward_hooks`` (made and registered with ``grad_fn._register_hook_dict`` as
    Tensor.register_hook does). Returns the hook dict and the entry's id (the way to remove it),
    or ``(None, handle)`` for a subclass, whose register_hook may do more."""
    if tensor.__class__ is not torch.Tensor:
        return None, tensor.register_hook(hook)
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = OrderedDict()
        if tensor.grad_fn is not None:
            tensor.grad_fn._register_hook_dict(tensor)
    hid = new_hook_id()
    hooks[hid] = hook
    return hooks, hid


def forward_hooks(module: torch.nn.Module):
    """``module._forward_hooks``: the dict register_forward_hook writes (ids -> hooks)."""
    return module._forward_hooks


def forward_pre_hooks(module: torch.nn.Module):
    """``module._forward_pre_hooks``: the dict register_forward_pre_hook writes."""
    return module._forward_pre_hooks


def pre_hooks_with_kwargs(module: torch.nn.Module):
    """``module._forward_pre_hooks_with_kwargs``: the ids of pre-hooks that take and may
    replace keyword arguments (``with_kwargs=True``)."""
    return module._forward_pre_hooks_with_kwargs


def submodules(module: torch.nn.Module) -> dict:
    """``module._modules``: the direct children by name, without building the
    named_children() generator (and including None entries, which it skips)."""
    return module._modules


# -- tensors --------------------------------------------------------------------------------
def version(tensor: torch.Tensor) -> int:
    """``tensor._version``: the in-place edit counter, the only way to tell that a body edited
    a handed-over tensor in place."""
    return tensor._version


def view_base(tensor: torch.Tensor):
    """``tensor._base``: the tensor a view was made from (None for a non-view)."""
    return tensor._base


# -- closures of torch's own hooks ----------------------------------------------------------
def closure_cells(fn) -> dict:
    """A function's closure cells by name ({} when it has none). parallelize_module's hooks and
    torch.utils.checkpoint's pack hooks keep their plan and state only there."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}


# -- torch.distributed -----------------------------------------------------------------------
def default_store():
    """``distributed_c10d._get_default_store()``: the key-value store of the default process
    group, where ranks leave failure notes and agreement states without a collective."""
    return dist.distributed_c10d._get_default_store()


def allgather_base(group):
    """The process group's ``_allgather_base`` (one flat all-gather without all_gather's Python
    checks), or None when the group has none."""
    return getattr(group, "_allgather_base", None)


def pipeline_schedule_class():
    """``torch.distributed.pipelining.schedules._PipelineSchedule``, the base of every schedule
    (no public base class), or None without pipelining."""
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
    except ImportError:
        return None
    return _PipelineSchedule


def schedule_stages(schedule) -> list:
    """A pipelining schedule's stages: ``_stages`` (multi-stage schedules) or ``_stage``."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else []
    return list(stages)


def schedule_microbatches(schedule) -> int:
    """``schedule._n_microbatches``: the step's microbatch count."""
    return schedule._n_microbatches


def schedule_loss_step(schedule):
    """``schedule._maybe_compute_loss``: computes one microbatch's loss on the last stage; the
    one place a pipeline step hands a loss to distgrad."""
    return schedule._maybe_compute_loss


def replace_schedule_loss_step(schedule, compute_loss) -> None:
    """Make ``compute_loss`` the schedule's ``_maybe_compute_loss`` (an instance attribute)."""
    schedule._maybe_compute_loss = compute_loss


def restore_schedule_loss_step(schedule) -> None:
    """Undo replace_schedule_loss_step: the class's ``_maybe_compute_loss`` shows again."""
    schedule.__dict__.pop("_maybe_compute_loss", None)


def schedule_last_loss(schedule):
    """``schedule._internal_losses[-1]``: the loss the step computed last."""
    return schedule._internal_losses[-1]


# -- torch.compile ---------------------------------------------------------------------------
def dynamo_imported() -> bool:
    """Whether ``torch._dynamo`` is imported: without it nothing can have been compiled."""
    return "torch._dynamo" in sys.modules


def compiled_original(obj):
    """The module inside ``torch.compile(obj)`` (``OptimizedModule._orig_mod``), or None."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.eval_frame import OptimizedModule

    return obj._orig_mod if isinstance(obj, OptimizedModule) else None


# -- CPython, for frames torch hands over --------------------------------------------------------
def locals_to_fast(frame) -> None:
    """``PyFrame_LocalsToFast`` via ctypes: writes ``frame.f_locals`` back into the frame's
    fast locals before Python 3.13, so names a trace body saved reach the code after the
    ``with`` block."""
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


def never_free(obj) -> None:
    """Take a reference to ``obj`` that nothing gives back: it lives until the process ends
    (module globals are cleared at exit, so a list would not do)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


# -- loss scaling (torch.amp.GradScaler) --------------------------------------------------------
def scaled_by(loss: torch.Tensor, scaler) -> bool:
    """Whether ``loss`` is ``scaler.scale(x)`` for some ``x``: its last operation multiplied by
    the scaler's own scale tensor (``GradScaler._scale``, which ``scale`` multiplies by as it
    is; no public API says which scaler, if any, scaled a tensor). Reads the multiplication's
    saved operand (``MulBackward0._saved_other``); False wherever that cannot be read."""
    scale = getattr(scaler, "_scale", None)
    node = loss.grad_fn
    if scale is None or node is None or type(node).__name__ != "MulBackward0":
        return False
    try:
        other = node._saved_other
    except RuntimeError:  # freed by an earlier backward, or changed in place since
        return False
    return other.data_ptr() == scale.data_ptr() and other.device == scale.device


def fsdp1_unsharded_grads(root) -> bool:
    """Whether some FSDP1 flat parameter under ``root`` holds an unsharded gradient: one
    accumulated by a backward inside ``no_sync()`` and not yet reduce-scattered. FSDP1's
    ``summon_full_params(with_grads=True)`` then fails an internal assertion; the handles
    (``_traversal_utils._get_fsdp_handles``) and the shard size (``FlatParameter._sharded_size``)
    have no public accessor."""
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    for handle in _get_fsdp_handles(root):
        flat = handle.flat_param
        if flat.grad is not None and flat.grad.size() != flat._sharded_size:
            return True
    return False


def fsdp1_grad_layout(root) -> tuple[bool, bool, int]:
    """(every FSDP1 flat parameter under ``root`` keeps its original parameters, every one is
    sharded, the size of the largest group a flat parameter is sharded over) - what decides
    whether an original parameter's ``.grad`` is this rank's piece of the reduced gradient.
    ``use_orig_params`` lives on the handle only (``FlatParamHandle._use_orig_params``)."""
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    handles = _get_fsdp_handles(root)
    keeps = all(h._use_orig_params for h in handles)
    sharded = all(h.uses_sharded_strategy for h in handles)
    group = max((dist.get_world_size(h.process_group) for h in handles), default=1)
    return keeps, sharded, group


def fsdp2_unsharded_params(root) -> list:
    """The unsharded parameters FSDP2 (``fully_shard``) swaps into the modules under ``root``
    for each forward: the leaves its backward accumulates into, which it reduce-scatters
    itself. They live on each ``FSDPParam`` (``_unsharded_param``), reached through the module's
    state (``_get_fsdp_state()._fsdp_param_groups``); nothing public lists them."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                found += [
                    p._unsharded_param for p in group.fsdp_params if hasattr(p, "_unsharded_param")
                ]
    return found


def fsdp1_flat_params(root) -> list:
    """FSDP1's flat parameters under ``root``: with ``use_orig_params=True`` the original
    parameters are views of them, and the backward accumulates into them
    (``_traversal_utils._get_fsdp_handles``; no public accessor)."""
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    return [handle.flat_param for handle in _get_fsdp_handles(root)]
