"""What every multi-process engine shares: ranks, the end-of-trace gather, and failure.

A failure on one rank must reach all of them without a hang. The failing rank writes its
message to the process group's store and shuts its process group down; every peer blocked in
a collective (DDP's all-reduce, FSDP's all-gather, distgrad's own gather) then fails within
milliseconds, reads the message and raises ``RankFailedError`` naming that rank. A peer that
dies without a word (killed) breaks its connections the same way; the others then wait at most
``distgrad.config.failure_timeout`` seconds for a message before saying that a rank was lost.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..errors import RankFailedError
from . import collective
from .base import Engine


class DistributedEngine(Engine):

    def __init__(self, wrapped, group=None):
        super().__init__(wrapped)
        if not dist.is_initialized():
            raise RuntimeError(f"distgrad.wrap() got a {type(wrapped).__name__} but "
                               "torch.distributed is not initialised in this process.")
        self.group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self.group)
        self._world = dist.get_world_size(self.group)
        self._traces = 0
        self._exchange = collective.Exchange(self.group, self._rank, self._world)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    # -- the end of every trace -----------------------------------------------------------
    def end_trace(self, saves: list, error: BaseException | None):
        self._traces += 1
        if error is not None:
            return self._fail(error)
        try:
            results = self._exchange(saves)
        except RuntimeError as exc:  # the group broke under us: a peer failed
            raise self._peer_failure(exc) from exc
        with torch.no_grad():
            for tensor, value in results:
                tensor.data = value  # the name the user holds now shows the global view
        return None

    def _key(self) -> str:
        return f"distgrad/failure/{self._traces}"

    def _fail(self, error: BaseException):
        if isinstance(error, RankFailedError):
            return None
        if _is_comm_error(error):
            return self._peer_failure(error)
        store = _store()
        message = f"rank {self._rank}: {type(error).__name__}: {error}"
        try:
            store.set(self._key(), message)
        except Exception:  # the store's host may be gone too; the peers then say "lost"
            pass
        _shutdown(self.group)
        return None  # re-raise the user's own error on this rank

    def _peer_failure(self, error: BaseException) -> RankFailedError:
        from ..backward import config
        store = _store()
        deadline = time.monotonic() + config.failure_timeout
        message = None
        while time.monotonic() < deadline:
            try:
                if store.check([self._key()]):
                    message = store.get(self._key()).decode()
                    break
            except Exception:
                break
            time.sleep(0.05)
        _shutdown(self.group)
        if message is None:
            return RankFailedError(
                f"rank {self._rank}: a peer rank stopped answering during the trace (killed or "
                f"crashed without a Python error): {str(error).splitlines()[0][:200]}")
        return RankFailedError(f"rank {self._rank} stopped because {message}")


def _is_comm_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and ("gloo" in text or "NCCL" in text or
                                                "Connection closed" in text or "Read error" in text)


def _store():
    return dist.distributed_c10d._get_default_store()


def _shutdown(group) -> None:
    """Break the group's connections so that every peer's pending collective fails now."""
    pg = group if group is not None else dist.group.WORLD
    try:
        pg.shutdown()
    except Exception:
        pass

