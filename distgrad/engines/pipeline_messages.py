"""Values between pipeline stages: what ``pipeline_run.py`` sends from a value's owner to the
other ranks, on a gloo group of distgrad's own so that it never mixes with the schedule's traffic.

Values travel in *batches*: every value an owner sends to one rank for one delivery moment of the
receiver (``("F", m)``, ``("B", m)`` or ``"end"``, see ``pipeline.py``) goes in one message, sent
when the owner's chunk that produced them ends (``"end"``: when its step ends). That moment
causally precedes the receiver's event, so a receiver never waits for a sender that waits for it.

gloo's point-to-point is a rendezvous (the bytes move only once both sides have posted), so a
receive posted at the moment the value is needed costs round trips between two busy processes.
The receiver therefore posts a batch's receive as soon as a body first asks for one of its
values, long before the event, into a buffer of ``_CAP`` bytes (gloo accepts a shorter message);
a batch longer than that sends the rest in a second message. Tags pair a send with its receive:
every rank runs the same body, so both sides name the same batch. A wait lasts at most
``config.failure_timeout`` seconds between reads of the job's failure key, so a failure on the
sender reaches the receiver instead of leaving it waiting.
"""
from __future__ import annotations

import struct
from datetime import timedelta

import torch

from ..errors import OutOfOrderError
from .collective import _CODE, _DTYPES

_CAP = 1 << 16    # bytes of a batch in its first message
_META = 14        # int64s per value: tag, dtype code, requires_grad, ndim, shape (9), nbytes
_ALIGN = 16       # payloads start at multiples of this, so that they view as any dtype
_SPARE: list = []  # receive buffers whose batches are unpacked, for the next receives


def _tag(key, part: int) -> int:
    index = 2 if key == "end" else 3 * key[1] + (key[0] == "B")
    return 2 * index + part


class Messages:
    """One trace's sends and receives for a ``PipelineEngine``."""

    def __init__(self, engine):
        self.engine, self.channel = engine, engine.channel
        self.outbox: dict = {}    # key -> {dst: [(tag, copy of the value)]}
        self.sent: set = set()    # keys whose batches have gone
        self.pending: list = []   # send works and their buffers, until finish()
        self.posted: dict = {}    # (src, key) -> [buffer, work]; work None once unpacked
        self.got: dict = {}       # (src, tag) -> value unpacked from a batch

    # -- the owner ---------------------------------------------------------------------------
    def send(self, value, tag: int, keys: dict) -> None:
        """Queue ``value`` for each ``dst`` in ``keys`` in that rank's batch ``keys[dst]``."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"distgrad sends only tensors between pipeline stages; this value is "
                            f"a {type(value).__name__}. Read a tensor inside it on its stage.")
        if value.dim() > _META - 5:
            raise ValueError(f"distgrad sends tensors of at most {_META - 5} dimensions between "
                             f"pipeline stages, not {value.dim()}.")
        # its bytes now: the body may edit the value in place before the batch goes (gloo and
        # the packing work on host memory: a GPU value is copied to the host here)
        data = value.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
        raw += bytes(_round(len(raw)) - len(raw))
        entry = ([tag, _CODE[data.dtype], int(value.requires_grad), data.dim(), *data.shape,
                  *[0] * (_META - 5 - data.dim()), data.numel() * data.element_size()], raw)
        for dst, key in keys.items():
            if key in self.sent:
                raise RuntimeError(f"distgrad: a value for batch {key} came after it was sent.")
            self.outbox.setdefault(key, {}).setdefault(dst, []).append(entry)

    def flush(self, key) -> None:
        """Send batch ``key`` to each rank that has values in it."""
        self.sent.add(key)
        for dst, entries in self.outbox.pop(key, {}).items():
            data = _pack(entries)  # sent from the bytes as they are: keep them until it went
            self.pending.append((data, self.channel.send([data[:_CAP]], dst, _tag(key, 0))))
            if data.numel() > _CAP:
                self.pending.append((data, self.channel.send([data[_CAP:]], dst, _tag(key, 1))))

    def finish(self) -> None:
        """Send what is left (the ``"end"`` batches) and wait until every send was received."""
        for key in list(self.outbox):
            self.flush(key)
        for _, work in self.pending:
            self._wait(work)
        self.pending.clear()

    # -- the receiver ------------------------------------------------------------------------
    def expect(self, src: int, key) -> None:
        """Post the receive of ``src``'s batch ``key`` now, so that it arrives in the background."""
        if (src, key) not in self.posted:
            buf = _SPARE.pop() if _SPARE else torch.empty(_CAP, dtype=torch.uint8)
            self.posted[(src, key)] = [buf, self.channel.recv([buf], src, _tag(key, 0))]

    def take(self, src: int, key, tag: int) -> torch.Tensor:
        """The value ``tag`` of ``src``'s batch ``key``, waiting for the batch if need be."""
        self.expect(src, key)
        entry = self.posted[(src, key)]
        if entry[1] is not None:
            self._unpack(src, key, entry)
        value = self.got.pop((src, tag), None)
        if value is None:
            # The owner's body asked for it only after the chunk that would have produced it
            # (so it raises there too), or the bodies differ: waiting would never end.
            raise OutOfOrderError(
                f"rank {src} did not send a value this body asked for (batch {key}): its stage "
                f"had passed it when its own body asked for it. In a pipeline, request values in "
                f"forward order, stage by stage, and gradients in reverse.")
        return value

    def _unpack(self, src: int, key, entry) -> None:
        buf, work = entry
        self._wait(work)
        entry[1] = None
        view = memoryview(buf.numpy())
        total, count = struct.unpack_from("<2q", view)
        if total > _CAP:
            rest = torch.empty(total - _CAP, dtype=torch.uint8)
            self._wait(self.channel.recv([rest], src, _tag(key, 1)))
            view = memoryview(torch.cat([buf[:_CAP], rest]).numpy())
        meta = struct.unpack_from(f"<{_META * count}q", view, 16)
        at = 16 + 8 * _META * count
        for i in range(count):
            tag, code, grad, ndim, *rest = meta[_META * i: _META * (i + 1)]
            shape, nbytes = rest[:ndim], rest[-1]
            dtype = _DTYPES[code]
            data = torch.frombuffer(view, dtype=dtype, count=nbytes // dtype.itemsize,
                                    offset=at).view(shape).clone() if nbytes else \
                torch.empty(shape, dtype=dtype)
            # a graph of its own: editable in place, and `with x.backward():` accepts it
            data = data.to(self.engine.device)  # where this rank's stage computes
            self.got[(src, tag)] = data.requires_grad_(True).clone() if grad else data
            at += _round(nbytes)
        _SPARE.append(buf)  # its values are copied out: the next receive may reuse it

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


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pack(entries: list) -> torch.Tensor:
    """One batch as bytes: [total bytes, count], each value's metadata, then the values, each
    starting at a multiple of ``_ALIGN`` (the header is one: 16 + 112 bytes per value)."""
    meta = [n for item, _ in entries for n in item]
    total = 16 + 8 * len(meta) + sum(len(raw) for _, raw in entries)
    out = bytearray(struct.pack(f"<{2 + len(meta)}q", total, len(entries), *meta))
    for _, raw in entries:
        out += raw
    return torch.frombuffer(out, dtype=torch.uint8)
