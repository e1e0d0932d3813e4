"""Moving saved values to rank 0 in one collective, whatever their number.

Every rank packs one byte buffer: a header, the bytes of every saved tensor, and (only when its
layout, the saves' shapes/dtypes/modes/dims, differs from its previous trace) that layout. The
ranks ``all_gather`` those buffers. ``all_gather`` needs one size on every rank, so buffers have
a capacity the ranks agreed on in an earlier trace; a rank whose saves do not fit sends only its
header with the size it needs, every rank sees that, and the ranks repeat once with the larger
capacity. Ranks may save tensors of different sizes on the joined dimension (an uneven last
batch). In a training loop with fixed shapes every trace after the first costs one collective (from
the third on, of exactly the saved bytes plus 40), for S saved tensors as for one.

Each trace ends with the saved tensors rebound to their global values (``tensor.data = value``).
What is left that grows with S is the Python per tensor (read its dtype and shape, pass it to
one packing call, get a view back from one unpacking call, rebind it): packing and unpacking are
single C++ calls for the common case of S saves of one shape and dtype, everything else is
planned once per layout and cached, and in a steady training loop the views are made and bound
while the collective runs (it very likely repeats the last trace; undone when it does not).
"""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from ...saving import saved_label
from ...torch_internals import allgather_base, foreach_copy_, set_grad_enabled

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]
DTYPE_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
_MODES = ("rank0", "all")
# int64s: fits (1 or 0), number of tensors, bytes needed in all, layout length (0 when the
# layout is that of this rank's previous trace), same layout as before (1 or 0)
_HEADER = 5
_START = 8 * _HEADER  # payload offset: 8-byte aligned, so every dtype views in place
_CPU = torch.device("cpu")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_NO_LABELS: dict = {}


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


def refuse_model_state(saves: list, model: torch.nn.Module) -> ValueError | None:
    """The error for a save that would be rebound although it is the model's own tensor (a
    parameter, its ``.grad``, a buffer): joining the ranks' copies into it would change what the
    optimizer or the next forward reads. None when no save is one. Saves kept per rank
    (``gather="none"``) are never rebound, so they may be anything."""
    kept = [obj for obj, mode, _ in saves if mode != "none"]
    if not kept:
        return None
    own = {}
    for name, p in model.named_parameters():
        own[id(p)] = (p, name, "parameter")
        if p.grad is not None:
            own[id(p.grad)] = (p.grad, name + ".grad", "parameter gradient")
    for name, b in model.named_buffers():
        own[id(b)] = (b, name, "buffer")
    for obj in kept:
        for tensor in _tensors(obj, []):
            found = own.get(id(tensor))
            if found is not None and found[0] is tensor:
                _, name, what = found
                return ValueError(
                    f"{name}.save(): that is the model's own {what}, which the optimizer (or "
                    f"the next forward) reads. A saved tensor is rebound at the end of the trace "
                    f"to every rank's values joined, which would change the {what} itself. Save "
                    f"a copy (`.clone().save()`), or keep each rank's own with "
                    f"`distgrad.save(t, gather=\"none\")`.")
    return None


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


