"""How a rank's saves are laid out in the gather's buffers, and how the received bytes are cut
back into global values (``engines/ranks/gather.py`` moves the bytes).

A layout is a flat list of int64s per rank: for each saved tensor its dtype code, mode, dim,
shape and label. A ``SendLayout`` is this rank's layout and where each saved tensor lies in its
send buffers (it writes them); a ``JoinPlan`` is the plan, for one set of all ranks' layouts, of
how the received bytes join into the global values this rank keeps, checking alike on every
rank that the ranks saved the same values and that they join.
"""

from __future__ import annotations

import struct

import torch

from ...torch_internals import foreach_copy_
from .ragged import check_paddable, is_ragged, padded_shape, region

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
DTYPE_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
MODES = ("rank0", "all")  # also the payload's sections, in this order


def tensors_in(obj, out: list):
    """The tensors inside a saved value, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_in(v, out)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            tensors_in(v, out)
    return out


def round8(n: int) -> int:
    return (n + 7) // 8 * 8


def unpack_chunk(rows: torch.Tensor, start: int, end: int, segments: list) -> None:
    """Copy the bytes ``start:end`` of every rank's section (``rows``) to where they belong:
    ``segments[r]`` lists rank r's tensors as ``(offset, nbytes, destination bytes)``."""
    for r, spans in enumerate(segments):
        for offset, nbytes, dest in spans:
            lo, hi = max(offset, start), min(offset + nbytes, end)
            if lo < hi:
                dest[lo - offset : hi - offset].copy_(rows[r, lo - start : hi - start])


def layout_of(meta: tuple) -> list:
    """A rank's layout as ``[(dtype, shape, mode, dim, offset in its section, nbytes,
    label)]``; every tensor starts 8-byte aligned, so every dtype views in place."""
    specs, at, offsets = [], 0, [0, 0]
    while at < len(meta):
        dtype, mode, dim, ndim = DTYPES[meta[at]], meta[at + 1], meta[at + 2], meta[at + 3]
        shape = tuple(meta[at + 4 : at + 4 + ndim])
        at += 4 + ndim
        size, words = meta[at], round8(meta[at]) // 8
        label = struct.pack(f"<{words}q", *meta[at + 1 : at + 1 + words])[:size].decode()
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        specs.append((dtype, shape, MODES[mode], dim, offsets[mode], nbytes, label))
        offsets[mode] += round8(nbytes)
        at += 1 + words
    return specs


def label_words(label: tuple) -> list:
    """A saved tensor's label as int64s for the layout: its length in bytes, then its bytes."""
    data = "".join(label).encode()
    padded = data.ljust(round8(len(data)), b"\0")
    return [len(data), *struct.unpack(f"<{len(padded) // 8}q", padded)]


class SendLayout:
    """This rank's layout of one trace's saves (``meta``: the int64s the other ranks receive)
    and where each saved tensor lies in the send buffers, one per section (``write`` puts them
    there)."""

    def __init__(self, key: list):
        self.meta = []
        for dtype, shape, mode, dim, label in key:
            self.meta += [
                DTYPE_CODE[dtype],
                MODES.index(mode),
                dim,
                len(shape),
                *shape,
                *label_words(label),
            ]
        self.specs = layout_of(self.meta)
        self.sections = [[i for i, s in enumerate(self.specs) if s[2] == mode] for mode in MODES]
        self.nbytes = [sum(round8(self.specs[i][5]) for i in section) for section in self.sections]
        # one shape and dtype, no padding: the section is one [S, *shape] block for torch.stack
        self.stack = [uniform([self.specs[i] for i in section]) for section in self.sections]
        self._views = None  # (send buffers kept from trace to trace, the views into them)

    def write(self, sends: dict, tensors: list, keep: bool = False):
        """Write the saves of the sections ``sends`` names (section -> its send buffer).
        ``keep``: the buffers are kept from trace to trace, so the views into them are kept
        too."""
        views = self._views
        if views is None or views[0] is not sends:
            views = (
                sends,
                {
                    section: self._views_into(section, send)
                    for section, send in sends.items()
                    if self.sections[section]
                },
            )
            self._views = views if keep else None  # (a buffer used once is not held on to)
        for section, view in views[1].items():
            indices = self.sections[section]
            parts = [tensors[i] for i in indices] if len(indices) != len(tensors) else tensors
            if self.stack[section]:
                torch.stack(parts, out=view)
            else:
                foreach_copy_(view, parts)

    def _views_into(self, section: int, send: torch.Tensor):
        """Where each tensor of ``section`` goes in ``send``: one ``[S, *shape]`` block for
        ``torch.stack``, or a view per tensor."""
        indices = self.sections[section]
        if self.stack[section]:
            dtype, shape = self.specs[indices[0]][:2]
            return send[: self.nbytes[section]].view(dtype).view(len(indices), *shape)
        return [
            send[o : o + n].view(d).view(s)
            for d, s, _, _, o, n, _ in (self.specs[i] for i in indices)
        ]


