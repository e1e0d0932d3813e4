"""Agreeing, before a collective that distgrad makes for the body, that every rank is at the
same request - so that a body with rank-dependent requests raises instead of hanging.

Which collectives: showing a sharded tensor-parallel value whole (``tensor_parallel.py``, over
the mesh) and reading or writing a parameter's gradient on a sharded engine (FSDP1, FSDP2,
DeepSpeed, tensor parallel; over every rank). On the CPU (gloo) only.

Why: those collectives block in C++ until every rank joins. If the ranks' bodies differ
(``if rank == 0: q = ...q_proj.output``), rank 0 waits there for a collective that rank 1 never
makes, while rank 1 waits in the model's next collective (or distgrad's end-of-trace gather) for
rank 0: a deadlock that only gloo's own timeout (30 minutes by default) ends, and no thread can
break it (gloo's ``abort()`` does not wake a blocked collective). Where the two collectives
differ in size, gloo aborts the process instead ("Received data size doesn't match expected
size").

So each request all-gathers, on a gloo group of distgrad's, how many requests of its kind this
rank has made in the trace and a checksum of its label (``agree``: 16 bytes per rank, before a
parameter gradient's collective). A tensor-parallel shard travels in the same collective
(``gather``): after those numbers, its shape and its bytes padded to a capacity the ranks share,
so that ranks at values of different sizes still send the same number of bytes - one collective
per value shown whole. The collective is waited for in slices of ``config.failure_timeout``
seconds (a timed wait on a collective closes nothing). Ranks at different requests raise
``TraceStateError`` there, all of them. A rank that has waited a slice says so in the job's
store; every rank's failure watcher (``engine.py``'s ``FailureWatcher``) then writes where
its own rank is (``publish_state``): how many requests it has agreed on and whether a thread of
it sits in torch's collective code. When a peer is behind and sits in torch's collective for two
slices in a row, it waits for this rank in a collective this rank will never join: this rank
raises ``TraceStateError``, and the peer hears of it when this rank's script ends and the peer's
collective breaks (``engine.py``).
"""

from __future__ import annotations

import sys
import zlib

import torch
import torch.distributed as dist

from ...config import config
from ...errors import TraceStateError
from . import gather


