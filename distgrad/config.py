"""distgrad's settings, read when a trace or a backward block opens (``distgrad.config``)."""
from __future__ import annotations

import types

config = types.SimpleNamespace(backward_mode="auto", failure_timeout=10.0, body_mode="auto")
"""``body_mode``: ``"auto"`` (a trace body that qualifies runs as a generator resumed by the
run's hooks; see fastpath/rewrite.py) or ``"greenlet"`` (every body runs in place).
``backward_mode``: ``"auto"`` (greenlet for a CPU backward, a worker thread when CUDA is in
use), ``"greenlet"`` or ``"thread"``. ``failure_timeout``: seconds a rank whose collective
broke waits for the failing rank's message before reporting that a peer was lost."""
