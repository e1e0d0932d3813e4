"""Sums of squares over the job: what one rank puts in a step's vector, and the step's norms from
every rank's vector.

A global norm must count each element of a gradient once. A rank's tensor is held by ``copies``
ranks in all (its own rows: 1; the reduced gradient under DDP: every rank; a tensor-parallel
value not sharded: its tensor-parallel group; a DTensor: the ranks its placements replicate it
over, times the ranks outside its mesh), so each rank adds its squares divided by ``copies``.

Two things need the other ranks' numbers, and ride in the same vector:

* Ranks said to hold the same activation (a group, by its smallest rank, the *key*) must have
  the same squares: a value that is in truth a shard (sequence parallel, undeclared) differs,
  and the step raises instead of dividing it.
* A ``Partial`` DTensor gradient (sequence-parallel norm weights: each rank's sum over its own
  positions) has no norm of its own: the rank sends its local tensor, padded to the largest
  local shape, and the sums over each group of partial holders are squared after the gather.
  That reads every rank's pieces at this rank's offsets, so it needs every rank to send the
  same parameters' pieces. They usually do (the ranks run one program, and DTensor's sharding
  rules give each gradient the same placements everywhere), but a ``.grad`` that is None on
  some ranks only (a parameter unused on their data, gradients cleared on some ranks) would
  shift the offsets, or change the vector's length and fail the all_gather itself. So where
  the recorded layers hold DTensor parameters, ``check_partial_layout`` first gathers each
  rank's layout (a few floats per layer) and raises on every rank where they differ.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

AGREE_RTOL = 1e-3  # copies of one value: equal up to reduction order, shards differ far more


def mesh_ranks(mesh, placements, free) -> list[int]:
    """The ranks of ``mesh`` at this rank's coordinate, every dim whose placement ``free(p)``
    says let run: the ranks that hold the same piece (Replicate) or its partial sums (Partial)."""
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if free(p) else c for p, c in zip(placements, coord))
    return sorted(int(r) for r in mesh.mesh[index].flatten().tolist())


def dtensor_copies(tensor, world: int) -> tuple[list[int], int]:
    """(the ranks of its mesh holding this rank's piece, the ranks of the job holding it)."""
    mesh = tensor.device_mesh
    replicas = mesh_ranks(mesh, tensor.placements, lambda p: p.is_replicate())
    return replicas, len(replicas) * max(world // mesh.size(), 1)


class Activation:
    """One layer's activation-gradient squares on this rank over a step (summed over the
    step's backward passes), and who else holds the same value."""

    def __init__(self):
        self.squares, self.copies, self.key = None, 1, -1.0

    def add(self, grad, holders: list[int] | None, world: int, what: str) -> None:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise NotImplementedError(
                    f"distgrad.flow: the gradient reaching {what} is a Partial DTensor (each "
                    f"rank holds a sum to be reduced); its norm needs a collective of its own. "
                    f"Record a module whose output is a plain tensor or a Shard/Replicate DTensor."
                )
            holders, self.copies = dtensor_copies(grad, world)
            grad = grad.to_local()
        else:
            self.copies = len(holders) if holders else 1
        self.key = float(min(holders)) if holders and len(holders) > 1 else -1.0
        squares = grad.detach().float().pow(2).sum()  # stays on the device: no sync here
        self.squares = squares if self.squares is None else self.squares + squares


class Params:
    """One layer's parameter-gradient squares on this rank: held, this rank's share of the
    global sum, and the partial pieces whose share is known only after the gather, each with
    its parameter's index in the module (``index_of(grad)``: for the layout check)."""

    def __init__(self, pieces: list, world: int, zero, index_of=lambda grad: -1):
        held, share, self.partial = [zero], [zero], []
        for grad, copies in pieces:
            if isinstance(grad, DTensor):
                local = grad.to_local().detach().float()
                if any(p.is_partial() for p in grad.placements):
                    self.partial.append((index_of(grad), partial_entry(grad, local, world)))
                    held.append(local.pow(2).sum())
                    continue
                copies = dtensor_copies(grad, world)[1] if copies is None else copies
                grad = local
            squares = grad.detach().float().pow(2).sum()
            held.append(squares)
            share.append(squares / (world if copies is None else copies))
        self.held, self.share = torch.stack(held).sum(), torch.stack(share).sum()


def partial_entry(grad, local, world: int) -> torch.Tensor:
    """[key, weight, the local tensor padded to the largest local shape]: the key names the
    group of ranks whose pieces sum to one piece of the gradient; weight is 1 / the groups
    holding that same piece (replicas and ranks outside the mesh)."""
    mesh, placements = grad.device_mesh, grad.placements
    group = mesh_ranks(mesh, placements, lambda p: p.is_partial())
    copies = dtensor_copies(grad, world)[1]
    shape = list(grad.shape)
    for dim, p in enumerate(placements):
        if p.is_shard():
            shape[p.dim] = math.ceil(shape[p.dim] / mesh.size(dim))
    padded = torch.zeros(math.prod(shape), dtype=torch.float32, device=local.device)
    padded[: local.numel()] = local.reshape(-1)
    head = torch.tensor([float(min(group)), 1.0 / copies], device=local.device)
    return torch.cat([head, padded])


def partial_layout(params: list[Params]) -> torch.Tensor:
    """Per layer: how many partial pieces, their length in the vector, and which parameters
    (a sum of 2 ** index: equal sums, the same parameters)."""
    layout = torch.zeros(len(params), 3, dtype=torch.float64)
    for layer, p in enumerate(params):
        for index, piece in p.partial:
            layout[layer] += torch.tensor(
                [1.0, piece.numel(), 2.0 ** (index % 52)], dtype=torch.float64
            )
    return layout


def check_partial_layout(layout: torch.Tensor, world: int, device, paths: list[str]) -> None:
    """Every rank sends the same parameters' partial pieces, or every rank raises (one
    all_gather of the layouts, before the step's own)."""
    vector = layout.flatten().to(device)
    parts = [torch.empty_like(vector) for _ in range(world)]
    dist.all_gather(parts, vector)
    rows = torch.stack(parts).cpu().view(world, *layout.shape)
    for layer, path in enumerate(paths):
        if not torch.equal(rows[:, layer], rows[:1, layer].expand_as(rows[:, layer])):
            counts = rows[:, layer, 0].long().tolist()
            raise RuntimeError(
                f"distgrad.flow: the ranks hold different Partial (unreduced) DTensor gradients "
                f"at {path} (pieces per rank: {counts}; or of different parameters): a "
                f"parameter's .grad is None on some ranks only, or was replaced on some. Its "
                f"global norm needs every rank's piece of the same gradients. Run every "
                f"parameter of the recorded layers on every rank and clear gradients on every "
                f"rank alike, or leave such a layer out of layers=."
            )


def check_copies(rows: torch.Tensor, keys: torch.Tensor, paths: list[str]) -> None:
    """Ranks with one key at a layer hold one value: their squares must agree."""
    for layer, path in enumerate(paths):
        for key in set(keys[:, layer].tolist()) - {-1.0}:
            members = (keys[:, layer] == key).nonzero().flatten().tolist()
            values = rows[members, layer]
            if not torch.allclose(values, values[0].expand_as(values), rtol=AGREE_RTOL, atol=0):
                raise RuntimeError(
                    f"distgrad.flow: {path} returns a value distgrad takes to be the same on "
                    f"ranks {members} (not sharded among them), but the gradients reaching it "
                    f"differ ({values.sqrt().tolist()}): each rank holds a shard of it (sequence "
                    f"parallelism?). Declare it: distgrad.wrap(model, tp_shards={{{path!r}: "
                    f"<the dim it is split on>}})."
                )


def partial_squares(rows: torch.Tensor, entries: list[tuple[int, int, int]], layers: int):
    """Per layer, the global squares of the partial pieces: ``entries`` (layer, start, length)
    locate each one in the rows; every group of partial holders sums its pieces first."""
    total = torch.zeros(layers, dtype=rows.dtype)
    for layer, start, length in entries:
        keys, weights = rows[:, start], rows[:, start + 1]
        pieces = rows[:, start + 2 : start + length]
        for key in set(keys.tolist()):
            members = (keys == key).nonzero().flatten()
            total[layer] += pieces[members].sum(0).pow(2).sum() * weights[members[0]]
    return total
