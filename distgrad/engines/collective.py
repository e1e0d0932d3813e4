"""Moving saved values to rank 0 in one collective, whatever their number.

Every rank packs, into one byte buffer, a header, the shape/dtype of each saved tensor and all
their bytes, and the ranks ``all_gather`` those buffers. ``all_gather`` needs one size on every
rank, so buffers are padded to a capacity the ranks agreed on in an earlier trace; a rank whose
saves do not fit sends only its header with the size it needs, every rank sees that, and the
ranks repeat once with the larger capacity. In a training loop with fixed shapes every trace
after the first costs exactly one collective, for S saved tensors as for one, and ranks may save
tensors of different sizes on the joined dimension (an uneven last batch).

Unpacking is planned once per layout (the ranks' shapes and dtypes) and cached: one
``index_select`` puts every tensor's parts from all ranks next to each other, and one
``unflatten_dense_tensors`` cuts the result into the global tensors, so the cost of a trace does
not grow with the number of saves beyond one attribute assignment each.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]
_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}
_MODES = ("rank0", "all")
_HEADER = 4  # int64s: fits (1 or 0), number of tensors, bytes needed in all, metadata length
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_flatten = torch._C._nn.flatten_dense_tensors
_unflatten = torch._C._nn.unflatten_dense_tensors


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


class Exchange:
    """One per engine: remembers the agreed buffer capacity and the unpacking plans."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.capacity = 0
        self._plans: dict = {}
        self._buffers = None  # (send, receive) for the current capacity, reused across traces

    @torch.no_grad()
    def __call__(self, saves: list) -> list:
        """Gather one trace's saves, ``(obj, mode, dim)`` in save order. Returns
        ``(tensor, global value)`` for each tensor this rank should replace. Raises ValueError
        on every rank alike when the ranks' saves do not line up."""
        items = [(t, mode, dim) for obj, mode, dim in saves if mode != "none"
                 for t in _tensors(obj, [])]
        tensors = [t for t, _, _ in items]
        meta = []
        for t, mode, dim in items:
            meta += [_CODE[t.dtype], _MODES.index(mode), dim, t.dim(), *t.shape]
        if tensors and all(t.dtype == tensors[0].dtype for t in tensors):
            payload = _flatten(tensors).view(torch.uint8)
        elif tensors:
            payload = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        else:
            payload = torch.empty(0, dtype=torch.uint8)
        needed = 8 * (_HEADER + len(meta)) + payload.numel()
        device = tensors[0].device if tensors else torch.device("cpu")
        while True:
            fits = needed <= self.capacity
            head = torch.tensor([int(fits), len(items), needed, len(meta)] + (meta if fits else []),
                                dtype=torch.int64).view(torch.uint8)
            size = max(self.capacity, 8 * _HEADER)
            buffer, gathered = self._buffers_for(size, device)
            buffer[: head.numel()] = head
            if fits and payload.numel():
                buffer[head.numel(): needed] = payload
            _all_gather(gathered, buffer, self.group)
            parts = gathered.view(self.world, size)
            heads = parts[:, : 8 * _HEADER].view(torch.int64).tolist()
            if all(h[0] for h in heads):
                break
            # headroom for growing shapes; a multiple of 8 so that the headers view as int64
            self.capacity = (max(h[2] for h in heads) * 5 // 4 + 7) // 8 * 8
        counts = [h[1] for h in heads]
        if len(set(counts)) != 1:
            raise ValueError(
                "ranks saved different numbers of tensors in one trace (" +
                ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)) + "). Save the same "
                "values on every rank, or use .save(gather='none') for rank-local values.")
        wanted = [i for i, (_, mode, _) in enumerate(items) if mode == "all" or self.rank == 0]
        if not wanted:
            return []
        width = max(h[3] for h in heads)
        metas = parts[:, 8 * _HEADER: 8 * (_HEADER + width)].view(torch.int64).tolist()
        layout = tuple(tuple(m[: h[3]]) for m, h in zip(metas, heads))
        plan = self._plans.get(layout)
        if plan is None:
            plan = self._plans[layout] = _Plan(layout, wanted, size)
        values = plan.apply(gathered)
        return [(items[i][0], v) for i, v in zip(wanted, values)]


    def _buffers_for(self, size: int, device):
        cached = self._buffers
        if cached is None or cached[0].numel() != size or cached[0].device != device:
            cached = self._buffers = (torch.empty(size, dtype=torch.uint8, device=device),
                                      torch.empty(self.world * size, dtype=torch.uint8,
                                                  device=device))
        return cached


