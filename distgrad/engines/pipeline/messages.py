"""Values between pipeline stages: what a trace sends from a value's owner to the other ranks.

Values travel in *bundles*: every value an owner sends to one rank for one receiving action of
that rank (``("F", stage, m)``, ``("B", stage, m)`` or ``"end"``, see ``placement.py``) goes
together, sent when the owner's action that produced them ends (``"end"``: when its bodies are
done, or its step ends if that comes first). That action causally precedes the receiver's, so a
receiver never waits for a sender that waits for it.
Between neighbouring stages a bundle rides on the schedule's own message of that action (the
activation forward, the input gradient backward; ``outgoing``, ``incoming``, ``arrived``). Every
other bundle is a message of its own on a gloo group of distgrad's, apart from the schedule's
traffic. What every rank's bodies asked of every other is compared across ranks when the step
ends (``checks.py``).

gloo's point-to-point is a rendezvous (the bytes move only once both sides have posted), so a
receive posted when the value is needed costs round trips between two busy processes. The
receiver therefore posts a bundle's receive as soon as a body first asks for one of its values,
long before the action, into a buffer of ``_CAP`` bytes (gloo accepts a shorter message); a
bundle longer than that sends the rest in a second message. Tags pair a send with its receive:
every rank runs the same body, so both sides name the same bundle.

A receive is never waited for with a timeout: when a timed gloo receive expires, gloo closes
every connection of the group, so a peer that is merely slow (a long stage) would break the job.
A bundle whose first bytes have landed is waited for in place; until they land, the buffer is
polled, the failure watcher's news looked at every 0.1 s, and every ``config.failure_timeout``
seconds the job's failure key and the peer's list of sends are read
(``RequestCheck.wait_for_bundle``).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from ...errors import OutOfOrderError
from ..ranks.layout import DTYPE_CODE, DTYPES

_string_at = ctypes.string_at  # the bytes at an address: one copy, nothing else made

_CAP = 1 << 16  # bytes of a bundle in its first message
_META = 14  # int64s per value: tag, dtype code, requires_grad, ndim, shape (9), nbytes
_ALIGN = 16  # payloads start at multiples of this, so that they view as any dtype
_ZEROS = [(0,) * (_META - 5 - n) for n in range(_META - 4)]  # shape padding by ndim
_META_BYTES = struct.Struct(f"<{_META}q").pack  # one value's metadata, packed as it is queued
_HEAD = struct.Struct("<2q").pack  # a bundle's total bytes and its number of values
_SPARE: list = []  # receive buffers whose bundles are unpacked, for the next receives


MOST_MICROBATCHES = 4096  # per step: keeps every bundle's tag below the check's (checks._CHECK)


def _tag(action, part: int) -> int:
    """The message tag of the bundle for ``action``: ``"end"`` or ``(phase, receiving stage,
    microbatch)``."""
    if action == "end":
        return 4 + part
    return 2 * (3 + 2 * (action[1] * MOST_MICROBATCHES + action[2]) + (action[0] == "B")) + part


class Messages:
    """One trace's sends and receives of bundles. ``channel``: distgrad's gloo group;
    ``placement``: its piggyback links; ``buffers``: receive buffers with room for a bundle,
    kept across steps (``PipelineAdapter.piggyback_buffers``); ``device``: where received values
    go; ``check``: the ``RequestCheck`` told of every value queued, asked for and sent."""

    def __init__(self, channel, placement, buffers: dict, device, check):
        self.channel, self.device, self.check = channel, device, check
        # per stage of this rank, the rank whose schedule messages with it carry bundles
        self.piggyback_to, self.piggyback_from = placement.piggyback_to, placement.piggyback_from
        self.piggybacked: dict = {}  # action -> where its piggybacked bytes arrive (incoming)
        self.buffers = buffers
        self.replaced: list = []  # (stage's receive record, its own buffer) while ours stands in
        self.outbox: dict = {}  # action -> {dst: [(tag, copy of the value)]}
        self.flushed: set = set()  # actions whose bundles are going (no value may join them)
        self.pending: list = []  # send works and their buffers, until finish()
        self.posted: dict = {}  # (src, action) -> [buffer, work]; work None once unpacked
        self.received: dict = {}  # (src, tag) -> a value unpacked from a bundle, until taken

    # -- the owner ---------------------------------------------------------------------------
    def send(self, value, tag: int, actions: dict) -> None:
        """Queue ``value`` for each ``dst`` in ``actions``, in its bundle for ``actions[dst]``."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"distgrad sends only tensors between pipeline stages; this value is "
                f"a {type(value).__name__}. Read a tensor inside it on its stage."
            )
        if not actions:  # no other rank (a one-rank pipeline): nothing to pack
            return
        entry = _entry(value, tag)
        for dst, action in actions.items():
            if action in self.flushed:
                raise RuntimeError(f"distgrad: a value for bundle {action} came after it was sent.")
            self.outbox.setdefault(action, {}).setdefault(dst, []).append(entry)
            self.check.owe(dst, tag)

    def flush(self, action) -> None:
        """Send the bundles for ``action`` to each rank that has values in one."""
        self.flushed.add(action)
        bundles = self.outbox.pop(action, {})
        peer = (
            None
            if action == "end"
            else self.piggyback_to.get(action[1] - 1)
            if action[0] == "F"
            else self.piggyback_from.get(action[1] + 1)
        )
        if peer is not None:  # that one rides on the schedule's message (outgoing)
            self.outbox[action] = {peer: bundles.pop(peer, [])}
        for dst, entries in bundles.items():
            self._send(_pack(entries), dst, action)
        self.check.bundle_flushed(_tag(action, 0))

    def _send(self, data: bytearray, dst: int, action, piggybacked: bool = False) -> None:
        # sent from the bytes as they are (the tensor views them): kept until it went. A
        # piggybacked bundle went with the schedule's message, up to _CAP bytes: only a
        # longer one's rest goes here.
        if not piggybacked:
            self.check.bundle_sent(dst, _tag(action, 0))
            part = _uint8(memoryview(data)[:_CAP])
            self.pending.append((part, self.channel.send([part], dst, _tag(action, 0))))
        if len(data) > _CAP:
            rest = _uint8(memoryview(data)[_CAP:])
            self.pending.append((rest, self.channel.send([rest], dst, _tag(action, 1))))

    def bodies_done(self) -> None:
        """Every request is made, so nothing more joins the ``"end"`` bundles: they go now, not
        when the step ends, since a peer's bodies and its part of the check wait for them. Then
        the check of the requests starts, and travels while the step runs on."""
        if "end" not in self.flushed:
            self.flush("end")
        self.check.start(unclaimed=len(self.received))

    # -- bundles that ride on the schedule's own messages (PipelineAdapter.piggyback) ---------
    # Forward: activations to the next stage carry ("F", stage, m) bundles for it; backward:
    # input gradients to the previous stage carry ("B", stage, m) bundles. Every such message
    # is received with room for a bundle, and a message that brings none means an empty one, so
    # a receiver never waits for a bundle that does not come.
    def outgoing(self, phase: str, stage: int, chunk: int, ops: list) -> list:
        """The schedule's sends of ``stage``'s ``chunk`` in ``phase``, the last one to the
        neighbour replaced by one message of its bytes followed by this rank's bundle for that
        rank, if any."""
        if phase == "F":
            action, dst = ("F", stage + 1, chunk), self.piggyback_to[stage]
        else:
            action, dst = ("B", stage - 1, chunk), self.piggyback_from[stage]
        entries = self.outbox.pop(action, {}).get(dst)
        last = _last_with(ops, dst)
        if last is None:  # nothing of the schedule's goes there: send the bundle on its own
            self._send(_pack(entries or []), dst, action)
            return ops
        if not entries:  # the message as the schedule made it: the receiver sees no bundle
            return ops
        data = _pack(entries)
        op = ops[last]
        # The schedule's bytes, then the bundle's first _CAP, joined in Python: putting them
        # together with torch calls (a flat byte view of the activation, an empty tensor, slices
        # and copies) makes tensors in the middle of a step, where each costs far more than in
        # a loop (docs/performance.md); one tensor made over the joined bytes does not.
        both = bytearray(_bytes_of(op.tensor))
        both += memoryview(data)[:_CAP]
        op.tensor = _uint8(both)  # (the op is the schedule's own, made for this one message)
        self.pending.append((op.tensor, None))
        if len(data) > _CAP:
            self._send(data, dst, action, piggybacked=True)
        return ops

    def incoming(self, phase: str, stage: int, chunk: int, ops: list, infos=()) -> list:
        """The schedule's receives of ``chunk`` in ``phase``, the last one from the neighbour
        received into a buffer with room for that rank's bundle after the schedule's bytes.
        ``infos``: the stage's records of what it receives; the one whose buffer this is gets
        a view of the bytes in that buffer, so nothing needs copying when they arrive."""
        action, src = (phase, stage, chunk), self._piggyback_peer(phase, stage)
        last = _last_with(ops, src)
        if last is None:  # the sender's ``outgoing`` found no message of the schedule's either
            self._post(src, action)
            return ops
        op = ops[last]
        tensor = op.tensor
        size = tensor.numel() * tensor.element_size()
        kept = self.buffers.get(action)  # kept by the engine: the same buffers every step
        if kept is None or kept[0] != (tensor.shape, tensor.dtype):
            both = torch.empty(size + _CAP, dtype=torch.uint8)
            kept = self.buffers[action] = (
                (tensor.shape, tensor.dtype),
                both,
                memoryview(both.numpy()),
                both[:size].view(tensor.dtype).view(tensor.shape),
            )
        _, both, view, inside = kept
        info = next((i for i in infos if i.buffer is tensor), None)
        if info is not None:  # the schedule reads its input where the bytes land
            self.replaced.append((info, tensor))
            info.buffer = inside
        struct.pack_into("<q", view, size, -1)  # a bundle's length; stays -1 if none comes along
        self.piggybacked[action] = (None if info is not None else tensor, both, view, size)
        op.tensor = both
        return ops

    def arrived(self, phase: str, stage: int, chunk: int) -> None:
        """As ``stage`` starts ``chunk`` in ``phase`` (the schedule has waited for its
        receives): unpack the bundle that came with the schedule's bytes."""
        action = (phase, stage, chunk)
        found = self.piggybacked.pop(action, None)
        if found is None:
            return
        copy_to, both, view, size = found
        if copy_to is not None:
            copy_to.detach().view(-1).view(torch.uint8).copy_(both[:size])
        src = self._piggyback_peer(phase, stage)
        self.posted[(src, action)] = [None, None]  # arrived with the schedule's bytes
        if struct.unpack_from("<q", view, size)[0] != -1:
            self._parse(src, action, view[size:])

    def give_back(self) -> None:
        """The stage's own receive buffers again (end of the trace)."""
        for info, tensor in reversed(self.replaced):
            info.buffer = tensor
        self.replaced.clear()

    def _piggyback_peer(self, phase: str, stage: int):
        """The rank whose messages of ``phase`` to this rank's ``stage`` carry bundles, if any."""
        return self.piggyback_from.get(stage) if phase == "F" else self.piggyback_to.get(stage)

    def finish(self) -> None:
        """Send what is left (the ``"end"`` bundles), check with every rank that each value sent
        has a body that asked for it and the other way round, and wait until every send was
        received."""
        for action in list(self.outbox):
            self.flush(action)
        self.check.agree()  # (started when the bodies were done: bodies_done)
        # every send now has a receive posted: it completes unless a connection breaks
        for _, work in self.pending:
            if work is not None:
                work.wait()
        self.pending.clear()

    # -- the receiver ------------------------------------------------------------------------
    def expect(self, src: int, action) -> None:
        """Post the receive of ``src``'s bundle for ``action`` now, so that it arrives in the
        background."""
        if (src, action) not in self.posted:
            if action != "end" and src == self._piggyback_peer(action[0], action[1]):
                return  # it comes with the schedule's message (incoming, arrived)
            self._post(src, action)

    def _post(self, src: int, action) -> None:
        buf = _SPARE.pop() if _SPARE else torch.empty(_CAP, dtype=torch.uint8)
        buf[:8].view(torch.int64).fill_(-1)  # a bundle's length once its first bytes land
        self.posted[(src, action)] = [buf, self.channel.recv([buf], src, _tag(action, 0))]

    def take(self, src: int, action, tag: int) -> torch.Tensor:
        """The value ``tag`` of ``src``'s bundle for ``action``, waiting for the bundle if need
        be."""
        self.expect(src, action)
        entry = self.posted.get((src, action))
        if entry is None:  # a piggybacked bundle is unpacked before its action: not reached
            raise RuntimeError(f"distgrad: bundle {action} of rank {src} was taken before it came.")
        if entry[1] is not None:
            self._unpack(src, action, entry)
        value = self.received.pop((src, tag), None)
        if value is None:
            # The owner's body asked for it only after the action that would have produced it
            # (so it raises there too), or the bodies differ: waiting would never end.
            raise OutOfOrderError(
                f"rank {src} did not send a value this body asked for (bundle {action}): either "
                f"its stage had passed it when its own body asked for it (in a pipeline, request "
                f"values in forward order, stage by stage, and gradients in reverse), or its body "
                f"never asked for it (keep requests out of rank-dependent branches such as "
                f"`if rank == 0:`)."
            )
        return value

    def _unpack(self, src: int, action, entry) -> None:
        buf, work = entry
        self.check.wait_for_bundle(buf, work, src, action, _tag(action, 0))
        entry[1] = None
        self._parse(src, action, memoryview(buf.numpy()))
        _SPARE.append(buf)  # its values are copied out: the next receive may reuse it

    def _parse(self, src: int, action, view: memoryview) -> None:
        """Take the values of the bundle whose first part ``view`` holds (its buffer is
        reused)."""
        total, count = struct.unpack_from("<2q", view)
        if total > _CAP:
            rest = bytearray(total - _CAP)
            self.channel.recv([_uint8(rest)], src, _tag(action, 1)).wait()  # sent with the first
            view = memoryview(bytearray(view[:_CAP]) + rest)
        for tag, value in _values(view, count, self.device):
            self.received[(src, tag)] = value


