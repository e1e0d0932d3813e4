"""Values between pipeline stages: what ``run.py`` sends from a value's owner to the
other ranks.

Values travel in *batches*: every value an owner sends to one rank for one delivery moment of the
receiver (``("F", m)``, ``("B", m)`` or ``"end"``, see ``engine.py``) goes together, sent
when the owner's chunk that produced them ends (``"end"``: when its bodies are done, or its step
ends if that comes first). That moment causally precedes the receiver's event, so a receiver
never waits for a sender that waits for it.
Between neighbouring stages a batch rides on the schedule's own message of that chunk (the
activation forward, the input gradient backward; ``outgoing``, ``incoming``, ``arrived``). Every
other batch is a message of its own on a gloo group of distgrad's, apart from the schedule's
traffic. What every rank's bodies asked of every other is compared across ranks when the step
ends (``checks.py``).

gloo's point-to-point is a rendezvous (the bytes move only once both sides have posted), so a
receive posted at the moment the value is needed costs round trips between two busy processes.
The receiver therefore posts a batch's receive as soon as a body first asks for one of its
values, long before the event, into a buffer of ``_CAP`` bytes (gloo accepts a shorter message);
a batch longer than that sends the rest in a second message. Tags pair a send with its receive:
every rank runs the same body, so both sides name the same batch.

A receive is never waited for with a timeout: when a timed gloo receive expires, gloo closes
every connection of the group, so a peer that is merely slow (a long stage) would break the job.
A batch whose first bytes have landed is waited for in place; until they land, the buffer is
polled, the failure watcher's news looked at every 0.1 s, and every ``config.failure_timeout``
seconds the job's failure key and the peer's list of sends are read (``_wait_for_batch``, in
``checks.py``).
"""
from __future__ import annotations

import ctypes
import struct

import torch

from ...errors import OutOfOrderError
from ..ranks.layout import DTYPE_CODE, DTYPES
from .checks import RequestChecks

_string_at = ctypes.string_at  # the bytes at an address: one copy, nothing else made

_CAP = 1 << 16    # bytes of a batch in its first message
_META = 14        # int64s per value: tag, dtype code, requires_grad, ndim, shape (9), nbytes
_ALIGN = 16       # payloads start at multiples of this, so that they view as any dtype
_ZEROS = [(0,) * (_META - 5 - n) for n in range(_META - 4)]  # shape padding by ndim
_META_BYTES = struct.Struct(f"<{_META}q").pack  # one value's metadata, packed as it is queued
_HEAD = struct.Struct("<2q").pack  # a batch's total bytes and its number of values
_SPARE: list = []  # receive buffers whose batches are unpacked, for the next receives


MOST_MICROBATCHES = 4096  # per step: keeps every batch's tag below the check's (_CHECK)


def _tag(key, part: int) -> int:
    """The message tag of batch ``key``: ``"end"`` or ``(phase, receiving stage, microbatch)``."""
    if key == "end":
        return 4 + part
    return 2 * (3 + 2 * (key[1] * MOST_MICROBATCHES + key[2]) + (key[0] == "B")) + part


