"""Tensor parallel: models split with ``torch.distributed.tensor.parallel.parallelize_module``.

What the body sees: every value whole, as on one process. A module's output, input or gradient
that is sharded across the tensor-parallel ranks - a local shard (``ColwiseParallel`` returns
one by default) or a ``DTensor`` (``SequenceParallel``'s norms) - is all-gathered when the body
asks for it: one collective per value the body visits, on every rank in the same order, because
every rank runs the same body. What the body assigns (or edits in place) is cut back to this
rank's shard before the run goes on; no collective is needed for that.

How a plain tensor's sharding is known: ``parallelize_module`` leaves no record of the plan, but
the hooks it registers close over the style's layouts (``torch/distributed/tensor/_api.py``,
``distribute_module``; ``parallel/style.py``). ``find_parallel_modules`` reads them once, at
``wrap``. A module that is not itself parallelized is taken to return replicated values (true for
every module of a Colwise/Rowwise plan); under sequence parallelism such modules (a decoder layer)
return sequence shards with no mark on them: name those in ``wrap(..., tp_shards={path: dim})``.

Gradients: ``x.grad`` of a value shown whole hooks the tensor that really flows on (the local
shard or the DTensor) and gathers its gradient the same way; an assignment is cut back.

The shown value is a differentiable function of the shard (``DTensor.full_tensor()``), and an
edited value flows on as a slice of it, so autograd sees the same edit as on one process; the
backward of that slice is local (no collective).

``.local`` opts out per request: ``model.model.layers[0].mlp.up_proj.local.output`` is this rank's
shard as the module returned it, with no communication.

Parameter gradients: tensor-parallel weights are DTensors; ``.grad`` through distgrad is the full
gradient (``full_tensor()``) and assignment stores this rank's part, as with FSDP2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..torch_internals import closure_cells, forward_hooks, forward_pre_hooks, pytree, version
from .base import ShardViews
from .ddp import DDPEngine
from .fsdp2 import FSDP2Engine, ShardedParam, is_fully_sharded
from .ranks import Agreement, DistributedEngine


# -- reading the plan back from the hooks ----------------------------------------------------
def _style(fn) -> str:
    func = getattr(fn, "func", fn)
    return getattr(func, "__qualname__", "").split(".")[0]


def _output_placement(module):
    """(mesh, placement of the plain tensor the module returns) for a parallelized module, or
    (mesh, None) when it returns replicated values or DTensors, or None if not parallelized."""
    mesh, placement, parallel = None, None, False
    seq_dim = None
    for hook in forward_pre_hooks(module).values():
        cells = closure_cells(hook)
        if "device_mesh" in cells and ("input_fn" in cells or "self" in cells):
            mesh, parallel = cells["device_mesh"], True
            fn = cells.get("input_fn")
            if fn is not None and _style(fn) == "SequenceParallel":
                seq_dim = fn.args[0][0]
    for hook in forward_hooks(module).values():
        cells = closure_cells(hook)
        if "device_mesh" not in cells:
            continue
        mesh, parallel = cells["device_mesh"], True
        fn, style = cells.get("output_fn"), cells.get("self")
        if fn is not None and _style(fn) in ("ColwiseParallel", "RowwiseParallel"):
            layouts, use_local = fn.args
            placement = layouts[0] if use_local else None
        elif fn is not None and _style(fn) == "SequenceParallel":
            placement = seq_dim if fn.args[0] else None
        elif style is not None and type(style).__name__ == "PrepareModuleOutput":
            layouts = style.desired_output_layouts
            placement = layouts[0] if style.use_local_output else None
    if not parallel:
        return None
    if placement is not None and placement.is_replicate():
        placement = None
    return mesh, placement


def find_parallel_modules(model: torch.nn.Module) -> dict:
    """``{module: (mesh, placement or None)}`` for every module ``parallelize_module`` touched."""
    found = {}
    for module in model.modules():
        info = _output_placement(module)
        if info is not None:
            found[module] = info
    return found


# -- whole values and shards -----------------------------------------------------------------
def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def _norm(placement, ndim: int):
    from torch.distributed.tensor import Shard

    if placement.is_shard() and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def _whole(local: torch.Tensor, mesh, placements) -> torch.Tensor:
    """The full tensor of a plain shard (differentiable; one all-gather)."""
    placements = [_norm(p, local.dim()) for p in placements]
    # clone: full_tensor() returns a view made inside a custom Function, which autograd would
    # not let the body edit in place
    return _dtensor().from_local(local, mesh, placements, run_check=False).full_tensor().clone()


def _piece(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's part of ``full`` under ``placements`` (local; differentiable)."""
    piece = full
    for mesh_dim, placement in enumerate(placements):
        coord, size = mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)
        if placement.is_shard():
            piece = torch.chunk(piece, size, dim=placement.dim % full.dim())[coord]
        elif placement.is_partial():
            piece = piece if coord == 0 else piece * 0
    return piece.contiguous()


