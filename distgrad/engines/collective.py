"""Moving saved values to rank 0 in a constant number of collectives, whatever their number.

One ``all_gather_object`` carries every rank's status and the shapes/dtypes of its saves; one
``all_gather`` carries all their bytes, each rank's packed into one padded buffer. So S saved
tensors cost the same three collectives (the object gather is two) as one, and ranks may
save tensors of different shapes (an uneven last batch).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tensors(obj, out: list):
    """The tensors inside a saved value, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _tensors(v, out)
    return out


def exchange(saves: list, group, rank: int, world: int) -> list:
    """Gather the saves of one trace. ``saves``: (obj, gather mode, dim) in save order.

    Returns, per tensor that travels, (tensor, global value or None) for this rank to apply.
    Raises ValueError on every rank alike when the ranks' saves do not line up.
    """
    items = [(t, mode, dim) for obj, mode, dim in saves if mode != "none"
             for t in _tensors(obj, [])]
    meta = [(tuple(t.shape), str(t.dtype).removeprefix("torch."), mode, dim) for t, mode, dim in items]
    metas: list = [None] * world
    dist.all_gather_object(metas, meta, group=group)
    counts = [len(m) for m in metas]
    if len(set(counts)) != 1:
        raise ValueError(
            "ranks saved different numbers of tensors in one trace (" +
            ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)) + "). Save the same "
            "values on every rank, or use .save(gather='none') for rank-local values.")
    if not items:
        return []
    device = items[0][0].device
    payload = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t, _, _ in items]
    flat = torch.cat(payload) if payload else torch.empty(0, dtype=torch.uint8, device=device)
    sizes = [sum(_nbytes(shape, dtype) for shape, dtype, _, _ in m) for m in metas]
    buffer = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    buffer[: flat.numel()] = flat
    gathered = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(gathered, buffer, group=group)
    results = []
    offsets = [0] * world
    for i, (tensor, mode, dim) in enumerate(items):
        parts = []
        for r in range(world):
            shape, dtype, _, _ = metas[r][i]
            n = _nbytes(shape, dtype)
            raw = gathered[r][offsets[r]: offsets[r] + n]
            offsets[r] += n
            parts.append(raw.view(getattr(torch, dtype)).reshape(shape))
        if mode == "rank0" and rank != 0:
            continue
        results.append((tensor, _join(parts, dim)))
    return results


def _nbytes(shape, dtype: str) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _join(parts: list, dim: int) -> torch.Tensor:
    if parts[0].dim() == 0:
        return torch.stack(parts)
    try:
        return torch.cat(parts, dim=dim)
    except RuntimeError as exc:
        raise ValueError(f"saved tensors of shapes {[list(p.shape) for p in parts]} cannot be "
                         f"joined along dim {dim}: save them with .save(gather='none') or pad "
                         f"them to one shape.") from exc