class Messages(RequestChecks):
    """One trace's sends and receives for a ``PipelineEngine``."""

    def __init__(self, engine):
        self.engine, self.channel = engine, engine.channel
        # per stage of this rank, the rank whose schedule messages with it carry batches
        self.carry_to, self.carry_from = engine.carry_to, engine.carry_from  # see carry()
        self.carried: dict = {}   # (phase, stage, microbatch) -> where the carried bytes arrive
        self.room = engine.carry_room  # receive buffers with room, kept across steps
        self.swapped: list = []   # (stage record, its own buffer) while ours stands in
        # What went and came on the channel, by peer: compared across ranks when the step ends
        self.sent_to: dict = {}   # dst -> [tags of batches sent]
        self.rank, self.world = engine.job_rank, engine.job_world
        self.told = False         # whether this rank's sends are in the store (see _agree)
        self.outbox: dict = {}    # key -> {dst: [(tag, copy of the value)]}
        self.sent: set = set()    # keys whose batches are going (no value may join them)
        self.gone: list = []      # tags of the keys whose batches have gone (publish_state)
        self.pending: list = []   # send works and their buffers, until finish()
        self.posted: dict = {}    # (src, key) -> [buffer, work]; work None once unpacked
        self.got: dict = {}       # (src, tag) -> value unpacked from a batch
        # The values this rank's bodies made each peer owe it and it owe each peer, by tag:
        # compared across ranks when the step ends (start_check, _agree)
        self.promised: dict = {}  # dst -> [tags of values this rank sends it]
        self.wanted: dict = {}    # src -> [tags of values this rank's bodies asked it for]
        self.check = None         # (this rank's numbers, sends, {peer: (buffer, receive)})
        self.check_recvs = None   # {peer: (buffer, receive)} of the check, once posted

    # -- the owner ---------------------------------------------------------------------------
    def send(self, value, tag: int, keys: dict) -> None:
        """Queue ``value`` for each ``dst`` in ``keys`` in that rank's batch ``keys[dst]``."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"distgrad sends only tensors between pipeline stages; this value is "
                            f"a {type(value).__name__}. Read a tensor inside it on its stage.")
        if not keys:  # no other rank (a one-rank pipeline): nothing to pack
            return
        entry = _entry(value, tag)
        for dst, key in keys.items():
            if key in self.sent:
                raise RuntimeError(f"distgrad: a value for batch {key} came after it was sent.")
            self.outbox.setdefault(key, {}).setdefault(dst, []).append(entry)
            self.promised.setdefault(dst, []).append(tag)

    def want(self, src: int, tag: int) -> None:
        """A body here asked for value ``tag`` of ``src``'s stage."""
        self.wanted.setdefault(src, []).append(tag)

    def flush(self, key) -> None:
        """Send batch ``key`` to each rank that has values in it."""
        self.sent.add(key)
        batches = self.outbox.pop(key, {})
        carrier = None if key == "end" else self.carry_to.get(key[1] - 1) if key[0] == "F" \
            else self.carry_from.get(key[1] + 1)  # the rank of the key's stage, if carried
        if carrier is not None:  # that one goes with the schedule's message (outgoing)
            self.outbox[key] = {carrier: batches.pop(carrier, [])}
        for dst, entries in batches.items():
            self._send(_pack(entries), dst, key)
        self.gone.append(_tag(key, 0))  # after the sends: a peer reading it sees them too

    def _send(self, data: bytearray, dst: int, key, carried: bool = False) -> None:
        # sent from the bytes as they are (the tensor views them): kept until it went. A
        # carried batch went with the schedule's message, up to _CAP bytes: only a longer
        # one's rest goes here.
        if not carried:
            self.sent_to.setdefault(dst, []).append(_tag(key, 0))
            part = _uint8(memoryview(data)[:_CAP])
            self.pending.append((part, self.channel.send([part], dst, _tag(key, 0))))
        if len(data) > _CAP:
            rest = _uint8(memoryview(data)[_CAP:])
            self.pending.append((rest, self.channel.send([rest], dst, _tag(key, 1))))

    # -- values that travel with the schedule's own messages (PipelineEngine.carry) -----------
    # Forward: activations to the next stage carry ("F", m) batches for it; backward: input
    # gradients to the previous stage carry ("B", m) batches. Every such message is received
    # with room for a batch, and a message that brings none means an empty one, so a receiver
    # never waits for a batch that does not come.
    def outgoing(self, phase: str, stage: int, chunk: int, ops: list) -> list:
        """The schedule's sends of ``stage``'s ``chunk`` in ``phase``, the last one to the
        neighbour replaced by one message of its bytes followed by this rank's batch for that
        rank, if any."""
        if phase == "F":
            key, dst = ("F", stage + 1, chunk), self.carry_to[stage]
        else:
            key, dst = ("B", stage - 1, chunk), self.carry_from[stage]
        entries = self.outbox.pop(key, {}).get(dst)
        at = _last_with(ops, dst)
        if at is None:  # nothing of the schedule's goes there: send the batch on its own
            self._send(_pack(entries or []), dst, key)
            return ops
        if not entries:  # the message as the schedule made it: the receiver sees no batch
            return ops
        data = _pack(entries)
        op = ops[at]
        # The schedule's bytes, then the batch's first _CAP, put together in Python: six torch
        # calls (a flat byte view of the activation, an empty tensor, two slices and two
        # copies) are dear in the middle of a step, and one tensor made over the joined bytes
        # is not (benchmarks/diagnostics/pp_segments.py times the packing).
        both = bytearray(_bytes_of(op.tensor))
        both += memoryview(data)[:_CAP]
        op.tensor = _uint8(both)  # (the op is the schedule's own, made for this one message)
        self.pending.append((op.tensor, None))
        if len(data) > _CAP:
            self._send(data, dst, key, carried=True)
        return ops

    def incoming(self, phase: str, stage: int, chunk: int, ops: list, infos=()) -> list:
        """The schedule's receives of ``chunk`` in ``phase``, the last one from the neighbour
        received into a buffer with room for that rank's batch after the schedule's bytes.
        ``infos``: the stage's records of what it receives; the one whose buffer this is gets
        a view of the bytes in that buffer, so nothing needs copying when they arrive."""
        key, src = (phase, stage, chunk), self._carrier(phase, stage)
        at = _last_with(ops, src)
        if at is None:  # the sender's ``outgoing`` found no message of the schedule's either
            self._post(src, key)
            return ops
        op = ops[at]
        tensor = op.tensor
        size = tensor.numel() * tensor.element_size()
        room = self.room.get(key)  # kept by the engine: the same buffers every step
        if room is None or room[0] != (tensor.shape, tensor.dtype):
            both = torch.empty(size + _CAP, dtype=torch.uint8)
            room = self.room[key] = ((tensor.shape, tensor.dtype), both,
                                     memoryview(both.numpy()),
                                     both[:size].view(tensor.dtype).view(tensor.shape))
        _, both, view, inside = room
        info = next((i for i in infos if i.buffer is tensor), None)
        if info is not None:  # the schedule reads its input where the bytes land
            self.swapped.append((info, tensor))
            info.buffer = inside
        struct.pack_into("<q", view, size, -1)  # a batch's length; stays -1 if none comes along
        self.carried[key] = (None if info is not None else tensor, both, view, size)
        op.tensor = both
        return ops

    def arrived(self, phase: str, stage: int, chunk: int) -> None:
        """As ``stage`` starts ``chunk`` in ``phase`` (the schedule has waited for its
        receives): unpack the batch that came with the schedule's bytes."""
        key = (phase, stage, chunk)
        found = self.carried.pop(key, None)
        if found is None:
            return
        copy_to, both, view, size = found
        if copy_to is not None:
            copy_to.detach().view(-1).view(torch.uint8).copy_(both[:size])
        src = self._carrier(phase, stage)
        self.posted[(src, key)] = [None, None]  # arrived with the schedule's bytes
        if struct.unpack_from("<q", view, size)[0] != -1:
            self._parse(src, key, view[size:])

    def give_back(self) -> None:
        """The stage's own receive buffers again (end of the trace)."""
        for info, tensor in reversed(self.swapped):
            info.buffer = tensor
        self.swapped.clear()

    def _carrier(self, phase: str, stage: int):
        """The rank whose messages of ``phase`` to this rank's ``stage`` carry batches, if any."""
        return self.carry_from.get(stage) if phase == "F" else self.carry_to.get(stage)

    def finish(self) -> None:
        """Send what is left (the ``"end"`` batches), check with every rank that each value sent
        has a body that asked for it and the other way round, and wait until every send was
        received."""
        for key in list(self.outbox):
            self.flush(key)
        self._agree()  # (the run started the check when its bodies were done)
        # every send now has a receive posted: it completes unless a connection breaks
        for _, work in self.pending:
            if work is not None:
                work.wait()
        self.pending.clear()

    # -- the receiver ------------------------------------------------------------------------
    def expect(self, src: int, key) -> None:
        """Post the receive of ``src``'s batch ``key`` now, so that it arrives in the background."""
        if (src, key) not in self.posted:
            if key != "end" and src == self._carrier(key[0], key[1]):
                return  # it comes with the schedule's message (incoming, arrived)
            self._post(src, key)

    def _post(self, src: int, key) -> None:
        buf = _SPARE.pop() if _SPARE else torch.empty(_CAP, dtype=torch.uint8)
        buf[:8].view(torch.int64).fill_(-1)  # a batch's length once its first bytes land
        self.posted[(src, key)] = [buf, self.channel.recv([buf], src, _tag(key, 0))]

    def take(self, src: int, key, tag: int) -> torch.Tensor:
        """The value ``tag`` of ``src``'s batch ``key``, waiting for the batch if need be."""
        self.expect(src, key)
        entry = self.posted.get((src, key))
        if entry is None:  # a carried batch is unpacked before its event: not reached
            raise RuntimeError(f"distgrad: batch {key} of rank {src} was taken before it came.")
        if entry[1] is not None:
            self._unpack(src, key, entry)
        value = self.got.pop((src, tag), None)
        if value is None:
            # The owner's body asked for it only after the chunk that would have produced it
            # (so it raises there too), or the bodies differ: waiting would never end.
            raise OutOfOrderError(
                f"rank {src} did not send a value this body asked for (batch {key}): either its "
                f"stage had passed it when its own body asked for it (in a pipeline, request "
                f"values in forward order, stage by stage, and gradients in reverse), or its body "
                f"never asked for it (keep requests out of rank-dependent branches such as "
                f"`if rank == 0:`).")
        return value

    def _unpack(self, src: int, key, entry) -> None:
        buf, work = entry
        self._wait_for_batch(buf, work, src, key, _tag(key, 0))
        entry[1] = None
        self._parse(src, key, memoryview(buf.numpy()))
        _SPARE.append(buf)  # its values are copied out: the next receive may reuse it

    def _parse(self, src: int, key, view: memoryview) -> None:
        """Take the values of the batch whose first part ``view`` holds (its buffer is reused)."""
        total, count = struct.unpack_from("<2q", view)
        if total > _CAP:
            rest = bytearray(total - _CAP)
            self.channel.recv([_uint8(rest)], src, _tag(key, 1)).wait()  # sent with the first
            view = memoryview(bytearray(view[:_CAP]) + rest)
        for tag, value in _values(view, count, self.engine.device):
            self.got[(src, tag)] = value