class _Joined(torch.autograd.Function):
    """The ranks' shards joined along ``dim``, as a function of this rank's shard: its gradient
    is the matching slice of the whole's (local, as for ``DTensor.full_tensor()``)."""

    @staticmethod
    def forward(ctx, local, dim, coord, *pieces):
        ctx.dim, ctx.size, ctx.pieces = dim, local.shape[dim], len(pieces)
        ctx.start = sum(piece.shape[dim] for piece in pieces[:coord])
        return torch.cat([local if i == coord else piece for i, piece in enumerate(pieces)], dim)

    @staticmethod
    def backward(ctx, grad):
        return (grad.narrow(ctx.dim, ctx.start, ctx.size), None, None) + (None,) * ctx.pieces


class TensorParallelViews(ShardViews):
    """Shows the body whole values and puts its replies back as shards (see the module text):
    the ``ShardViews`` of tensor parallelism. A token is ``(pytree spec, leaves, converted,
    label)``; a split is ``(mesh, placements, is a DTensor, shape, stride)``."""

    def __init__(self, parallel: dict, shards: dict | None = None):
        self.parallel = parallel
        self.mesh = next(iter(parallel.values()))[0]
        from torch.distributed.tensor import Shard

        for module, dim in (shards or {}).items():
            self.parallel[module] = (self.mesh, Shard(dim))
        self.sources: dict = {}  # id(whole) -> (whole, tensor that flows on, how it is split)
        self.agreement = None  # an Agreement where the mesh is on the CPU (select_engine)

    def clear(self) -> None:
        """Let go of the trace's whole values and the shards they came from."""
        self.sources.clear()

    # -- hook values ---------------------------------------------------------------------
    def show(self, kind: str, module, value, label: str = "the value"):
        """``(whole value, token)``; token None when nothing was sharded. A DTensor leaf is
        sharded as it says; a plain tensor where the module's output placement is a shard."""
        DTensor = _dtensor()
        plain = self.parallel.get(module, (None, None))[1] if kind == "output" else None
        if isinstance(value, torch.Tensor) and plain is None and not isinstance(value, DTensor):
            return value, None
        leaves, spec = pytree.tree_flatten(value)
        shown, converted = list(leaves), []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, DTensor):
                split = (leaf.device_mesh, tuple(leaf.placements), True, leaf.shape, leaf.stride())
                whole = self._gathered(
                    leaf.to_local(), split[0], split[1], label, lambda: leaf.full_tensor().clone()
                )  # editable (_whole)
            elif plain is not None and isinstance(leaf, torch.Tensor):
                split = (self.mesh, (plain,), False, None, None)
                whole = self._gathered(
                    leaf, self.mesh, split[1], label, lambda: _whole(leaf, self.mesh, split[1])
                )
            else:
                continue
            shown[i] = whole
            converted.append((i, whole, version(whole), split))
            self.sources[id(whole)] = (whole, leaf, split)
        if not converted:
            return value, None
        return pytree.tree_unflatten(shown, spec), (spec, leaves, converted, label)

    def place(self, token, reply):
        """The reply the hook returns: the body's whole values cut back to shards (None: the
        body changed nothing). A cut tensor is entered in ``sources``, so that its gradient is
        hooked on the shard."""
        spec, leaves, converted, label = token
        if reply is None:  # edited in place, if at all
            if all(version(whole) == seen for _, whole, seen, _ in converted):
                return None
            new_leaves = list(leaves)
            for i, whole, _, _ in converted:
                new_leaves[i] = whole
        else:
            new_leaves, reply_spec = pytree.tree_flatten(reply)
            if reply_spec != spec:
                raise ValueError(
                    f"{label} = ...: under tensor parallelism a replacement must have the "
                    f"structure of the value it replaces, so that distgrad can cut it back to "
                    f"shards; it was {spec}, the replacement is {reply_spec}. Replace the tensors "
                    f"inside it instead (e.g. out = list(value); out[0] = ...; assign tuple(out))."
                )
        out = list(new_leaves)
        for i, _, _, split in converted:
            new = new_leaves[i]
            if isinstance(new, torch.Tensor):
                out[i] = self._cut(new, split)
                self.sources[id(new)] = (new, out[i], split)
        return pytree.tree_unflatten(out, spec)

    def _cut(self, whole: torch.Tensor, split):
        mesh, placements, is_dtensor, shape, stride = split
        piece = _piece(whole, mesh, placements)
        if is_dtensor:
            return _dtensor().from_local(
                piece, mesh, placements, run_check=False, shape=shape, stride=stride
            )
        return piece

    def output_holders(self, module) -> list[int] | None:
        """This rank's tensor-parallel group, unless the plan or ``tp_shards`` says the plain
        tensor ``module`` returns is a shard (None)."""
        if self.parallel.get(module, (None, None))[1] is not None:
            return None
        return sorted(dist.get_process_group_ranks(self.mesh.get_group()))

    # -- gradients -----------------------------------------------------------------------
    def source(self, tensor):
        """(the tensor to hook, how its gradient is split) for a value shown whole, or None."""
        entry = self.sources.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            return None
        return entry[1], entry[2]

    def show_grad(self, split, grad):
        """The whole gradient, gathered as ``split`` says (or as the DTensor ``grad`` says)."""
        mesh, placements, is_dtensor, _, _ = split
        label = f"a gradient of shape {tuple(grad.shape)}"
        with torch.no_grad():
            if isinstance(grad, _dtensor()):
                split = (grad.device_mesh, tuple(grad.placements), True, grad.shape, grad.stride())
                return self._gathered(
                    grad.to_local(), split[0], split[1], label, grad.full_tensor
                ), split
            return self._gathered(
                grad, mesh, placements, label, lambda: _whole(grad, mesh, placements)
            ), split

    def _gathered(self, local: torch.Tensor, mesh, placements, label: str, otherwise):
        """The whole of a shard through the agreement's one collective, which also checks that
        every rank is at this value (ranks/agreement.py). Where the mesh is not on the CPU or the
        value is not one shard of a 1-D mesh: an agreement (on the CPU), then ``otherwise()``
        (DTensor's gather)."""
        if (
            self.agreement is None
            or len(placements) != 1
            or not placements[0].is_shard()
            or mesh != self.mesh
            or local.dim() == 0
        ):
            self._agree(label)
            return otherwise()
        coord = mesh.get_local_rank()
        pieces = self.agreement.gather(label, local, coord)
        return _Joined.apply(local, placements[0].dim % local.dim(), coord, *pieces)

    def _agree(self, label: str) -> None:
        """Every rank is at this value before the gather (ranks/agreement.py)."""
        if self.agreement is not None:
            self.agreement.agree(label)

    def place_grad(self, split, whole):
        """This rank's part of ``whole``, outside autograd (a gradient hook's return)."""
        with torch.no_grad():
            return self._cut(whole, split)