def uniform(specs: list) -> bool:
    return bool(specs) and len({(s[0], s[1]) for s in specs}) == 1 and specs[0][5] % 8 == 0


class JoinPlan:
    """How this rank cuts the bytes received under one set of all ranks' layouts and joins them
    into the global values it keeps (``wanted``).

    Per section: when every rank saved S tensors of one shape and dtype joined on dim 0 (or
    0-dim, stacked to ``[world]``), its rows are ``[world, S, n]`` blocks: one transposing copy
    into a fresh ``[S, world * n]`` tensor and one ``unbind`` give all S values. Anything else
    (uneven or mixed saves, other dims) is one ``cat`` per tensor of views of the rows."""

    def __init__(self, layouts: tuple, rank: int, world: int):
        self.world = world
        specs = [layout_of(meta) for meta in layouts]  # per rank
        own = specs[rank]
        self.wanted = [i for i, s in enumerate(own) if s[2] == "all" or rank == 0]
        self.shapes, self.dims = [], []
        self.ragged = {}  # index -> every rank's shape, for the saves padded to one shape
        check_same_values(specs)
        for i, (dtype, _, _, dim, _, _, label) in enumerate(own):  # on every rank alike
            name = f"saved tensor {i} of the trace ({label})"
            if any(s[i][0] != dtype for s in specs):
                raise ValueError(
                    f"{name} has dtypes {[str(s[i][0]) for s in specs]} "
                    f"on the ranks: save one dtype on every rank (cast it before .save()), or "
                    f"keep each rank's own with .save(gather='none')."
                )
            shapes = [s[i][1] for s in specs]
            dim = join_dim(shapes, dim, name)
            self.shapes.append(joined_shape(shapes, dim))
            self.dims.append(dim)
            if own[i][1] and is_ragged(shapes, dim):
                check_paddable(dtype, shapes, dim, name)
                self.ragged[i] = shapes
        self.specs = specs
        same = len(set(layouts)) == 1
        self.even = []  # per section: its wanted tensors' indices, if they take the even path
        for mode in MODES:
            section = [i for i in self.wanted if own[i][2] == mode]
            even = (
                same
                and uniform([own[i] for i in section])
                and all(self.dims[i] == 0 for i in section)
            )
            self.even.append(section if even else None)

    def apply(self, received: list, device, done: dict) -> list[torch.Tensor]:
        """The wanted values, in save order, on ``device``: those in ``done`` (streamed), the
        others from their section's receive rows."""
        received = [
            torch.empty(self.world, 0, dtype=torch.uint8) if rows is None else rows
            for rows in received
        ]  # (a section of empty tensors sends nothing)
        values = dict(done)
        for rows, even in zip(received, self.even):
            if even and even[0] not in done:
                values.update(zip(even, self._even(rows, even, device)))
        for i in self.wanted:
            if i not in values:
                values[i] = self._joined(received, i, device)
        return [values[i] for i in self.wanted]

    def destinations(self, section: int, device) -> tuple:
        """For streaming ``section``: its wanted values, fresh, and where each rank's bytes of
        each go, ``[[(offset in the section, nbytes, destination bytes)]]`` per rank. A rank's
        part of a value is a byte range of it when contiguous (joined on dim 0, or stacked);
        otherwise it is received whole into a part of its own, copied in by ``finish``."""
        values, segments = {}, [[] for _ in self.specs]
        mode = MODES[section]
        for i in self.wanted:
            dtype = self.specs[0][i][0]
            if self.specs[0][i][2] != mode:
                continue
            out = self._empty(i, device)
            dim, at, staged = self.dims[i], 0, []
            for r, spec in enumerate(self.specs):
                size = spec[i][1][dim] if spec[i][1] else 1
                if i in self.ragged:
                    part = out[region(spec[i][1], dim, at)]
                else:
                    part = out.narrow(dim, at, size)
                at += size
                if not part.is_contiguous():
                    staged.append((part, torch.empty(part.shape, dtype=dtype, device=device)))
                    part = staged[-1][1]
                segments[r].append((spec[i][4], spec[i][5], part.view(-1).view(torch.uint8)))
            values[i] = (out, staged)
        return values, segments

    @staticmethod
    def finish(values: dict) -> dict:
        """The streamed values, their staged parts copied in."""
        for _, staged in values.values():
            for part, whole in staged:
                part.copy_(whole)
        return {i: out for i, (out, _) in values.items()}

    def _even(self, rows: torch.Tensor, section: list, device) -> tuple:
        dtype, shape, _, _, offset, _, _ = self.specs[0][section[0]]
        count, n = len(section), max(torch.Size(shape).numel(), 1)
        out = torch.empty((count, *self.shapes[section[0]]), dtype=dtype, device=device)
        block = rows[:, offset : offset + count * n * dtype.itemsize].view(dtype)
        block = block.view(self.world, count, n)
        if block.device == out.device:
            out.view(count, self.world, n).copy_(block.transpose(0, 1))
        else:  # rank by rank: the parts move contiguous, no global-size copy on their device
            for r in range(self.world):
                out.view(count, self.world, n)[:, r].copy_(block[r])
        return out.unbind(0)

    def _joined(self, received: list, i: int, device) -> torch.Tensor:
        rows = received[MODES.index(self.specs[0][i][2])]
        parts = [
            rows[r, s[i][4] : s[i][4] + s[i][5]].view(s[i][0]).view(s[i][1] or (1,))
            for r, s in enumerate(self.specs)
        ]
        if rows.device == torch.device(device) and i not in self.ragged:
            return torch.cat(parts, self.dims[i])
        out = self._empty(i, device)
        at, dim = 0, self.dims[i]
        for part in parts:  # part by part, so that no global-size copy is made on their device
            out[region(part.shape, dim, at)].copy_(part)
            at += part.shape[dim]
        return out

    def _empty(self, i: int, device) -> torch.Tensor:
        """The global value of saved tensor ``i``, to be filled: a ragged one NaN where no rank
        has data (``ragged.py``)."""
        dtype = self.specs[0][i][0]
        if i in self.ragged:
            return torch.full(self.shapes[i], float("nan"), dtype=dtype, device=device)
        return torch.empty(self.shapes[i], dtype=dtype, device=device)