def _entry(value: torch.Tensor, tag: int) -> tuple:
    """``value`` as it is now, for a batch: its metadata (``_META`` int64s, packed) and its
    bytes, padded to ``_ALIGN``. The bytes are taken now because the body may edit the value in
    place before the batch goes (gloo and the packing work on host memory: a GPU value is copied
    to the host here)."""
    shape = value.shape
    ndim = len(shape)
    if ndim > _META - 5:
        raise ValueError(f"distgrad sends tensors of at most {_META - 5} dimensions between "
                         f"pipeline stages, not {ndim}.")
    raw = _bytes_of(value)
    nbytes = len(raw)
    if nbytes % _ALIGN:
        raw += bytes(_ALIGN - nbytes % _ALIGN)
    return (_META_BYTES(tag, DTYPE_CODE[value.dtype], int(value.requires_grad), ndim, *shape,
                        *_ZEROS[ndim], nbytes), raw)


def _bytes_of(value: torch.Tensor) -> bytes:
    """``value``'s bytes in C order, copied to the host."""
    # Each torch call that makes a tensor or an array costs several times more in the middle
    # of a step (the forward has just evicted the caches) than in a loop. So a contiguous host
    # tensor's bytes are read where they lie, with calls that make nothing; a strided one numpy
    # lays out in C order.
    try:
        if value.is_cpu and value.is_contiguous() and not value.is_conj() and not value.is_neg():
            nbytes = value.nbytes
            return _string_at(value.data_ptr(), nbytes) if nbytes else b""
        return value.detach().numpy().tobytes()
    except (TypeError, RuntimeError):  # on an accelerator; strided bfloat16; a conjugate view
        data = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        return data.reshape(-1).view(torch.uint8).numpy().tobytes()