class TensorParallelEngine(DistributedEngine):
    """A model split by ``parallelize_module`` on one tensor-parallel mesh, with no data
    parallelism: every rank holds the same (whole) values, so saves are not gathered."""

    name = "tp"
    sharded_params = True

    def __init__(self, model: torch.nn.Module, views: TensorParallelViews):
        super().__init__(model, group=dist.group.WORLD, gather=False)
        self.views = views

    def param(self, param, path):
        return ShardedParam(param, path, self.agree) if isinstance(param, _dtensor()) else param


def select_engine(obj: torch.nn.Module, parallel: dict, shards: dict | None):
    """The engine for a model ``parallelize_module`` touched: tensor parallel alone, or under
    FSDP2 / DDP on the other dimension of a 2-D mesh (saves are gathered over that one)."""
    model = obj.module if isinstance(obj, DistributedDataParallel) else obj
    named = {}
    for name, dim in (shards or {}).items():
        try:
            named[model.get_submodule(name)] = dim
        except AttributeError:
            raise ValueError(
                f"distgrad.wrap(..., tp_shards={{{name!r}: {dim}}}): the model has "
                f"no module {name!r}; use names as model.named_modules() gives "
                f"them, e.g. 'model.layers.0'."
            ) from None
    views = TensorParallelViews(parallel, named)
    if isinstance(obj, DistributedDataParallel):
        engine = DDPEngine(obj)
    elif is_fully_sharded(obj):
        engine = FSDP2Engine(obj, group=_data_group(obj, views.mesh))
    else:
        engine = TensorParallelEngine(obj, views)
    engine.views = views
    if views.mesh.device_type == "cpu":  # no gather waits forever (ranks/agreement.py)
        views.agreement = Agreement(engine, "views", views.mesh)
    return engine


def _data_group(model: torch.nn.Module, tp_mesh):
    """The process group of the data-parallel dimension of an FSDP2 x TP model's mesh."""
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    DTensor = _dtensor()
    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        if mesh.ndim == 1 and (not names or names[0] != tp_name):
            return mesh.get_group()
        others = [n for n in names if n != tp_name]
        if mesh.ndim == 2 and len(others) == 1:
            return mesh[others[0]].get_group()
    raise NotImplementedError(
        "distgrad found tensor parallelism under fully_shard but could not tell the data-parallel "
        "dimension of the mesh: build it with init_device_mesh(..., mesh_dim_names=('dp', 'tp')) "
        "and shard with fully_shard(model, mesh=mesh['dp'])."
    )