def check_same_values(specs: list) -> None:
    """Raise, on every rank alike, if the ranks saved different values at one place in the
    trace's saves (rank 0 ``h[0].output.grad``, rank 1 ``h[1].output.grad``): joining them
    would make one tensor of two different things."""
    for i, first in enumerate(specs[0]):
        labels = [s[i][6] for s in specs]
        if any(label != first[6] for label in labels):
            raise ValueError(
                f"the ranks saved different values as saved tensor {i} of the trace ("
                + ", ".join(f"rank {r}: {label}" for r, label in enumerate(labels))
                + "). Saved "
                "tensors are joined across ranks into one value, so every rank must save the "
                "same values in the same order: make the saves on every rank and branch on the "
                "values, or save rank-local values with .save(gather='none')."
            )


def join_dim(shapes: list[tuple], dim: int, name: str) -> int:
    """The dim the ranks' tensors join on, counted from 0 (``.save(dim=-1)``: the last); 0 for
    0-dim tensors, which are stacked."""
    if any(len(s) != len(shapes[0]) for s in shapes):
        raise ValueError(
            f"{name} has shapes {[list(s) for s in shapes]} on the ranks, with "
            f"different numbers of dims: they cannot be joined along dim {dim}. Save the same "
            f"value on every rank, or keep each rank's own with .save(gather='none')."
        )
    ndim = len(shapes[0])
    if not ndim:
        return 0
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{name} was saved with .save(dim={dim}), but it has {ndim} dims, "
            f"{list(shapes[0])}: give a dim from {-ndim} to {ndim - 1} to join the ranks' "
            f"tensors along."
        )
    return dim % ndim


def joined_shape(shapes: list[tuple], dim: int) -> tuple:
    """The global shape of a save: the ranks' tensors joined on ``dim`` (0-dim ones stacked),
    padded to the largest rank's size in the other dims where those differ (ragged)."""
    if len(shapes[0]) == 0:
        return (len(shapes),)  # 0-dim values are stacked to [world_size]
    return padded_shape(shapes, dim)