class Agreement:
    """A gloo group of distgrad's over the ranks of one kind of request, and the agreements
    made on it. ``mesh``: a tensor-parallel mesh (the ranks of this rank's mesh group), or None
    for every rank. ``name`` tells kinds apart in the store."""

    def __init__(self, engine, name: str, mesh=None):
        self.engine, self.name = engine, name
        if mesh is None:
            self.group = dist.new_group(backend="gloo")
            self.ranks = list(range(dist.get_world_size()))
        else:
            mine = dist.get_process_group_ranks(mesh.get_group())
            groups = [None] * dist.get_world_size()
            dist.all_gather_object(groups, sorted(mine))  # every rank makes every group, in order
            for ranks in sorted({tuple(g) for g in groups}):
                group = dist.new_group(list(ranks), backend="gloo")
                if dist.get_rank() in ranks:
                    self.group, self.ranks = group, list(ranks)
        engine.agreements.append(self)
        engine.answering.append(self)
        self.rank, self.world = self.ranks.index(dist.get_rank()), len(self.ranks)
        self.count = 0  # requests agreed on in this trace
        self.made = 0  # agreements since wrap (what tests count)
        self.slices = {}  # peer -> slices in a row it was seen behind, in torch's collective
        self.capacity = 0  # payload bytes every rank sends in gather(); grows, never shrinks

    def clear(self) -> None:
        self.count, self.slices = 0, {}

    def agree(self, label: str) -> None:
        """Return once every rank of the group is at this request; raise if one is elsewhere."""
        self.count += 1
        self.made += 1
        mine = torch.tensor([self.count, zlib.crc32(label.encode())], dtype=torch.int64)
        table = torch.empty(self.world, 2, dtype=torch.int64)
        self._wait(self.group.allgather([list(table.unbind(0))], [mine]), label)
        self._check(table, label)

    def gather(self, label: str, local: torch.Tensor, coord: int) -> list[torch.Tensor]:
        """``agree`` and an all-gather of ``local`` in one collective: every rank's tensor (a
        detached copy), ordered by ``coord`` (the rank's place on the mesh dimension).

        Each rank sends the agreement's numbers, its tensor's shape and size, and its bytes
        padded to a capacity the ranks share, so the collective has one size on every rank
        whatever each one holds (gloo aborts the process on a size mismatch). A tensor larger
        than the capacity costs a second collective, once: every rank sees the size needed."""
        self.count += 1
        self.made += 1
        local = local.detach().contiguous()
        nbytes = local.numel() * local.element_size()
        if local.dim() > _MAX_DIMS:
            raise NotImplementedError(
                f"{label}: distgrad shows sharded values of at most {_MAX_DIMS} dimensions."
            )
        head = [
            self.count,
            zlib.crc32(label.encode()),
            coord,
            nbytes,
            local.dim(),
            *local.shape,
            *[0] * (_MAX_DIMS - local.dim()),
        ]
        while True:
            capacity = self.capacity
            send = torch.zeros(_HEAD * 8 + capacity, dtype=torch.uint8)
            send[: _HEAD * 8].view(torch.int64).copy_(torch.tensor(head))
            if nbytes <= capacity:
                send[_HEAD * 8 : _HEAD * 8 + nbytes].copy_(local.view(-1).view(torch.uint8))
            rows = torch.empty(self.world, _HEAD * 8 + capacity, dtype=torch.uint8)
            self._wait(self.group.allgather([list(rows.unbind(0))], [send]), label)
            heads = rows[:, : _HEAD * 8].view(torch.int64)
            self._check(heads[:, :2], label)
            needed = int(heads[:, 3].max())
            if needed <= capacity:
                break
            self.capacity = (needed * 5 // 4 + 7) // 8 * 8  # the same on every rank
        pieces = []
        for row, h in sorted(zip(rows, heads.tolist()), key=lambda pair: pair[1][2]):
            shape = h[5 : 5 + h[4]]
            pieces.append(row[_HEAD * 8 : _HEAD * 8 + h[3]].view(local.dtype).view(shape))
        return pieces

    def _check(self, table: torch.Tensor, label: str) -> None:
        mine = table[self.rank]
        if not bool((table == mine).all()):
            raise TraceStateError(
                _MISMATCH
                + "; ".join(
                    f"rank {self.ranks[r]} was at its request {int(c)} of the trace"
                    f"{' (' + label + ')' if r == self.rank else ''}"
                    for r, (c, _) in enumerate(table.tolist())
                )
                + ", or at another value with that number)."
            )

    # -- waiting, and giving up -----------------------------------------------------------
    def _wait(self, work, label: str) -> None:
        asked = []

        def after_slice():
            if not asked:  # ask the peers' watchers where their ranks are
                asked.append(True)
                ask(self.engine.store, self.engine.running)
                return
            for peer in self.ranks:
                if peer == dist.get_rank():
                    continue
                count, where = self._state_of(peer)
                # behind, and blocked elsewhere: in a collective of torch's or distgrad's, or in
                # an agreement of another kind (in this one it could not be behind)
                behind = count is not None and count < self.count and where != "running"
                self.slices[peer] = self.slices.get(peer, 0) + 1 if behind else 0
                if self.slices[peer] >= 2:
                    self._give_up(
                        TraceStateError(
                            _MISMATCH + f"this rank, {dist.get_rank()}, waits for every rank at "
                            f"{label}, its request {self.count} of the trace; rank {peer} has made "
                            f"{count} and waits in another collective, so its body did not "
                            f"make this one)."
                        )
                    )

        self.engine.wait_in_slices(work, self.group, after_slice)

    def _give_up(self, error: Exception):
        """Raise ``error``, once the peers' watchers have read it: they hear of it only when
        this process ends (their collective breaks then), and this one may hold the store."""
        engine = self.engine
        key = engine.key_now()
        if engine.tell(key, error):
            engine.wait_for_readers(key, engine.job_rank, config.failure_timeout)
        raise error

    def _state_of(self, peer: int):
        store = self.engine.store
        key = f"distgrad/agree-state/{self.name}/{self.engine.running}/{peer}"
        try:
            if not store.check([key]):
                return None, None
            count, where = store.get(key).decode().split(":")
        except Exception:
            return None, None
        return int(count), where

    def publish_state(self, store, rank: int, running: int, where: str) -> None:
        """From the watcher thread, once a peer has asked (``asked``): where this rank is."""
        store.set(f"distgrad/agree-state/{self.name}/{running}/{rank}", f"{self.count}:{where}")


def ask(store, running: int) -> None:
    """Ask every rank's failure watcher to say where its rank is in trace ``running``: a rank
    waiting in an agreement, or for a pipeline batch, that has waited one slice."""
    store.set(f"distgrad/agree-asked/{running}", "1")


def asked(store, running: int) -> bool:
    """Whether a waiting rank has asked where the others are in trace ``running`` (read by
    every rank's watcher, every 0.1 s of a trace)."""
    return store.check([f"distgrad/agree-asked/{running}"])


def where() -> str:
    """ "agreeing" if a thread of this process waits in one of our agreements, "collective" if
    one is in torch.distributed's code (the model's collectives) or in distgrad's end-of-trace
    gather, else "running"."""
    found = "running"
    for frame in sys._current_frames().values():
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_wait" and code.co_filename == __file__:
                return "agreeing"
            name = code.co_filename.replace("\\", "/")
            if "/torch/distributed/" in name or code.co_filename == gather.__file__:
                found = "collective"  # torch's collectives, or distgrad's end-of-trace gather
            frame = frame.f_back
    return found


_MAX_DIMS = 8
_HEAD = 5 + _MAX_DIMS  # int64s: count, label checksum, mesh coordinate, bytes, ndim, shape

_MISMATCH = (
    "the body asked for different values on different ranks (a sharded value read whole "
    "under tensor parallelism, or a parameter's `.grad` on a sharded engine, is a "
    "collective every rank must make: keep such requests out of rank-dependent branches "
    "like `if rank == 0:`, make them on every rank and branch on the values; "
)
