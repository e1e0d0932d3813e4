"""Bodies that ask for different values on different ranks, in a pipeline: how ``Messages``
(``messages.py``) makes them raise on every rank instead of hanging.

Every rank runs the same body, so the batches one rank sends another are those the other
receives. A body with rank-dependent requests (``if rank == 0: x = model.layers[3].output``)
breaks that: a send nobody receives, or a receive nobody sends, would wait forever. So
every rank sends every other, once its bodies are done, the tags of the values it owes
and is owed by each rank; when the step ends each compares the whole table, and all
raise alike if two ranks differ. (Sent while the step runs on, that costs a rank whose
bodies end early nothing at the end, where an all_gather would make it wait for the last.) A rank
that waits in vain for a batch of a peer that has finished its step finds out from the
peer's list of sends, which a rank whose end-of-step check takes long writes to the job's
store. A rank that waits in vain during the step (a batch off the schedule's messages:
DeepSpeed's pipeline, GPUs, stages that are not neighbours) asks the peer's failure
watcher, which writes what its rank has sent so far and which batches have gone
(``publish_state``).
"""
from __future__ import annotations

import struct
import time
import zlib

import torch

from ...config import config
from ...errors import TraceStateError
from ..ranks.agreement import ask


class RequestChecks:
    """The part of ``Messages`` that compares the ranks' requests. It reads the records
    ``Messages`` keeps: ``promised``, ``wanted``, ``got``, ``sent_to``, ``gone``, ``told``,
    ``check``, and its ``engine``, ``channel``, ``rank`` and ``world``."""

    def post_check_receives(self) -> None:
        """Post the receives of the peers' numbers for the end-of-step check. ``start_check``
        does it if nobody did before; a stage that idles until the first activation comes does
        it then, so that the end of its step only sends (its bodies end last, with the peers
        waiting for its numbers)."""
        self.check_recvs = recvs = {}
        for peer in range(self.world):
            if peer != self.rank:
                theirs = torch.full((2 * self.world + 1,), -1, dtype=torch.int64)
                # stays -1 until their numbers land (a digest is never negative)
                recvs[peer] = (theirs, self.channel.recv([theirs], peer, _CHECK))

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
        if self.check_recvs is None:
            self.post_check_receives()
        sends = [self.channel.send([mine], peer, _CHECK) for peer in peers if peer != self.rank]
        self.check = (mine, sends, self.check_recvs)

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
        store, key = self.engine.store, f"{self._sends_key()}/{src}/{self.rank}"
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
        return f"distgrad/pipeline-sends/{self.engine.running}"

    def _wait_agreeing(self, theirs: torch.Tensor, work) -> None:
        """Wait for a peer's numbers of the end-of-step check, reading the failure key every
        ``failure_timeout`` seconds; after the first slice, publish this rank's sends for a
        peer that waits for a batch none is coming of."""
        def after_slice():
            self.engine.check_failure()
            if not self.told:
                self.told = True
                self._publish(self.engine.store, "*")  # every batch has gone

        _wait_landing(theirs.numpy(), self.engine, after_slice)
        work.wait()  # landed, or landing: nothing can stop it now

    def _wait_for_batch(self, buf: torch.Tensor, work, src: int, key, tag: int) -> None:
        """Wait for ``src``'s batch ``key`` (first message tagged ``tag``) to land in ``buf``,
        giving up if ``src`` has let its moment pass without sending it, or if a rank failed."""
        asked = []

        def after_slice():
            self.engine.check_failure()
            if not asked:  # src's failure watcher then says what src has sent (publish_state)
                asked.append(True)
                ask(self.engine.store, self.engine.running)
            published = self._published(src)
            if published is not None and tag not in published[0] and (
                    published[1] is None or tag in published[1]):
                raise TraceStateError(
                    _MISMATCH + f"this rank, {self.rank}, waits for values of batch {key} "
                    f"that rank {src} did not send: its body did not ask for them).")

        _wait_landing(buf[:8].view(torch.int64).numpy(), self.engine, after_slice)
        work.wait()  # landed, or landing: nothing can stop it now


def _wait_landing(head, engine, after_slice) -> None:
    """Return once ``head[0]`` (a receive buffer's first number, -1 until it lands) has landed,
    raising as soon as the failure watcher has seen a rank fail, and calling ``after_slice``
    (which may raise) every ``failure_timeout`` seconds until then.

    The receive is polled, with sleeps of at most 0.2 ms, rather than waited for: a timed wait
    on a gloo receive closes the group when it expires, and a receive handed to a helper thread
    that this rank gives up on can complete while the interpreter exits (a peer's connection
    closes), when the thread cannot take the GIL back: the process aborts ("terminate called
    without an active exception"). A failed gloo receive says so only in its ``wait()``, so the
    failure comes from the watcher, which reads it before the store's host can exit."""
    if head[0] != -1:
        return
    pause, now = 0.00005, time.monotonic()
    slice_ends, look_ends = now + config.failure_timeout, now + 0.1
    while head[0] == -1:
        time.sleep(pause)
        pause = min(pause * 2, 0.0002)
        now = time.monotonic()
        if now > look_ends:
            engine.check_failure(ask_the_store=False)
            look_ends = now + 0.1
        if now > slice_ends:
            after_slice()
            slice_ends = time.monotonic() + config.failure_timeout


_CHECK = 1 << 24  # the end-of-step check's tag, apart from every batch's (_tag)
_MISMATCH = ("the pipeline body asked for different values on different ranks (every rank runs "
             "the body and serves the same requests: keep requests such as `.output` and `.grad` "
             "out of rank-dependent branches like `if rank == 0:`, and branch on the values "
             "instead; ")


def _digest(tags) -> int:
    """The number of ``tags`` and a checksum of them, as one int64 every rank computes alike."""
    tags = sorted(tags)
    return (len(tags) << 32) | zlib.crc32(struct.pack(f"<{len(tags)}q", *tags))
