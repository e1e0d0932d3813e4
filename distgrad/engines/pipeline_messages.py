"""Values between pipeline stages: what ``pipeline_run.py`` sends from a value's owner to the
other ranks.

Values travel in *batches*: every value an owner sends to one rank for one delivery moment of the
receiver (``("F", m)``, ``("B", m)`` or ``"end"``, see ``pipeline.py``) goes together, sent
when the owner's chunk that produced them ends (``"end"``: when its step ends). That moment
causally precedes the receiver's event, so a receiver never waits for a sender that waits for it.
Between neighbouring stages a batch rides on the schedule's own message of that chunk (the
activation forward, the input gradient backward; ``outgoing``, ``incoming``, ``arrived``). Every
other batch is a message of its own on a gloo group of distgrad's, apart from the schedule's
traffic. What every rank's bodies asked of every other is compared across ranks when the step
ends (``start_check``, ``_agree``).

gloo's point-to-point is a rendezvous (the bytes move only once both sides have posted), so a
receive posted at the moment the value is needed costs round trips between two busy processes.
The receiver therefore posts a batch's receive as soon as a body first asks for one of its
values, long before the event, into a buffer of ``_CAP`` bytes (gloo accepts a shorter message);
a batch longer than that sends the rest in a second message. Tags pair a send with its receive:
every rank runs the same body, so both sides name the same batch.

A receive is never waited for with a timeout: when a timed gloo receive expires, gloo closes
every connection of the group, so a peer that is merely slow (a long stage) would break the job.
A batch whose first bytes have landed is waited for in place; one that has not is waited for on
a helper thread (``helper_waits.py``) while this one reads, every ``config.failure_timeout``
seconds, the job's failure key and the peer's list of sends (``_wait_for_batch``).
"""
from __future__ import annotations

import struct
import time
import zlib

import torch

