"""Ragged saves: tensors whose shapes differ between the ranks outside the join dim (a batch
padded by each rank to its own sequence length), and how their global value is laid out.

The global value of a ragged save is one tensor padded to the largest rank's size in every
dim but the join dim (there the ranks' sizes add up, as for any save) and filled with NaN
where no rank has data, so that padding cannot pass for numbers: any sum or mean over it is
NaN. Each rank's own tensor is a view of it, ``rank_parts(value)``. NaN exists in floating
and complex dtypes only; a ragged save of another dtype raises instead.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

# the saved tensors the gather made ragged values of: tensor -> (padded shape, dim, per-rank
# shapes); keyed by the tensor object the user holds (its .data was replaced, the object kept)
RAGGED_SHAPES = WeakIdKeyDictionary()


def is_ragged(shapes: list[tuple], dim: int) -> bool:
    """Whether the ranks' shapes (of one number of dims) differ outside ``dim``."""
    first = shapes[0]
    return any(
        any(size != first[d] for d, size in enumerate(shape) if d != dim) for shape in shapes
    )


def padded_shape(shapes: list[tuple], dim: int) -> tuple:
    """The global shape of a ragged save: the sizes on ``dim`` added up, the others the
    largest rank's."""
    return tuple(
        sum(s[d] for s in shapes) if d == dim else max(s[d] for s in shapes)
        for d in range(len(shapes[0]))
    )


def region(shape: tuple, dim: int, at: int) -> tuple:
    """The index of a rank's part (of ``shape``, starting at ``at`` on ``dim``) in the global
    value."""
    return tuple(
        slice(at, at + size) if d == dim else slice(0, size) for d, size in enumerate(shape)
    )


def check_paddable(dtype: torch.dtype, shapes: list[tuple], dim: int, name: str) -> None:
    """Raise, on every rank alike, for a ragged save whose dtype holds no NaN to pad with."""
    if dtype.is_floating_point or dtype.is_complex:
        return
    raise ValueError(
        f"{name} has shapes {[list(s) for s in shapes]} on the ranks, which "
        f"differ outside the join dim {dim}: its global value would be padded with NaN, which "
        f"{dtype} cannot hold. Save it with .save(gather='none') (each rank keeps its own), "
        f"save it as a float (.float().save()), or pad it to one shape on every rank."
    )


def mark_ragged(tensor: torch.Tensor, shape: tuple, dim: int, shapes: list[tuple]) -> None:
    """Note that the gather gives ``tensor`` the ragged value of global ``shape``."""
    RAGGED_SHAPES[tensor] = (tuple(shape), dim, shapes)


def rank_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's own tensor of a ragged save, in rank order: views of its global value
    without the NaN padding, of the shapes the ranks saved.

    A ragged save is one whose ranks saved tensors of different shapes outside the join dim
    (``.save(dim=...)``, 0 by default), e.g. activations of batches each rank padded to its own
    sequence length. Where the gather delivered it (rank 0, or every rank with
    ``gather="all"``) it is one tensor padded with NaN; elsewhere the rank's own.

    Raises ValueError for any other tensor (one process; a rank that kept its own; a save whose
    ranks' shapes agreed outside the join dim): it carries no shapes to cut it by. ::

        with model.trace(batch):     # rank 0: 2 rows of 24 tokens, rank 1: 2 rows of 30
            h = model.transformer.h[0].output.save()
        if dist.get_rank() == 0:     # h: [4, 30, 64], NaN in rows 0-1 after token 24
            first, second = distgrad.rank_parts(h)   # [2, 24, 64], [2, 30, 64]
    """
    entry = RAGGED_SHAPES.get(tensor)
    if entry is None or entry[0] != tuple(tensor.shape):
        raise ValueError(
            f"rank_parts() takes a ragged save as the gather delivered it (padded with NaN, on "
            f"rank 0 or with gather='all' on every rank); this tensor of shape "
            f"{list(tensor.shape)} is not one. A save whose ranks' shapes agree outside the "
            f"join dim is the ranks' tensors joined: split it with torch.split."
        )
    _, dim, shapes = entry
    parts, at = [], 0
    for shape in shapes:
        parts.append(tensor[region(shape, dim, at)])
        at += shape[dim]
    return parts