class Exchange:
    """One per engine. Every rank keeps the same view of the previous trace (all ranks' layouts
    and the plan cut from them), so a rank whose layout repeats need not send it again."""

    def __init__(self, group, rank: int, world: int, wait=None):
        self.group, self.rank, self.world = group, rank, world
        # how to wait for the collective: the engine's wait reads the job's failure key between
        # slices, so a peer that failed (and said so) cannot leave this rank waiting
        self._wait = wait if wait is not None else _plain_wait
        self.capacity = 0
        self._plans: dict = {}
        self._buffers = None  # ((size, device), send, receive, headers, rows), reused
        self._last = None     # this rank's (key, _Pack) of the previous completed trace
        self._prev = None     # (all ranks' layouts, plan) of the previous completed trace
        self._steady = None   # every rank's header of the previous trace, if all repeated theirs
        self._bound = None    # (saved tensors, their local values) while bound early

    def __call__(self, saves: list) -> None:
        """Gather one trace's saves, ``(obj, mode, dim)`` in save order, and rebind each saved
        tensor this rank should replace to its global value (``tensor.data = value``: the name
        the user holds shows the result). Raises ValueError on every rank alike when the ranks'
        saves do not line up; the saved tensors then keep their local values."""
        grad = torch.is_grad_enabled()  # the packing writes to out=, which autograd refuses
        set_grad_enabled(False)  # (cheaper than the torch.no_grad decorator)
        self._bound = None
        try:
            for tensor, value in self._exchange(saves):
                tensor.data = value
        except BaseException:
            self._unbind()
            raise
        finally:
            set_grad_enabled(grad)

    def _unbind(self):
        """Undo an early binding: back to the local values, which the send buffer holds."""
        if self._bound is not None:
            tensors, local = self._bound
            self._bound = None
            for tensor, value in zip(tensors, local.clone().unbind(0)):
                tensor.data = value

    def _exchange(self, saves: list) -> list:
        tensors, key = [], []
        # what each saved tensor is (model.transformer.h[0].output.grad): part of the layout,
        # so that the ranks check once per layout that they saved the same values
        labels = getattr(saves, "labels", _NO_LABELS)
        for obj, mode, dim in saves:  # the per-tensor Python of a trace: kept to the minimum
            if type(obj) is torch.Tensor and mode != "none":
                tensors.append(obj)
                key.append((obj.dtype, obj.shape, mode, dim, saved_label(obj, labels)))
            elif mode != "none":  # subclasses, dicts, tuples
                for t in _tensors(obj, []):
                    tensors.append(t)
                    key.append((t.dtype, t.shape, mode, dim, saved_label(t, labels)))
        last, prev, steady = self._last, self._prev, self._steady
        self._last = self._prev = self._steady = None  # set again when this exchange completes
        same = last is not None and last[0] == key
        pack = last[1] if same else _Pack(key)
        needed = _START + pack.nbytes + (0 if same else 8 * len(pack.meta))
        head = [1, len(tensors), needed, 0 if same else len(pack.meta), int(same)]
        device = tensors[0].device if tensors else _CPU
        # the last trace was one every rank repeated, and this rank repeats it: the others very
        # likely do too, so the values' tensors are made, and the saved tensors bound to them,
        # while the collective runs (undone if the others did not repeat theirs)
        expect = same and steady is not None
        plan = prev[1] if expect else None
        while True:
            fits = needed <= self.capacity
            send, gathered, heads, rows = self._buffers_for(max(self.capacity, _START), device)
            if fits:
                pack.write(send, tensors, head, same)
            else:  # only the header: the others learn the size this rank needs
                send[:_START].view(torch.int64).copy_(torch.tensor([0] + head[1:]))
                pack.written = None
            work = self._start(gathered, send)
            early = None
            if expect and plan.even:  # (even: every tensor is wanted and was packed by stack)
                early = plan.prepare(device)
                self._bound = tensors, pack.block
                for tensor, value in zip(tensors, early[1]):
                    tensor.data = value
            self._wait(work, self.group)
            heads = heads.tolist()  # every rank's header
            if expect and heads == steady:  # as expected: nothing to check, nothing to plan
                self._last, self._prev, self._steady = last, prev, steady
                if early is not None:
                    plan.fill(rows, early)
                    self._bound = None
                    return ()
                return self._pairs(tensors, plan, plan.apply(rows, device))
            expect = False
            self._unbind()  # a repeat packs the saved tensors again: they must be local again
            if all(h[0] for h in heads):
                break
            # headroom for growing shapes; a multiple of 8 so that the headers view as int64
            self.capacity = _round8(max(h[2] for h in heads) * 5 // 4)
        counts = [h[1] for h in heads]
        if len(set(counts)) != 1:
            raise ValueError(
                "ranks saved different numbers of tensors in one trace (" +
                ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)) + "). Save the same "
                "values on every rank, or use .save(gather='none') for rank-local values.")
        if prev is not None and all(h[4] for h in heads):
            layouts, plan = prev  # every rank saved what it saved last time
            # a layout that repeats is worth its bytes: shrink the headroom to what each rank
            # needs to send its layout once more (a smaller last batch then still fits)
            self.capacity = min(self.capacity, _round8(
                max(h[2] + 8 * len(meta) for h, meta in zip(heads, layouts))))
            self._steady = heads
        else:
            layouts = tuple(
                prev[0][r] if h[4] else
                tuple(rows[r, h[2] - 8 * h[3]: h[2]].view(torch.int64).tolist())
                for r, h in enumerate(heads))
            plan = self._plans.get(layouts)
            if plan is None:
                if len(self._plans) > 16:  # shapes that change every step: do not pile up plans
                    self._plans.clear()
                plan = self._plans[layouts] = _Plan(layouts, self.rank, self.world)
        self._last, self._prev = (key, pack), (layouts, plan)
        return self._pairs(tensors, plan, plan.apply(rows, device))

    @staticmethod
    def _pairs(tensors: list, plan, values) -> list:
        if not plan.wanted:
            return []
        if len(plan.wanted) == len(tensors):
            return list(zip(tensors, values))
        return [(tensors[i], v) for i, v in zip(plan.wanted, values)]

    def _start(self, gathered: torch.Tensor, send: torch.Tensor):
        gather_flat = allgather_base(self.group)
        if gather_flat is not None:  # skips all_gather's Python checks
            return gather_flat(gathered, send)
        return _all_gather(gathered, send, self.group, async_op=True)

    def _buffers_for(self, size: int, device):
        cached = self._buffers
        if cached is None or cached[0] != (size, device):
            gathered = torch.empty(self.world * size, dtype=torch.uint8, device=device)
            rows = gathered.view(self.world, size)
            send = torch.empty(size, dtype=torch.uint8, device=device)
            cached = self._buffers = ((size, device), send, gathered,
                                      rows[:, :_START].view(torch.int64), rows)
        return cached[1:]


