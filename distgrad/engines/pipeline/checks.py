"""Bodies that ask for different values on different ranks, in a pipeline: how a trace makes
them raise on every rank instead of hanging (``RequestCheck``, kept by ``messages.py``).

Every rank runs the same body, so the bundles one rank sends another are those the other
receives. A body with rank-dependent requests (``if rank == 0: x = model.layers[3].output``)
breaks that: a send nobody receives, or a receive nobody sends, would wait forever. So
every rank sends every other, once its bodies are done, the tags of the values it owes
and is owed by each rank; when the step ends each compares the whole table, and all
raise alike if two ranks differ. (Sent while the step runs on, that costs a rank whose
bodies end early nothing at the end, where an all_gather would make it wait for the last.) A rank
that waits in vain for a bundle of a peer that has finished its step finds out from the
peer's list of sends, which a rank whose end-of-step check takes long writes to the job's
store. A rank that waits in vain during the step (a bundle off the schedule's messages:
DeepSpeed's pipeline, GPUs, stages that are not neighbours) asks the peer's failure
watcher, which writes what its rank has sent so far and which bundles have gone
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


class RequestCheck:
    """One trace's records of what its bodies asked of each rank and owe it, compared across
    ranks when the step ends. ``Messages`` reports to it the values it queues and the bundles
    it sends, ``Waits`` each value a body asks another rank for; ``engine``: the
    ``PipelineAdapter`` (its store, failure key and trace number); ``channel``: its gloo group
    for distgrad's own messages."""

    def __init__(self, engine, channel):
        self.engine, self.channel = engine, channel
        self.rank, self.world = engine.job_rank, engine.job_world
        # what the check compares, by peer
        self.owed_to: dict = {}  # dst -> [tags of the values this rank sends it]
        self.asked_of: dict = {}  # src -> [tags of the values this rank's bodies asked it for]
        # what a peer that waits in vain reads (publish_state)
        self.sent_to: dict = {}  # dst -> [tags of the bundles sent to it on the channel]
        self.flushed: list = []  # tags of the actions whose bundles have gone
        self.published = False  # whether this rank's sends are in the store for good
        self.receives = None  # {peer: (buffer, receive)} of the peers' numbers, once posted
        self.numbers = None  # this rank's numbers, once sent (start)
        self.sends: list = []  # the sends of those numbers

    # -- what Messages and Waits report -------------------------------------------------------
    def owe(self, dst: int, tag: int) -> None:
        """A value ``tag`` is queued for ``dst``."""
        self.owed_to.setdefault(dst, []).append(tag)

    def ask(self, src: int, tag: int) -> None:
        """A body here asked for value ``tag`` of ``src``'s stage."""
        self.asked_of.setdefault(src, []).append(tag)

    def bundle_sent(self, dst: int, tag: int) -> None:
        self.sent_to.setdefault(dst, []).append(tag)

    def bundle_flushed(self, tag: int) -> None:
        """The bundles of an action have all gone (after their sends: a peer that reads this
        sees them too)."""
        self.flushed.append(tag)

    # -- the end-of-step check ----------------------------------------------------------------
    def post_receives(self) -> None:
        """Post the receives of the peers' numbers for the end-of-step check. ``start`` does it
        if nobody did before; a stage that idles until the first activation comes does it then,
        so that the end of its step only sends (its bodies end last, with the peers waiting for
        its numbers)."""
        self.receives = receives = {}
        for peer in range(self.world):
            if peer != self.rank:
                theirs = torch.full((2 * self.world + 1,), -1, dtype=torch.int64)
                # stays -1 until their numbers land (a digest is never negative)
                receives[peer] = (theirs, self.channel.recv([theirs], peer, _CHECK))

    def start(self, unclaimed: int) -> None:
        """Once this rank's bodies are done (they have made every request they will make): send
        every peer this rank's numbers - for each rank, the count and checksum of the value tags
        it owes that rank and asked of it, and how many values came that no body asked for so
        far (``unclaimed``) - and post the receives of theirs. Point-to-point on distgrad's
        channel, so that it travels while the step runs on and never holds up closing the group
        on a failure (a pending collective would)."""
        peers = range(self.world)
        self.numbers = numbers = torch.tensor(
            [_digest(self.owed_to.get(p, ())) for p in peers]
            + [_digest(self.asked_of.get(p, ())) for p in peers]
            + [unclaimed],
            dtype=torch.int64,
        )
        if self.receives is None:
            self.post_receives()
        self.sends = [
            self.channel.send([numbers], peer, _CHECK) for peer in peers if peer != self.rank
        ]

    def agree(self) -> None:
        """Wait for every peer's numbers and raise, on every rank alike, if two ranks differ."""
        rows = [self.numbers if r == self.rank else None for r in range(self.world)]
        for peer, (theirs, work) in self.receives.items():
            self._wait_agreeing(theirs, work)
            rows[peer] = theirs
        for work in self.sends:
            work.wait()  # the peer posted its receive when it started its check
        table = [row.tolist() for row in rows]
        w = self.world
        wrong = [
            f"rank {s} sent rank {r} {table[s][r] >> 32} value(s), rank {r} asked for "
            f"{table[r][w + s] >> 32}"
            for s in range(w)
            for r in range(w)
            if s != r and table[s][r] != table[r][w + s]
        ]
        wrong += [
            f"rank {r} got {table[r][-1]} value(s) its body did not ask for"
            for r in range(w)
            if table[r][-1]
        ]
        if wrong:
            raise TraceStateError(_MISMATCH + "; ".join(wrong) + ").")

    # -- a peer that waits in vain ------------------------------------------------------------
    def publish_state(self, store, rank: int, running: int, where: str) -> None:
        """From this rank's failure watcher (another thread), once a waiting peer has asked:
        the bundles sent so far. (Snapshots: every list here only grows, and a bundle whose
        action has gone never comes.)"""
        if not self.published:
            self._publish(store, ",".join(map(str, list(self.flushed))))

    def wait_for_bundle(self, buf: torch.Tensor, work, src: int, action, tag: int) -> None:
        """Wait for ``src``'s bundle for ``action`` (first message tagged ``tag``) to land in
        ``buf``, giving up if ``src`` has let the action pass without sending it, or if a rank
        failed."""
        asked = []

        def after_slice():
            self.engine.check_failure()
            if not asked:  # src's failure watcher then says what src has sent (publish_state)
                asked.append(True)
                ask(self.engine.store, self.engine.running)
            published = self._published_by(src)
            if (
                published is not None
                and tag not in published[0]
                and (published[1] is None or tag in published[1])
            ):
                raise TraceStateError(
                    _MISMATCH + f"this rank, {self.rank}, waits for values of bundle {action} "
                    f"that rank {src} did not send: its body did not ask for them)."
                )

        _wait_landing(buf[:8].view(torch.int64).numpy(), self.engine, after_slice)
        work.wait()  # landed, or landing: nothing can stop it now

    def _published_by(self, src: int):
        """What ``src`` has said it sent this rank: ``(tags of the bundles sent, tags of the
        actions whose bundles have gone, or None for all of them)``, or None if it has said
        nothing yet."""
        store, key = self.engine.store, f"{self._sends_key()}/{src}/{self.rank}"
        try:
            if not store.check([key]):
                return None
            sent, flushed = store.get(key).decode().split(";")
        except Exception:
            return None
        tags = {int(t) for t in sent.split(",") if t}
        return tags, None if flushed == "*" else {int(t) for t in flushed.split(",") if t}

    def _publish(self, store, flushed: str) -> None:
        for dst in range(self.world):
            if dst != self.rank:
                sent = ",".join(map(str, self.sent_to.get(dst, ())))
                store.set(f"{self._sends_key()}/{self.rank}/{dst}", f"{sent};{flushed}")

    def _sends_key(self) -> str:
        return f"distgrad/pipeline-sends/{self.engine.running}"

    def _wait_agreeing(self, theirs: torch.Tensor, work) -> None:
        """Wait for a peer's numbers of the end-of-step check, reading the failure key every
        ``failure_timeout`` seconds; after the first slice, publish this rank's sends for a
        peer that waits for a bundle none is coming of."""

        def after_slice():
            self.engine.check_failure()
            if not self.published:
                self.published = True
                self._publish(self.engine.store, "*")  # every bundle has gone

        _wait_landing(theirs.numpy(), self.engine, after_slice)
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


_CHECK = 1 << 24  # the end-of-step check's tag, apart from every bundle's (messages._tag)
_MISMATCH = (
    "the pipeline body asked for different values on different ranks (every rank runs "
    "the body and serves the same requests: keep requests such as `.output` and `.grad` "
    "out of rank-dependent branches like `if rank == 0:`, and branch on the values "
    "instead; "
)


def _digest(tags) -> int:
    """The number of ``tags`` and a checksum of them, as one int64 every rank computes alike."""
    tags = sorted(tags)
    return (len(tags) << 32) | zlib.crc32(struct.pack(f"<{len(tags)}q", *tags))
