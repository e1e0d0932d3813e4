"""Abandoned collectives: those a rank stopped waiting for because a peer failed. Each is kept,
with its group, until the process exits.

Such a collective still blocks one of its group's worker threads until the peers' connections
close - which, for a peer that waits for this rank, happens only when that peer's process ends,
often while this one is ending too. Two things must then not happen:

- Freeing the group: a gloo group's destructor joins its workers, so freeing it (when the
  engine that holds it is collected, at the latest at exit) would hang the process.
- Freeing the collective on the worker thread: the worker that finally fails it drops its
  reference, and were that the last one it would free the collective's tensors there. Freeing
  a tensor that Python also holds takes the GIL, and once the interpreter has begun to shut
  down that ends the thread inside a destructor: the process aborts ("terminate called without
  an active exception").

So every collective still pending when a rank gives up is held here, and no thread frees it.
What stays: one group and its pending collectives' buffers per failure, in a job that has
failed."""

from __future__ import annotations

from ...torch_internals import never_free


def keep_until_exit(group, works) -> None:
    """Never free ``group``, nor those of ``works`` (collectives on it) not completed yet."""
    pending = [work for work in works if not work.is_completed()]
    if pending:
        never_free(group)
        for work in pending:
            never_free(work)