def _plain_wait(work, group) -> None:
    work.wait()


def _layout(meta: tuple) -> list:
    """A rank's layout as ``[(dtype, shape, mode, dim, payload offset, nbytes, label)]``;
    every tensor starts 8-byte aligned."""
    specs, at, offset = [], 0, 0
    while at < len(meta):
        dtype, mode, dim, ndim = DTYPES[meta[at]], _MODES[meta[at + 1]], meta[at + 2], meta[at + 3]
        shape = tuple(meta[at + 4: at + 4 + ndim])
        at += 4 + ndim
        size, words = meta[at], _round8(meta[at]) // 8
        label = struct.pack(f"<{words}q", *meta[at + 1: at + 1 + words])[:size].decode()
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        specs.append((dtype, shape, mode, dim, offset, nbytes, label))
        offset += _round8(nbytes)
        at += 1 + words
    return specs


def _label_words(label: tuple) -> list:
    """A saved tensor's label as int64s for the layout: its length in bytes, then its bytes."""
    data = "".join(label).encode()
    padded = data.ljust(_round8(len(data)), b"\0")
    return [len(data), *struct.unpack(f"<{len(padded) // 8}q", padded)]


class _Pack:
    """How this rank writes one layout of saves into its send buffer."""

    def __init__(self, key: list):
        self.meta = []
        for dtype, shape, mode, dim, label in key:
            self.meta += [DTYPE_CODE[dtype], _MODES.index(mode), dim, len(shape), *shape,
                          *_label_words(label)]
        self.specs = _layout(self.meta)
        self.nbytes = sum(_round8(s[5]) for s in self.specs)
        # one shape and dtype, no padding: the payload is one [S, *shape] block for torch.stack
        self.stack = len({(s[0], s[1]) for s in self.specs}) == 1 and self.specs[0][5] % 8 == 0
        self.written = None  # (send buffer, header) last written, to skip rewriting it
        self._views = None   # (send buffer, destination of each tensor in it)
        self.block = None

    def write(self, send: torch.Tensor, tensors: list, head: list, same: bool):
        if self.written is None or self.written[0] is not send or self.written[1] != head:
            end = _START + self.nbytes
            send[:_START].view(torch.int64).copy_(torch.tensor(head))
            if not same:  # the layout goes after the payload, so the payload never moves
                send[end: end + 8 * len(self.meta)].view(torch.int64).copy_(
                    torch.tensor(self.meta))
            self.written = (send, head)
        if not tensors:
            return
        views = self._views
        if views is None or views[0] is not send:
            if self.stack:
                dtype, shape = self.specs[0][:2]
                block = send[_START: _START + self.nbytes].view(dtype)
                views = (send, block.view(len(tensors), *shape))
            else:
                views = (send, [send[_START + o: _START + o + n].view(d).view(s)
                                for d, s, _, _, o, n, _ in self.specs])
            self._views = views
        if self.stack:
            self.block = views[1]  # [S, *shape]: this rank's values, while the buffer lives
            torch.stack(tensors, out=self.block)
        else:
            foreach_copy_(views[1], tensors)


