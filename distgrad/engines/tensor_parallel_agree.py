"""Before each gather of a sharded value, the tensor-parallel ranks agree that they are at the
same value, on a gloo group of distgrad's own, with a wait that can give up (used by
``tensor_parallel.py`` where the mesh is on the CPU).

Why: ``DTensor.full_tensor()`` all-gathers on the model's own group and blocks in C++ until every
rank joins. If the ranks' bodies differ (``if rank == 0: q = ...q_proj.output``), rank 0 waits
there for a gather that rank 1 never makes, while rank 1 waits in the model's next all-reduce
for rank 0: a deadlock that only gloo's own timeout (30 minutes by default) ends, and no thread
of the process can break it (gloo's ``abort()`` does not wake a blocked collective). Gathering on
a group of our own instead would not do either: ranks at values of different sizes would make
gloo abort the process ("Received data size doesn't match expected size").

So each visit first all-gathers 16 bytes per rank - how many values this rank has gathered in
the trace and a checksum of the value's label - waited for in slices of
``config.failure_timeout`` seconds (a timed wait on a collective closes nothing). Ranks at
different values raise ``TraceStateError`` there, all of them, before any gather of data. A
rank that has waited a slice says so in the job's store; every rank's failure watcher
(``distributed._Watch``) then writes where its own rank is (``publish_state``): how many values
it has agreed on and whether a thread of it sits in torch's collective code. When a peer is
behind and sits in torch's collective for two slices in a row, it waits for this rank in a
collective this rank will never join: this rank raises ``TraceStateError``, and the peer hears
of it when this rank's script ends and the peer's collective breaks (``distributed.py``).
"""
from __future__ import annotations

import sys
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import TraceStateError


class ViewAgreement:
    """distgrad's gloo group over one tensor-parallel mesh, and the agreements made on it."""

    def __init__(self, engine, mesh):
        self.engine = engine
        mine = dist.get_process_group_ranks(mesh.get_group())
        groups = [None] * dist.get_world_size()
        dist.all_gather_object(groups, sorted(mine))  # every rank makes every group, in order
        for ranks in sorted({tuple(g) for g in groups}):
            group = dist.new_group(list(ranks), backend="gloo")
            if dist.get_rank() in ranks:
                self.group, self.ranks = group, list(ranks)
        self.rank, self.world = self.ranks.index(dist.get_rank()), len(self.ranks)
        self.count = 0    # values agreed on in this trace
        self.made = 0     # agreements since wrap (what tests count)
        self.slices = {}  # peer -> slices in a row it was seen behind, in torch's collective

    def clear(self) -> None:
        self.count, self.slices = 0, {}

    def agree(self, label: str) -> None:
        """Return once every rank of the mesh is at this value; raise if one is elsewhere."""
        self.count += 1
        self.made += 1
        mine = torch.tensor([self.count, zlib.crc32(label.encode())], dtype=torch.int64)
        table = torch.empty(self.world, 2, dtype=torch.int64)
        self._wait(self.group.allgather([list(table.unbind(0))], [mine]), label)
        if not bool((table == mine).all()):
            raise TraceStateError(_MISMATCH + "; ".join(
                f"rank {self.ranks[r]} was at its value {int(c)} of the trace"
                f"{' (' + label + ')' if r == self.rank else ''}" for r, (c, _) in
                enumerate(table.tolist())) + ", or at another value with that number).")

    # -- waiting, and giving up -----------------------------------------------------------
    def _wait(self, work, label: str) -> None:
        from ..backward import config
        engine, said = self.engine, False
        while True:
            try:
                if work.wait(timedelta(seconds=config.failure_timeout)):
                    return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
            found = engine._watch.read(engine._key_now())
            if found is not None:
                raise RuntimeError(f"Connection closed: {found[1]}")
            if not said:  # ask the peers' watchers where their ranks are
                said = True
                engine._store.set(self._asked_key(), "1")
                continue
            for peer in self.ranks:
                if peer == dist.get_rank():
                    continue
                count, where = self._state_of(peer)
                behind = count is not None and count < self.count and where == "collective"
                self.slices[peer] = self.slices.get(peer, 0) + 1 if behind else 0
                if self.slices[peer] >= 2:
                    self._give_up(TraceStateError(
                        _MISMATCH + f"this rank, {dist.get_rank()}, waits to gather {label}, its "
                        f"value {self.count} of the trace; rank {peer} has agreed on {count} and "
                        f"waits in a collective of the model, so its body did not ask for this one)."))

    def _give_up(self, error: Exception):
        """Raise ``error``, once the peers' watchers have read it: they hear of it only when
        this process ends (their collective breaks then), and this one may hold the store."""
        from ..backward import config
        engine = self.engine
        key = engine._key_now()
        try:
            engine._store.set(key, f"{dist.get_rank()}\nrank {dist.get_rank()}: "
                                   f"{type(error).__name__}: {error}")
        except Exception:
            raise error from None
        engine._wait_for_readers(key, dist.get_rank(), config.failure_timeout)
        raise error

    def _asked_key(self) -> str:
        return f"distgrad/tp-asked/{self.engine._traces + 1}"

    def _state_of(self, peer: int):
        store, key = self.engine._store, f"distgrad/tp-state/{self.engine._traces + 1}/{peer}"
        try:
            if not store.check([key]):
                return None, None
            count, where = store.get(key).decode().split(":")
        except Exception:
            return None, None
        return int(count), where

    def publish_state(self, store, rank: int, traces: int) -> None:
        """From the watcher thread: where this rank is, if a peer has asked (see module text)."""
        if not store.check([f"distgrad/tp-asked/{traces + 1}"]):
            return
        store.set(f"distgrad/tp-state/{traces + 1}/{rank}", f"{self.count}:{_where()}")


def _where() -> str:
    """"agreeing" if a thread of this process waits in one of our agreements, "collective" if
    one is in torch.distributed's code (the model's collectives), else "running"."""
    found = "running"
    for frame in sys._current_frames().values():
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_wait" and code.co_filename.endswith("tensor_parallel_agree.py"):
                return "agreeing"
            name = code.co_filename.replace("\\", "/")
            if "/torch/distributed/" in name:
                found = "collective"
            frame = frame.f_back
    return found


_MISMATCH = ("under tensor parallelism the body asked for different values on different ranks "
             "(each value of a sharded activation is gathered from every rank of the mesh: keep "
             "requests such as `.output`, `.input` and `.grad` out of rank-dependent branches like "
             "`if rank == 0:`, read them on every rank and branch on the values; ")