from ..errors import OutOfOrderError, TraceStateError
from .agreement import ask
from .collective import _CODE, _DTYPES
from .helper_waits import wait_on_a_helper

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
        self.carry_to, self.carry_from = engine.carry_to, engine.carry_from  # see carry()
        self.carried: dict = {}   # (phase, microbatch) -> where the carried bytes arrive
        self.room = engine.carry_room  # receive buffers with room, kept across steps
        self.swapped: list = []   # (stage record, its own buffer) while ours stands in
        # What went and came on the channel, by peer: compared across ranks when the step ends
        self.sent_to: dict = {}   # dst -> [tags of batches sent]
        self.rank, self.world = engine._job_rank, engine._job_world
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
            self.promised.setdefault(dst, []).append(tag)

    def want(self, src: int, tag: int) -> None:
        """A body here asked for value ``tag`` of ``src``'s stage."""
        self.wanted.setdefault(src, []).append(tag)

    def flush(self, key) -> None:
        """Send batch ``key`` to each rank that has values in it."""
        self.sent.add(key)
        batches = self.outbox.pop(key, {})
        carrier = None if key == "end" else self.carry_to if key[0] == "F" else self.carry_from
        if carrier is not None:  # that one goes with the schedule's message (outgoing)
            self.outbox[key] = {carrier: batches.pop(carrier, [])}
        for dst, entries in batches.items():
            self._send(_pack(entries), dst, key)
        self.gone.append(_tag(key, 0))  # after the sends: a peer reading it sees them too

    def _send(self, data: torch.Tensor, dst: int, key, carried: bool = False) -> None:
        # sent from the bytes as they are: keep them until it went. A carried batch went with
        # the schedule's message, up to _CAP bytes: only a longer one's rest goes here.
        if not carried:
            self.sent_to.setdefault(dst, []).append(_tag(key, 0))
            self.pending.append((data, self.channel.send([data[:_CAP]], dst, _tag(key, 0))))
        if data.numel() > _CAP:
            self.pending.append((data, self.channel.send([data[_CAP:]], dst, _tag(key, 1))))

    # -- values that travel with the schedule's own messages (PipelineEngine.carry) -----------
    # Forward: activations to the next stage carry ("F", m) batches for it; backward: input
    # gradients to the previous stage carry ("B", m) batches. Every such message is received
    # with room for a batch, and a message that brings none means an empty one, so a receiver
    # never waits for a batch that does not come.
    def outgoing(self, phase: str, chunk: int, ops: list) -> list:
        """The schedule's sends of ``chunk`` in ``phase``, the last one to the neighbour replaced
        by one message of its bytes followed by this rank's batch for that rank, if any."""
        key, dst = (phase, chunk), self.carry_to if phase == "F" else self.carry_from
        entries = self.outbox.pop(key, {}).get(dst)
        at = _last_with(ops, dst)
        if at is None:  # nothing of the schedule's goes there: send the batch on its own
            self._send(_pack(entries or []), dst, key)
            return ops
        if not entries:  # the message as the schedule made it: the receiver sees no batch
            return ops
        data = _pack(entries)
        op = ops[at]
        head = op.tensor.detach().reshape(-1).view(torch.uint8)
        size = head.numel()
        both = torch.empty(size + min(data.numel(), _CAP), dtype=torch.uint8)
        both[:size].copy_(head)
        both[size:].copy_(data[:_CAP])
        self.pending.append((both, None))
        if data.numel() > _CAP:
            self._send(data, dst, key, carried=True)
        op.tensor = both  # (the op is the schedule's own, made for this one message)
        return ops

    def incoming(self, phase: str, chunk: int, ops: list, infos=()) -> list:
        """The schedule's receives of ``chunk`` in ``phase``, the last one from the neighbour
        received into a buffer with room for that rank's batch after the schedule's bytes.
        ``infos``: the stage's records of what it receives; the one whose buffer this is gets
        a view of the bytes in that buffer, so nothing needs copying when they arrive."""
        key, src = (phase, chunk), self._carrier(phase)
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

    def arrived(self, phase: str, chunk: int) -> None:
        """As this stage starts ``chunk`` in ``phase`` (the schedule has waited for its
        receives): unpack the batch that came with the schedule's bytes."""
        key = (phase, chunk)
        found = self.carried.pop(key, None)
        if found is None:
            return
        copy_to, both, view, size = found
        if copy_to is not None:
            copy_to.detach().view(-1).view(torch.uint8).copy_(both[:size])
        src = self._carrier(phase)
        self.posted[(src, key)] = [None, None, "carried"]
        if struct.unpack_from("<q", view, size)[0] != -1:
            self._parse(src, key, both[size:])

    def give_back(self) -> None:
        """The stage's own receive buffers again (end of the trace)."""
        for info, tensor in reversed(self.swapped):
            info.buffer = tensor
        self.swapped.clear()

    def _carrier(self, phase: str):
        """The rank whose messages of ``phase`` to this one carry batches, if any."""
        return self.carry_from if phase == "F" else self.carry_to

    def finish(self) -> None:
        """Send what is left (the ``"end"`` batches), check with every rank that each value sent
        has a body that asked for it and the other way round, and wait until every send was
        received."""
        for key in list(self.outbox):
            self.flush(key)
        if self.check is None:
            self.start_check()
        self._agree()
        # every send now has a receive posted: it completes unless a connection breaks
        for _, work in self.pending:
            if work is not None:
                work.wait()
        self.pending.clear()

    # -- the receiver ------------------------------------------------------------------------
    def expect(self, src: int, key) -> None:
        """Post the receive of ``src``'s batch ``key`` now, so that it arrives in the background."""
        if (src, key) not in self.posted:
            if key != "end" and src == self._carrier(key[0]):
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
        self._wait_for_batch(buf, work, src, key)
        entry[1] = None
        self._parse(src, key, buf)
        _SPARE.append(buf)  # its values are copied out: the next receive may reuse it

    def _parse(self, src: int, key, buf: torch.Tensor) -> None:
        view = memoryview(buf.numpy())
        total, count = struct.unpack_from("<2q", view)
        if total > _CAP:
            rest = torch.empty(total - _CAP, dtype=torch.uint8)
            self.channel.recv([rest], src, _tag(key, 1)).wait()  # sent with the first part
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

    # -- bodies that ask for different values on different ranks ------------------------------
    # Every rank runs the same body, so the batches one rank sends another are those the other
    # receives. A body with rank-dependent requests (``if rank == 0: x = model.layers[3].output``)
    # breaks that: a send nobody receives, or a receive nobody sends, would wait forever. So
    # every rank sends every other, once its bodies are done, the tags of the values it owes
    # and is owed by each rank; when the step ends each compares the whole table, and all
    # raise alike if two ranks differ. (Sent while the step runs on, that costs a rank whose
    # bodies end early nothing at the end; an all_gather at the end cost about 1 ms.) A rank
    # that waits in vain for a batch of a peer that has finished its step finds out from the
    # peer's list of sends, which a rank whose end-of-step check takes long writes to the job's
    # store. A rank that waits in vain during the step (a batch off the schedule's messages:
    # DeepSpeed's pipeline, GPUs, stages that are not neighbours) asks the peer's failure
    # watcher, which writes what its rank has sent so far and which batches have gone
    # (``publish_state``).
    def start_check(self) -> None:
        """Once this rank's bodies are done (they have made every request they will make): send
        every peer this rank's numbers - for each rank, the count and checksum of the value tags
        it promised that rank and asked of it, and how many values came that no body asked for
        so far - and post the receives of theirs. Point-to-point on distgrad's channel, so that
        it travels while the step runs on and never holds up closing the group on a failure (a
        pending collective would)."""
        peers = range(self.world)
        mine = torch.tensor([_digest(self.promised.get(p, ())) for p in peers] +
                            [_digest(self.wanted.get(p, ())) for p in peers] + [len(self.got)],
                            dtype=torch.int64)
        sends, recvs = [], {}
        for peer in range(self.world):
            if peer != self.rank:
                theirs = torch.empty_like(mine)
                theirs[0] = -1  # stays so until their numbers land (a digest is never negative)
                recvs[peer] = (theirs, self.channel.recv([theirs], peer, _CHECK))
                sends.append(self.channel.send([mine], peer, _CHECK))
        self.check = (mine, sends, recvs)

    def _agree(self) -> None:
        mine, sends, recvs = self.check
        rows = [mine if r == self.rank else None for r in range(self.world)]
        for peer, (theirs, work) in recvs.items():
            self._wait_agreeing(theirs, work)
            rows[peer] = theirs
        for work in sends:
            work.wait()  # the peer posted its receive when it started its check
        table = [row.tolist() for row in rows]
        w = self.world
        wrong = [f"rank {s} sent rank {r} {table[s][r] >> 32} value(s), rank {r} asked for "
                 f"{table[r][w + s] >> 32}" for s in range(w) for r in range(w)
                 if s != r and table[s][r] != table[r][w + s]]
        wrong += [f"rank {r} got {table[r][-1]} value(s) its body did not ask for"
                  for r in range(w) if table[r][-1]]
        if wrong:
            raise TraceStateError(_MISMATCH + "; ".join(wrong) + ").")

    def _published(self, src: int):
        """What ``src`` has said it sent this rank: ``(tags of the batches sent, tags of the
        moments whose batches have gone, or None for all of them)``, or None if it has said
        nothing yet."""
        store, key = self.engine._store, f"{self._sends_key()}/{src}/{self.rank}"
        try:
            if not store.check([key]):
                return None
            sent, gone = store.get(key).decode().split(";")
        except Exception:
            return None
        tags = {int(t) for t in sent.split(",") if t}
        return tags, None if gone == "*" else {int(t) for t in gone.split(",") if t}

    def _publish(self, store, gone: str) -> None:
        for dst in range(self.world):
            if dst != self.rank:
                sent = ",".join(map(str, self.sent_to.get(dst, ())))
                store.set(f"{self._sends_key()}/{self.rank}/{dst}", f"{sent};{gone}")

    def publish_state(self, store, rank: int, running: int, where: str) -> None:
        """From this rank's failure watcher (another thread), once a waiting peer has asked:
        the batches sent so far. (Snapshots: every list here only grows, and a batch whose
        moment has gone never comes.)"""
        if not self.told:
            self._publish(store, ",".join(map(str, list(self.gone))))

    def _sends_key(self) -> str:
        return f"distgrad/pipeline-sends/{self.engine._running}"

    def _wait_agreeing(self, theirs: torch.Tensor, work) -> None:
        """Wait for a peer's numbers of the end-of-step check, reading the failure key every
        ``failure_timeout`` seconds; after the first slice, publish this rank's sends for a
        peer that waits for a batch none is coming of. Until their first number lands this
        polls the buffer, with sleeps of at most 0.2 ms, rather than hand the receive to a
        helper thread: a thread left blocked in a gloo receive when a failure ends the job can
        abort the process at exit ("terminate called without an active exception")."""
        first = theirs.numpy()
        if first[0] == -1:
            from ..backward import config
            pause, slice_ends = 0.00005, time.monotonic() + config.failure_timeout
            while first[0] == -1:
                time.sleep(pause)
                pause = min(pause * 2, 0.0002)
                if time.monotonic() > slice_ends:
                    self.engine.check_failure()
                    if not self.told:
                        self.told = True
                        self._publish(self.engine._store, "*")  # every batch has gone
                    slice_ends = time.monotonic() + config.failure_timeout
        work.wait()  # landed, or landing: nothing can stop it now

    def _wait_for_batch(self, buf: torch.Tensor, work, src: int, key) -> None:
        """Wait for ``src``'s batch ``key`` to land in ``buf``, giving up if ``src`` has ended
        its step without sending it, or if a rank failed."""
        if int(buf[:8].view(torch.int64)) != -1:  # it is arriving: nothing can stop it now
            work.wait()
            return
        from ..backward import config
        done, failed = wait_on_a_helper(work)
        tag, asked = _tag(key, 0), False
        while not done.wait(config.failure_timeout):
            self.engine.check_failure()
            if not asked:  # src's failure watcher then says what src has sent (publish_state)
                asked = True
                ask(self.engine._store, self.engine._running)
            published = self._published(src)
            if published is not None and tag not in published[0] and (
                    published[1] is None or tag in published[1]):
                raise TraceStateError(
                    _MISMATCH + f"this rank, {self.rank}, waits for values of batch {key} "
                    f"that rank {src} did not send: its body did not ask for them).")
        if failed:
            raise failed[0]


_CHECK = 1 << 24  # the end-of-step check's tag, apart from every batch's (_tag)
_MISMATCH = ("the pipeline body asked for different values on different ranks (every rank runs "
             "the body and serves the same requests: keep requests such as `.output` and `.grad` "
             "out of rank-dependent branches like `if rank == 0:`, and branch on the values "
             "instead; ")


def _digest(tags) -> int:
    """The number of ``tags`` and a checksum of them, as one int64 every rank computes alike."""
    tags = sorted(tags)
    return (len(tags) << 32) | zlib.crc32(struct.pack(f"<{len(tags)}q", *tags))


def _last_with(ops: list, peer: int):
    """The index of the last of the schedule's ops with ``peer``, or None."""
    for i in range(len(ops) - 1, -1, -1):
        if ops[i].peer == peer:
            return i
    return None


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