class _Plan:
    """How this rank cuts one set of gathered layouts into the global values it wants.

    When every rank saved S tensors of one shape and dtype joined on dim 0 (or 0-dim, stacked
    to ``[world]``), the payloads are ``[world, S, n]`` blocks: one transposing copy into a
    fresh ``[S, world * n]`` tensor and one ``unbind`` give all S values. Anything else (uneven
    or mixed saves, other dims) is one ``cat`` per tensor of views cached on the receive
    buffer."""

    def __init__(self, layouts: tuple, rank: int, world: int):
        self.world = world
        specs = [_layout(meta) for meta in layouts]  # per rank
        own = specs[rank]
        self.wanted = [i for i, s in enumerate(own) if s[2] == "all" or rank == 0]
        self.shapes, self.dims = [], []
        _check_same_values(specs)
        for i, (dtype, _, _, dim, _, _, _) in enumerate(own):  # checked on every rank alike
            if any(s[i][0] != dtype for s in specs):
                raise ValueError(f"saved tensor {i} has dtypes {[str(s[i][0]) for s in specs]} "
                                 f"on the ranks: save one dtype on every rank.")
            self.shapes.append(_joined_shape([s[i][1] for s in specs], dim))
            self.dims.append(dim if own[i][1] else 0)
        self.specs, self._views = specs, None
        self.even = (len(self.wanted) == len(own) > 0 and len(set(layouts)) == 1
                     and len({(s[0], s[1]) for s in own}) == 1 and own[0][5] % 8 == 0
                     and all(d == 0 for d in self.dims))
        if self.even:
            dtype, shape = own[0][:2]
            self.dtype, self.n = dtype, max(torch.Size(shape).numel(), 1)
            self.out = (len(own), *self.shapes[0])

    def prepare(self, device) -> tuple:
        """For even saves: a fresh tensor for the values, as ``[S, world, n]``, and the values,
        views of it (made before the data is there)."""
        out = torch.empty(self.out, dtype=self.dtype, device=device)
        return out.view(self.out[0], self.world, self.n), out.unbind(0)

    def fill(self, rows: torch.Tensor, prepared: tuple) -> tuple:
        # [S, world, n] in rows: the parts of one value are not adjacent, so one copy
        prepared[0].copy_(self._views_of(rows))
        return prepared[1]

    def apply(self, rows: torch.Tensor, device) -> list[torch.Tensor]:
        if self.even:
            return self.fill(rows, self.prepare(device))
        return [torch.cat(parts, self.dims[i])
                for parts, i in zip(self._views_of(rows), self.wanted)]

    def _views_of(self, rows: torch.Tensor):
        views = self._views
        if views is None or views[0] is not rows:  # the receive buffer lives while it fits
            views = self._views = (rows, self._cut(rows))
        return views[1]

    def _cut(self, rows: torch.Tensor):
        """Views into the receive buffer: for even saves ``[S, world, n]``; else, per wanted
        tensor, its part from every rank."""
        if self.even:
            count = len(self.specs[0])
            block = rows[:, _START: _START + count * self.n * self.dtype.itemsize]
            return block.view(self.dtype).view(self.world, count, self.n).transpose(0, 1)
        return [[rows[r, _START + s[i][4]: _START + s[i][4] + s[i][5]].view(s[i][0])
                 .view(s[i][1] or (1,)) for r, s in enumerate(self.specs)]
                for i in self.wanted]


def _check_same_values(specs: list) -> None:
    """Raise, on every rank alike, if the ranks saved different values at one place in the
    trace's saves (rank 0 ``h[0].output.grad``, rank 1 ``h[1].output.grad``): joining them
    would make one tensor of two different things."""
    for i, first in enumerate(specs[0]):
        labels = [s[i][6] for s in specs]
        if any(label != first[6] for label in labels):
            raise ValueError(
                f"the ranks saved different values as saved tensor {i} of the trace (" +
                ", ".join(f"rank {r}: {label}" for r, label in enumerate(labels)) + "). Saved "
                "tensors are joined across ranks into one value, so every rank must save the "
                "same values in the same order: make the saves on every rank and branch on the "
                "values, or save rank-local values with .save(gather='none').")


def _joined_shape(shapes: list[tuple], dim: int) -> tuple:
    if len(shapes[0]) == 0:
        return (len(shapes),)  # 0-dim values are stacked to [world_size]
    rest = [s[:dim] + s[dim + 1:] for s in shapes]
    if any(r != rest[0] for r in rest) or any(len(s) != len(shapes[0]) for s in shapes):
        raise ValueError(f"saved tensors of shapes {[list(s) for s in shapes]} cannot be joined "
                         f"along dim {dim}: save them with .save(gather='none') or pad them to "
                         f"one shape.")
    return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]
