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
_HEADER = 5  # int64s: fits (1 or 0), number of tensors, bytes needed in all, metadata length,
            # same layout as this rank's previous trace (1 or 0)
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
    """One per engine: remembers the agreed buffer capacity, the unpacking plans, and the layout
    of the previous trace (a training loop saves the same shapes every step)."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.capacity = 0
        self._plans: dict = {}
        self._buffers = None  # (send, receive) for the current capacity, reused across traces
        self._last = None     # (layout key, header tensor, plan) of this rank's previous trace

    @torch.no_grad()
    def __call__(self, saves: list) -> list:
        """Gather one trace's saves, ``(obj, mode, dim)`` in save order. Returns
        ``(tensor, global value)`` for each tensor this rank should replace. Raises ValueError
        on every rank alike when the ranks' saves do not line up."""
        items = [(t, mode, dim) for obj, mode, dim in saves if mode != "none"
                 for t in _tensors(obj, [])]
        tensors = [t for t, _, _ in items]
        key = tuple((t.dtype, mode, dim, t.shape) for t, mode, dim in items)
        last = self._last
        same = last is not None and last[0] == key
        self._last = None  # set again only when this trace's exchange completes
        if tensors and (same or all(t.dtype == tensors[0].dtype for t in tensors)) and \
                (not same or last[3]):
            payload = _flatten(tensors).view(torch.uint8)  # one dtype: one C++ call
        elif tensors:
            payload = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        else:
            payload = torch.empty(0, dtype=torch.uint8)
        nbytes = payload.numel()
        if same:
            head = last[1]  # flags already say "fits" and "same layout as before"
        else:
            meta = []
            for t, mode, dim in items:
                meta += [_CODE[t.dtype], _MODES.index(mode), dim, t.dim(), *t.shape]
            head = torch.tensor([1, len(items), 8 * (_HEADER + len(meta)) + nbytes,
                                 len(meta), 0] + meta, dtype=torch.int64).view(torch.uint8)
        needed = head.numel() + nbytes
        device = tensors[0].device if tensors else torch.device("cpu")
        while True:
            fits = needed <= self.capacity
            size = max(self.capacity, 8 * _HEADER)
            buffer, gathered = self._buffers_for(size, device)
            if fits:
                buffer[: head.numel()] = head
                if nbytes:
                    buffer[head.numel(): needed] = payload
            else:  # only the header's first fields: the others learn the size this rank needs
                buffer[: 8 * _HEADER] = head[: 8 * _HEADER]
                buffer[:8].view(torch.int64).fill_(0)
            _all_gather(gathered, buffer, self.group)
            heads = self._buffers[2].tolist()  # every rank's header fields
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
        if all(h[4] for h in heads) and last[2].size == size:
            plan = last[2]  # every rank saved what it saved last time: the same plan holds
        else:
            wanted = [i for i, (_, mode, _) in enumerate(items) if mode == "all" or self.rank == 0]
            width = max(h[3] for h in heads)
            parts = gathered.view(self.world, size)
            metas = parts[:, 8 * _HEADER: 8 * (_HEADER + width)].view(torch.int64).tolist()
            layout = tuple(tuple(m[: h[3]]) for m, h in zip(metas, heads))
            plan = self._plans.get((layout, size))
            if plan is None:
                plan = self._plans[(layout, size)] = _Plan(layout, wanted, size, self.world)
        if not same:  # next time, if the layout repeats: say so in the header
            head = head.clone()
            head[32:40].view(torch.int64).fill_(1)
        one_dtype = len({t.dtype for t in tensors}) <= 1 if not same else last[3]
        self._last = (key, head, plan, one_dtype)
        if not plan.wanted:
            return []
        values = plan.apply(gathered)
        return [(items[i][0], v) for i, v in zip(plan.wanted, values)]

    def _buffers_for(self, size: int, device):
        cached = self._buffers
        if cached is None or cached[0].numel() != size or cached[0].device != device:
            gathered = torch.empty(self.world * size, dtype=torch.uint8, device=device)
            heads = gathered.view(self.world, size)[:, : 8 * _HEADER].view(torch.int64)
            cached = self._buffers = (torch.empty(size, dtype=torch.uint8, device=device),
                                      gathered, heads)
        return cached[0], cached[1]