def _entry(value: torch.Tensor, tag: int) -> tuple:
    """``value`` as it is now, for a bundle: its metadata (``_META`` int64s, packed) and its
    bytes, padded to ``_ALIGN``. The bytes are taken now because the body may edit the value in
    place before the bundle goes (gloo and the packing work on host memory: a GPU value is copied
    to the host here)."""
    shape = value.shape
    ndim = len(shape)
    if ndim > _META - 5:
        raise ValueError(
            f"distgrad sends tensors of at most {_META - 5} dimensions between "
            f"pipeline stages, not {ndim}."
        )
    raw = _bytes_of(value)
    nbytes = len(raw)
    if nbytes % _ALIGN:
        raw += bytes(_ALIGN - nbytes % _ALIGN)
    return (
        _META_BYTES(
            tag,
            DTYPE_CODE[value.dtype],
            int(value.requires_grad),
            ndim,
            *shape,
            *_ZEROS[ndim],
            nbytes,
        ),
        raw,
    )


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
    Never empty here: a bundle has its 16-byte header, and a rest exists only past ``_CAP``."""
    return torch.frombuffer(data, dtype=torch.uint8)


def _values(view: memoryview, count: int, device: torch.device) -> list:
    """``[(tag, value)]`` of a packed bundle (``_pack``) whose ``count`` values ``view``
    holds, each a tensor of its own on ``device`` (the bundle's buffer is reused)."""
    meta = struct.unpack_from(f"<{_META * count}q", view, 16)
    offset = 16 + 8 * _META * count
    on_host = device.type == "cpu"
    out = []
    for i in range(count):
        tag, code, grad, ndim, *rest = meta[_META * i : _META * (i + 1)]
        shape, nbytes = rest[:ndim], rest[-1]
        dtype = DTYPES[code]
        if not nbytes:
            data = torch.empty(shape, dtype=dtype)
        elif on_host and not grad:  # a copy of its own: the bytes copied without a torch call
            data = torch.frombuffer(bytearray(view[offset : offset + nbytes]), dtype=dtype).view(
                shape
            )
        else:
            data = torch.frombuffer(
                view, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset
            ).view(shape)
            if not on_host:
                data = data.to(device)  # where this rank's stage computes: a copy
        # A graph of its own: a non-leaf copy, editable in place, that `with x.backward():`
        # accepts. Its leaf may view the receive buffer: no backward reads a leaf's data.
        out.append((tag, data.requires_grad_(True).clone() if grad else data))
        offset += _round(nbytes)
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
    """One bundle as bytes: [total bytes, count], each value's metadata, then the values, each
    starting at a multiple of ``_ALIGN`` (the header is one: 16 + 112 bytes per value)."""
    metas = b"".join([meta for meta, _ in entries])  # each packed already (_entry)
    total = 16 + len(metas) + sum([len(raw) for _, raw in entries])
    out = bytearray(_HEAD(total, len(entries)))
    out += metas
    for _, raw in entries:
        out += raw
    return out
