"""Moving saved values to the ranks that keep them: rank 0, or every rank for ``gather="all"``.

Every trace, the ranks ``all_gather`` a fixed header of 48 bytes each (how many tensors each
saved, how many bytes it sends, whether its layout repeats: the saves' shapes, dtypes, modes,
dims and labels). When a rank's layout changed, they ``all_gather`` the layouts next (tens of
bytes a saved tensor), so that every rank checks alike that the ranks saved the same values and
that they join. Then the payload: the bytes of the ``gather="rank0"`` saves go to rank 0 alone
(``dist.gather``), those of the ``gather="all"`` saves to every rank (``all_gather``). Each rank
sends one buffer per kind (the payload's two sections), of the largest rank's size (collectives
take one size on every rank), so a rank other than 0 allocates its own saved bytes (padded to
the largest rank's on an uneven batch), the headers and, when the layouts change, the layouts:
whatever the world size, it receives no payload of ``gather="rank0"`` saves. Ranks may save
tensors of different sizes on the joined dimension (an uneven last batch).

With ``distgrad.config.gather_chunk_bytes`` set, a section larger than the bound is streamed:
several collectives of at most that many bytes a rank, each chunk copied into the global values
before the next, so the receive buffer is ``world * bound`` bytes (``SavesGather._stream``).

In a training loop whose layouts repeat, every rank knows the sizes of the previous trace, so
all of them send the payload right behind the header, without waiting for it; if the headers
then show that some rank's saves changed, the payload is sent again with the right sizes. When
all ranks' headers and payload together are at most ``SavesGather.small_bytes`` (256 KiB), they
go as one ``all_gather``: one round trip, and every rank receives at most that constant.

Each trace ends with the saved tensors rebound to their global values (``tensor.data =
value``), on the saved tensor's device or on ``distgrad.config.gather_device``. The global
values are fresh tensors; the buffers live for one trace. Packing and unpacking are single
calls for the common case of S saves of one shape and dtype. ``layout.py`` holds both ends: this
rank's ``SendLayout`` (how its saves lie in its send buffers) and the ``JoinPlan`` of a set of
ranks' layouts (how the received bytes join into global values), made once per set and cached.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...config import config
from ...saving import owned_tensors, saved_label
from ...torch_internals import allgather_base, set_grad_enabled
from .abandoned import keep_until_exit
from .layout import JoinPlan, SendLayout, round8, tensors_in, unpack_chunk
from .ragged import mark_ragged

# int64s: number of tensors, bytes of gather="rank0" saves, bytes of gather="all" saves,
# layout length (0 when the layout is that of this rank's previous trace), same layout (1 or 0),
# this rank's config.gather_chunk_bytes (0: none)
_HEADER = 6
_CPU = torch.device("cpu")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_NO_LABELS: dict = {}


def refuse_model_state(saves: list, model: torch.nn.Module) -> ValueError | None:
    """The error for a save that would be rebound although it is the model's own tensor (a
    parameter, its ``.grad``, a buffer): joining the ranks' copies into it would change what the
    optimizer or the next forward reads. None when no save is one. Saves kept per rank
    (``gather="none"``) are never rebound, so they may be anything."""
    kept = [obj for obj, mode, _ in saves if mode != "none"]
    if not kept:
        return None
    own = owned_tensors(model)
    for obj in kept:
        for tensor in tensors_in(obj, []):
            found = own.get(id(tensor))
            if found is not None and found[0] is tensor:
                _, name, what = found
                return ValueError(
                    f"{name}.save(): that is the model's own {what}, which the optimizer (or "
                    f"the next forward) reads. A saved tensor is rebound at the end of the trace "
                    f"to every rank's values joined, which would change the {what} itself. Save "
                    f"a copy (`.clone().save()`), or keep each rank's own with "
                    f'`distgrad.save(t, gather="none")`.'
                )
    return None


class SavesGather:
    """One per engine. Every rank keeps the same view of the previous trace (all ranks' headers
    and layouts, and the join plan cut from them), so a rank whose layout repeats need not send it
    again, and every rank can send the payload before it has read the headers.

    ``allocated`` (read by the tests and ``benchmarks/gather_memory.py``): the bytes of each
    buffer this rank allocated for its last gather, by name: ``"headers"`` (48 bytes a rank),
    ``"layouts"`` (only when a layout changed), ``"send"`` (this rank's saved bytes, padded to
    the largest rank's), ``"receive"`` (every rank's bytes of the saves this rank keeps the
    global value of: on rank 0 all saves, elsewhere only the ``gather="all"`` ones); for a
    payload sent twice (the headers showed a change), the second, the first being freed.
    ``guessed``: whether the last gather's payload was the one sent before the headers were
    read (the steady path of a training loop). ``small_bytes``: a steady gather whose headers
    and payload from all ranks together are at most this many bytes (256 KiB) is one
    ``all_gather`` of both, which every rank receives: the constant a rank other than 0 may
    receive; its ``allocated`` then counts that collective's buffers by their parts (headers,
    this rank's payload, all ranks' payloads)."""

    def __init__(self, group, rank: int, world: int, wait=None):
        self.group, self.rank, self.world = group, rank, world
        # how to wait for the collective: the engine's wait reads the job's failure key between
        # slices, so a peer that failed (and said so) cannot leave this rank waiting
        self._wait = wait if wait is not None else _plain_wait
        self._plans: dict = {}
        self._last = None  # this rank's (key, SendLayout) of the previous completed trace
        self._prev = None  # (all ranks' headers, layouts, plan) of the previous completed trace
        self.allocated: dict = {}
        self.guessed = False
        # a repeated gather of at most this many bytes from all ranks together goes as one
        # all_gather of headers and payload (one round trip instead of two; every rank then
        # receives the payload, which at this size costs less than the second round trip)
        self.small_bytes = 256 << 10
        self._small_buffers = None  # (key, buffers and views) of the last small gather
        self._root = dist.get_global_rank(group, 0)  # gather's dst: a global rank (torch < 2.6)
        # the collectives this gather has started: where a wait gives up (a peer failed), those
        # still pending are kept until the process ends (abandoned.py)
        self._started: list = []

    def __call__(self, saves: list) -> None:
        """Gather one trace's saves, ``(obj, mode, dim)`` in save order, and rebind each saved
        tensor this rank should replace to its global value (``tensor.data = value``: the name
        the user holds shows the result). Raises ValueError on every rank alike when the ranks'
        saves do not line up; the saved tensors then keep their local values."""
        grad = torch.is_grad_enabled()  # the packing writes to out=, which autograd refuses
        set_grad_enabled(False)  # (cheaper than the torch.no_grad decorator)
        try:
            for tensor, value in self._global_values(saves):
                tensor.data = value
        except BaseException:
            keep_until_exit(self.group, self._started)
            raise
        finally:
            self._started = []
            set_grad_enabled(grad)

    def _global_values(self, saves: list) -> list:
        tensors, key = [], []
        # what each saved tensor is (model.transformer.h[0].output.grad): part of the layout,
        # so that the ranks check once per layout that they saved the same values
        labels = getattr(saves, "labels", _NO_LABELS)
        for obj, mode, dim in saves:  # the per-tensor Python of a trace: kept to the minimum
            if type(obj) is torch.Tensor and mode != "none":
                tensors.append(obj)
                key.append((obj.dtype, obj.shape, mode, dim, saved_label(obj, labels)))
            elif mode != "none":  # subclasses, dicts, tuples
                for t in tensors_in(obj, []):
                    tensors.append(t)
                    key.append((t.dtype, t.shape, mode, dim, saved_label(t, labels)))
        last, prev = self._last, self._prev
        self._last = self._prev = None  # set again when this gather completes
        self.allocated, self.guessed = {}, False
        same = last is not None and prev is not None and last[0] == key
        layout = last[1] if same else SendLayout(key)
        bound = config.gather_chunk_bytes
        bound = round8(max(int(bound), 8)) if bound else 0
        head = [len(tensors), *layout.nbytes, 0 if same else len(layout.meta), int(same), bound]
        device = tensors[0].device if tensors else _CPU
        sent = guess = None
        if prev is not None and not _streamed(_sizes(prev[0]), _bound(prev[0])):
            guess = _sizes(prev[0])  # every rank alike: the sizes of the previous trace again
        if guess is not None and self.world * (8 * _HEADER + sum(guess)) <= self.small_bytes:
            # small: one all_gather of headers and payload, as every rank sees them
            heads, sent = self._small(head, layout if same else None, tensors, guess, device)
        else:
            heads = self._alloc("headers", self.world * _HEADER, torch.int64, device)
            work = self._all_gather(heads, torch.tensor(head).to(device))
            # sent right behind the headers (not when streamed in chunks: each chunk is unpacked
            # before the next, which needs the headers)
            if guess is not None:
                sent = self._send(layout if same else None, tensors, guess, device)
            self._wait(work, self.group)
            heads = heads.view(self.world, _HEADER).tolist()
        target = config.gather_device or device
        done: dict = {}
        if prev is not None and all(
            h[4] and h[:3] == p[:3] and h[5] == p[5] for h, p in zip(heads, prev[0])
        ):
            layouts, plan = prev[1], prev[2]  # the previous trace's: nothing to check or plan
        else:
            if sent is not None:
                self._received(sent)  # every rank waits for it (if not done), then drops it
                sent = None
            counts = [h[0] for h in heads]
            if len(set(counts)) != 1:
                raise ValueError(
                    "ranks saved different numbers of tensors in one trace ("
                    + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
                    + "). Save the "
                    "same values on every rank, or use .save(gather='none') for rank-local "
                    "values."
                )
            layouts = self._layouts(heads, layout, prev, device)
            plan = self._plans.get(layouts)
            if plan is None:
                if len(self._plans) > 16:  # shapes that change every step: do not pile up plans
                    self._plans.clear()
                plan = self._plans[layouts] = JoinPlan(layouts, self.rank, self.world)
        if sent is not None:
            received = self._received(sent)
            self.guessed = True
        else:
            sizes, bound = _sizes(heads), _bound(heads)
            if _streamed(sizes, bound):
                received, done = self._stream(plan, layout, tensors, sizes, bound, device, target)
            else:
                received = self._received(self._send(layout, tensors, sizes, device))
        self._last, self._prev = (key, layout), (heads, layouts, plan)
        if not plan.wanted:
            return []
        values = plan.apply(received, target, done)
        for i in plan.ragged:  # padded to one shape: rank_parts finds each rank's part
            if i in plan.wanted:
                mark_ragged(tensors[i], plan.shapes[i], plan.dims[i], plan.ragged[i])
        if len(plan.wanted) == len(tensors):
            return list(zip(tensors, values))
        return [(tensors[i], v) for i, v in zip(plan.wanted, values)]

    def _small(self, head: list, layout, tensors: list, sizes: tuple, device) -> tuple:
        """Headers and a guessed payload in one ``all_gather``: every rank's headers, and the
        payload as already received sections (``_received``'s form)."""
        start = 8 * _HEADER
        # counted by their parts, as if apart: the headers, this rank's payload, all payloads
        self.allocated.update(
            headers=self.world * start, send=sum(sizes), receive=self.world * sum(sizes)
        )
        cached = self._small_buffers  # at most small_bytes: kept from trace to trace
        if cached is None or cached[0] != (sizes, device):
            size = start + sum(sizes)
            send = torch.empty(size, dtype=torch.uint8, device=device)
            rows = torch.empty(self.world, size, dtype=torch.uint8, device=device)
            bounds = (start, start + sizes[0], size)
            cached = self._small_buffers = (
                (sizes, device),
                send,
                rows,
                send[:start].view(torch.int64),
                [None],
                {i: send[bounds[i] : bounds[i + 1]] for i in (0, 1) if sizes[i]},
                rows[:, :start].view(torch.int64),
                [(i, None, rows[:, bounds[i] : bounds[i + 1]]) for i in (0, 1)],
            )
        _, send, rows, head_view, written, parts, heads, received = cached
        if written[0] != head:
            head_view.copy_(torch.tensor(head))
            written[0] = head
        if layout is not None and all(n <= g for n, g in zip(layout.nbytes, sizes) if g):
            layout.write(parts, tensors, keep=True)
        self._wait(self._all_gather(rows.view(-1), send), self.group)
        return heads.tolist(), received

    def _stream(self, plan, layout, tensors: list, sizes: tuple, bound: int, device, target):
        """The payload of each section larger than ``bound`` in collectives of at most
        ``bound`` bytes a rank, each chunk copied into the global values before the next is
        sent: this rank's receive buffer is ``world * bound`` bytes, not ``world * size``.
        Sections within the bound go in one collective as usual. Returns the receive rows of
        those, and the streamed values by tensor index."""
        small = tuple(size if size <= bound else 0 for size in sizes)
        received = self._received(self._send(layout, tensors, small, device))
        done, chunk = {}, None
        for section, size in enumerate(sizes):
            if size <= bound:
                continue
            send = self._alloc("send", size, torch.uint8, device)
            layout.write({section: send}, tensors)
            keep = section == 1 or self.rank == 0
            values, segments = plan.destinations(section, target) if keep else ({}, None)
            if keep and chunk is None:  # one for every section streamed
                chunk = self._alloc("receive", self.world * bound, torch.uint8, device)
            for start in range(0, size, bound):
                end = min(size, start + bound)
                rows = (
                    chunk[: self.world * (end - start)].view(self.world, end - start)
                    if keep
                    else None
                )
                if section == 1:
                    work = self._all_gather(rows.view(-1), send[start:end])
                else:
                    work = self._gather(send[start:end], rows)
                self._wait(work, self.group)
                if keep:
                    unpack_chunk(rows, start, end, segments)
            if keep:
                done.update(plan.finish(values))
        return received, done

    def _layouts(self, heads: list, layout, prev, device) -> tuple:
        """Every rank's layout: from the previous trace where a rank's repeats, else sent."""
        if prev is not None and all(h[4] for h in heads):
            return prev[1]
        longest = max(h[3] for h in heads)
        rows = self._alloc("layouts", self.world * longest, torch.int64, device)
        mine = torch.zeros(longest, dtype=torch.int64)
        if heads[self.rank][3]:
            mine[: len(layout.meta)] = torch.tensor(layout.meta)
        self._wait(self._all_gather(rows, mine.to(device)), self.group)
        rows = rows.view(self.world, longest).tolist()
        return tuple(prev[1][r] if h[4] else tuple(rows[r][: h[3]]) for r, h in enumerate(heads))

    def _send(self, layout, tensors: list, sizes: tuple, device) -> list:
        """Start the payload's collectives, one per section that any rank has bytes in, each
        rank sending ``sizes[section]`` bytes (this rank's saves when ``layout`` is given and they
        fit, else bytes nobody reads). Returns ``[(section, work, receive rows or None)]``."""
        for name in ("send", "receive"):  # a guess sent before is freed by now
            self.allocated.pop(name, None)
        sends = [self._alloc("send", size, torch.uint8, device) for size in sizes]
        if layout is not None and all(n <= size for n, size in zip(layout.nbytes, sizes) if size):
            layout.write({i: send for i, send in enumerate(sends) if sizes[i]}, tensors)
        started = []
        for section, (send, size) in enumerate(zip(sends, sizes)):
            if not size:
                continue
            keep = section == 1 or self.rank == 0
            rows = (
                self._alloc("receive", self.world * size, torch.uint8, device).view(
                    self.world, size
                )
                if keep
                else None
            )
            if section == 1:
                work = self._all_gather(rows.view(-1), send)
            else:
                work = self._gather(send, rows)
            started.append((section, work, rows))
        return started

    def _received(self, started: list) -> list:
        """Wait for the payload's collectives; the receive rows of each section (or None)."""
        rows = [None, None]
        for section, work, received in started:
            if work is not None:  # (None: received already, with the headers)
                self._wait(work, self.group)
            rows[section] = received
        return rows

    def _all_gather(self, out: torch.Tensor, send: torch.Tensor):
        gather_flat = allgather_base(self.group)
        if gather_flat is not None:  # skips all_gather's Python checks
            return self._track(gather_flat(out, send))
        return self._track(_all_gather(out, send, self.group, async_op=True))

    def _gather(self, send: torch.Tensor, rows):
        """Rank 0's ``rows`` (None elsewhere) receive every rank's ``send``."""
        return self._track(
            dist.gather(
                send,
                list(rows.unbind(0)) if rows is not None else None,
                dst=self._root,
                group=self.group,
                async_op=True,
            )
        )

    def _track(self, work):
        """Hold ``work`` among the collectives started and not yet completed (those that
        have completed are let go, with their buffers)."""
        self._started = [w for w in self._started if not w.is_completed()]
        self._started.append(work)
        return work

    def _alloc(self, name: str, count: int, dtype, device) -> torch.Tensor:
        self.allocated[name] = self.allocated.get(name, 0) + count * dtype.itemsize
        return torch.empty(count, dtype=dtype, device=device)


def _bound(heads: list) -> int:
    """The chunk bound the ranks agree on: the smallest any rank set (0: none)."""
    return min((h[5] for h in heads if h[5]), default=0)


def _streamed(sizes: tuple, bound: int) -> bool:
    return bool(bound) and max(sizes) > bound


def _sizes(heads: list) -> tuple:
    """The bytes every rank sends per section: the largest rank's (8-byte multiples)."""
    return max(h[1] for h in heads), max(h[2] for h in heads)


def _plain_wait(work, group) -> None:
    work.wait()