class _Plan:
    """How to cut one layout of gathered buffers into the global tensors.

    Three ways, fastest first: when every rank saved the same shapes of one dtype, joined on dim
    0, the gathered payloads are ``[world, S, n]`` blocks and one transposing copy puts each
    tensor's parts together; with one dtype and dim-0 joins otherwise, one ``index_select`` of
    elements does; anything else (other dims, mixed dtypes) is cut tensor by tensor."""

    def __init__(self, layout: tuple, wanted: list[int], size: int, world: int):
        specs = [_parse(meta) for meta in layout]  # per rank: [(dtype, shape, offset, nbytes)]
        starts = [8 * (_HEADER + len(meta)) for meta in layout]
        fields = _field_offsets(layout[0])
        self.size, self.world, self.wanted, self.specs = size, world, wanted, specs
        self.starts = starts
        self.dims, self.shapes = [], []
        for i in wanted:
            dtype = specs[0][i][0]
            dim = layout[0][fields[i] + 2]
            shapes = [spec[i][1] for spec in specs]
            self.shapes.append((dtype, _joined_shape(shapes, dim)))
            self.dims.append(dim)
        self.likes = [torch.empty(shape, dtype=dtype, device="meta") for dtype, shape in self.shapes]
        self.nbytes = [torch.Size(s).numel() * d.itemsize for d, s in self.shapes]
        dtypes = {dtype for dtype, _ in self.shapes}
        simple = all(d == 0 or len(s) == 0 for d, (_, s) in zip(self.dims, self.shapes)) \
            and len(dtypes) == 1 and all(spec[0] == s[0][0] for s in specs for spec in s)
        self.mode = "cut"
        self._view = None
        if not simple or not wanted:
            return
        self.dtype = dtype = dtypes.pop()
        sizes = {spec[3] for s in specs for spec in s}
        if (wanted == list(range(len(specs[0]))) and len(sizes) == 1 and len(set(starts)) == 1
                and len(set(layout)) == 1):
            # even shapes on every rank: rank r's payload is an [S, n] block at one offset
            self.mode = "transpose"
            self.block = (starts[0] // dtype.itemsize, len(wanted), sizes.pop() // dtype.itemsize)
            return
        self.mode = "index"
        pieces = []
        for i in wanted:
            for r, spec in enumerate(specs):
                _, _, offset, nbytes = spec[i]
                first = (r * size + starts[r] + offset) // dtype.itemsize
                pieces.append(torch.arange(first, first + nbytes // dtype.itemsize))
        self.index = torch.cat(pieces)

    def apply(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        if self.mode == "transpose":
            cached = self._view
            if cached is None or cached[0] is not gathered:  # the receive buffer is reused
                start, count, n = self.block
                rows = gathered.view(self.dtype).view(self.world, -1)
                blocks = rows[:, start: start + count * n].view(self.world, count, n)
                cached = self._view = (gathered, blocks.transpose(0, 1))
            return list(_unflatten(cached[1].reshape(-1), self.likes))
        if self.mode == "index":
            joined = gathered.view(self.dtype).index_select(0, self.index.to(gathered.device))
            return list(_unflatten(joined, self.likes))
        # other joins (dim != 0) or mixed dtypes: cut per tensor
        rows, out = gathered.view(self.world, self.size), []
        for (dtype, shape), dim, i in zip(self.shapes, self.dims, self.wanted):
            parts = []
            for r, spec in enumerate(self.specs):
                _, part_shape, offset, nbytes = spec[i]
                at = self.starts[r] + offset
                parts.append(rows[r, at: at + nbytes].view(dtype).view(part_shape))
            out.append(torch.stack(parts) if len(shape) == 0 else torch.cat(parts, dim=dim))
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