class _Plan:
    """How to cut one layout of gathered buffers into the global tensors."""

    def __init__(self, layout: tuple, wanted: list[int], size: int):
        specs = [_parse(meta) for meta in layout]  # per rank: [(dtype, shape, offset, nbytes)]
        starts = [8 * (_HEADER + len(meta)) for meta in layout]
        fields = _field_offsets(layout[0])
        self.dims, self.shapes, pieces = [], [], []
        for i in wanted:
            dtype = specs[0][i][0]
            dim = layout[0][fields[i] + 2]
            shapes = [spec[i][1] for spec in specs]
            self.shapes.append((dtype, _joined_shape(shapes, dim)))
            self.dims.append(dim)
            for r, spec in enumerate(specs):
                _, _, offset, nbytes = spec[i]
                pieces.append(torch.arange(nbytes) + (r * size + starts[r] + offset))
        self.simple = all(d == 0 or len(s) == 0 for d, (_, s) in zip(self.dims, self.shapes)) \
            and len({dtype for dtype, _ in self.shapes}) == 1
        self.index = torch.cat(pieces)
        self.likes = [torch.empty(shape, dtype=dtype, device="meta") for dtype, shape in self.shapes]
        self.nbytes = [torch.Size(s).numel() * d.itemsize for d, s in self.shapes]
        self.specs, self.wanted = specs, wanted

    def apply(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        joined = gathered.index_select(0, self.index.to(gathered.device))
        if self.simple:
            return list(_unflatten(joined.view(self.shapes[0][0]), self.likes))
        # other joins (dim != 0) or mixed dtypes: cut per tensor
        out, at = [], 0
        for (dtype, shape), nbytes, dim, i in zip(self.shapes, self.nbytes, self.dims, self.wanted):
            chunk = joined[at: at + nbytes]
            at += nbytes
            if dim == 0 or len(shape) == 0:
                out.append(chunk.view(dtype).view(shape))
            else:
                parts, p_at = [], 0
                for spec in self.specs:
                    _, part_shape, _, part_bytes = spec[i]
                    parts.append(chunk[p_at: p_at + part_bytes].view(dtype).view(part_shape))
                    p_at += part_bytes
                out.append(torch.cat(parts, dim=dim))
        return out


def _field_offsets(meta: tuple) -> list[int]:
    offsets, at = [], 0
    while at < len(meta):
        offsets.append(at)
        at += 4 + meta[at + 3]
    return offsets


def _parse(meta: tuple) -> list:
    specs, offset = [], 0
    for at in _field_offsets(meta):
        dtype, ndim = _DTYPES[meta[at]], meta[at + 3]
        shape = tuple(meta[at + 4: at + 4 + ndim])
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        specs.append((dtype, shape, offset, nbytes))
        offset += nbytes
    return specs


def _joined_shape(shapes: list[tuple], dim: int) -> tuple:
    if len(shapes[0]) == 0:
        return (len(shapes),)  # 0-dim values are stacked to [world_size]
    rest = [s[:dim] + s[dim + 1:] for s in shapes]
    if any(r != rest[0] for r in rest) or any(len(s) != len(shapes[0]) for s in shapes):
        raise ValueError(f"saved tensors of shapes {[list(s) for s in shapes]} cannot be joined "
                         f"along dim {dim}: save them with .save(gather='none') or pad them to "
                         f"one shape.")
    return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]