def _uint8(data) -> torch.Tensor:
    """A uint8 tensor over ``data`` (a bytearray or a memoryview of one), sharing its bytes.
    Never empty here: a batch has its 16-byte header, and a rest exists only past ``_CAP``."""
    return torch.frombuffer(data, dtype=torch.uint8)


def _values(view: memoryview, count: int, device: torch.device) -> list:
    """``[(tag, value)]`` of a packed batch (``_pack``) whose ``count`` values ``view``
    holds, each a tensor of its own on ``device`` (the batch's buffer is reused)."""
    meta = struct.unpack_from(f"<{_META * count}q", view, 16)
    at = 16 + 8 * _META * count
    on_host = device.type == "cpu"
    out = []
    for i in range(count):
        tag, code, grad, ndim, *rest = meta[_META * i: _META * (i + 1)]
        shape, nbytes = rest[:ndim], rest[-1]
        dtype = DTYPES[code]
        if not nbytes:
            data = torch.empty(shape, dtype=dtype)
        elif on_host and not grad:  # a copy of its own: the bytes copied without a torch call
            data = torch.frombuffer(bytearray(view[at:at + nbytes]), dtype=dtype).view(shape)
        else:
            data = torch.frombuffer(view, dtype=dtype, count=nbytes // dtype.itemsize,
                                    offset=at).view(shape)
            if not on_host:
                data = data.to(device)  # where this rank's stage computes: a copy
        # A graph of its own: a non-leaf copy, editable in place, that `with x.backward():`
        # accepts. Its leaf may view the receive buffer: no backward reads a leaf's data.
        out.append((tag, data.requires_grad_(True).clone() if grad else data))
        at += _round(nbytes)
    return out


def _last_with(ops: list, peer: int):
    """The index of the last of the schedule's ops with ``peer``, or None."""
    for i in range(len(ops) - 1, -1, -1):
        if ops[i].peer == peer:
            return i
    return None


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pack(entries: list) -> bytearray:
    """One batch as bytes: [total bytes, count], each value's metadata, then the values, each
    starting at a multiple of ``_ALIGN`` (the header is one: 16 + 112 bytes per value)."""
    metas = b"".join([meta for meta, _ in entries])  # each packed already (_entry)
    total = 16 + len(metas) + sum([len(raw) for _, raw in entries])
    out = bytearray(_HEAD(total, len(entries)))
    out += metas
    for _, raw in entries:
        out += raw
    return out

