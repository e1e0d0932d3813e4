"""Values between pipeline stages: what ``pipeline.py`` sends from a value's owner to the other
ranks, on a gloo group of distgrad's own so that it never mixes with the schedule's traffic.

Each value is one message of a fixed size to each other rank - a header (dtype, whether it
requires grad, shape) and the bytes when they fit, as most values do - and a second message with
the bytes when they do not. Tags pair a send with its receive: every rank runs the same body, so
the n-th request of microbatch m has the same tag everywhere. A receive waits in slices of
``config.failure_timeout`` and reads the job's failure key in between, so a failure on the
sender reaches the receiver instead of leaving it waiting.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .collective import _CODE, _DTYPES

_HEAD = 12  # int64s: dtype code, requires_grad, ndim, shape (at most 9 dims)
_INLINE = 16384  # bytes of a value that travel in the header's message


class Messages:
    """One trace's sends and receives for a ``PipelineEngine``."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: list = []  # send handles, and the tensors they read, until finish()

    def send(self, value, tag: int) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"distgrad sends only tensors between pipeline stages; this value is "
                            f"a {type(value).__name__}. Read a tensor inside it on its stage.")
        if value.dim() > _HEAD - 3:
            raise ValueError(f"distgrad sends tensors of at most {_HEAD - 3} dimensions between "
                             f"pipeline stages, not {value.dim()}.")
        data = value.detach().contiguous()
        nbytes = data.numel() * data.element_size()
        first = torch.zeros(8 * _HEAD + _INLINE, dtype=torch.uint8)
        head = first[: 8 * _HEAD].view(torch.int64)
        head[:3] = torch.tensor([_CODE[data.dtype], int(value.requires_grad), data.dim()])
        head[3: 3 + data.dim()] = torch.tensor(data.shape, dtype=torch.int64)
        flat = data.reshape(-1).view(torch.uint8)
        if nbytes <= _INLINE:
            first[8 * _HEAD: 8 * _HEAD + nbytes] = flat
        me, channel = dist.get_rank(), self.engine.channel
        for dst in range(dist.get_world_size()):
            if dst != me:
                self.pending.append(dist.isend(first, dst, group=channel, tag=2 * tag))
                if nbytes > _INLINE:
                    self.pending.append(dist.isend(flat, dst, group=channel, tag=2 * tag + 1))
        self.pending.append((first, flat))  # alive until the sends complete

    def receive(self, src: int, tag: int) -> torch.Tensor:
        first = torch.empty(8 * _HEAD + _INLINE, dtype=torch.uint8)
        self._wait(dist.irecv(first, src, group=self.engine.channel, tag=2 * tag))
        code, grad, ndim = first[: 8 * _HEAD].view(torch.int64)[:3].tolist()
        shape = first[: 8 * _HEAD].view(torch.int64)[3: 3 + ndim].tolist()
        dtype = _DTYPES[code]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes <= _INLINE:
            data = first[8 * _HEAD: 8 * _HEAD + nbytes].clone().view(dtype).view(shape)
        else:
            data = torch.empty(shape, dtype=dtype)
            self._wait(dist.irecv(data.view(-1).view(torch.uint8), src,
                                  group=self.engine.channel, tag=2 * tag + 1))
        # a copy in a graph of its own: editable in place, and `with x.backward():` accepts it
        return data.requires_grad_(True).clone() if grad else data

    def finish(self) -> None:
        """Wait until every send of the trace has been received."""
        for item in self.pending:
            if not isinstance(item, tuple):
                item.wait()
        self.pending.clear()

    def _wait(self, work) -> None:
        from ..backward import config
        while True:
            try:
                if work.wait(timedelta(seconds=config.failure_timeout)):
                    return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                    raise
            found = self.engine._watch.read(self.engine._key_now())
            if found is not None:
                raise RuntimeError(f"Connection closed: {found[1]}")
