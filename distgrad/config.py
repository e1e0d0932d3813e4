"""distgrad's settings, read when a trace or a backward block opens (``distgrad.config``)."""

from __future__ import annotations

import types

config = types.SimpleNamespace(
    backward_mode="auto",
    failure_timeout=10.0,
    gather_device=None,
    gather_chunk_bytes=None,
    peer_timeout=300.0,
)
"""``backward_mode``: ``"auto"`` (greenlet for a CPU backward, a worker thread when CUDA is in
use), ``"greenlet"`` or ``"thread"``. ``failure_timeout``: seconds a rank whose collective
broke waits for the failing rank's message before reporting that a peer was lost.
``gather_device``: where a multi-process engine puts the global values of saved tensors (rank
0's for ``gather="rank0"``, every rank's for ``gather="all"``): None (the saved tensor's
device) or a device, e.g. ``"cpu"`` to keep the global batch off rank 0's GPU.
``gather_chunk_bytes``: None, or the most bytes a rank sends in one collective of that gather:
larger saves are streamed in chunks, each copied into the global values before the next, so
that the receive buffer is world size x this bound (the ranks use the smallest they set).
``peer_timeout``: seconds a trace of a plain module in a multi-process job (``engines/in_job.py``)
waits for the other ranks to reach its gather before it raises, saying the trace ran on some
ranks only (the ranks may be that far apart between traces: a checkpoint written by one)."""
