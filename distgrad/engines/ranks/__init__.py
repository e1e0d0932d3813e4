"""What every multi-process engine shares.

* ``engine.py``: ``DistributedEngine``, the base of every multi-process engine: ranks, and a
  failure on one rank reaching all of them (its failure watcher thread);
* ``gather.py``: ``SavesGather``, the end-of-trace gather of saved values to rank 0 (or to
  every rank), and ``layout.py``: how the saves lie in its send buffers (``SendLayout``) and
  how the received bytes join into global values (``JoinPlan``), and ``ragged.py``: the
  NaN-padded global value of a save whose ranks' shapes differ outside the join dim, and
  ``rank_parts``, each rank's part of it;
* ``agreement.py``: ranks agreeing they are at the same request before a collective distgrad
  makes for the body, so that rank-dependent bodies raise instead of hanging;
* ``abandoned.py``: collectives a rank stopped waiting for (a peer failed), kept until the
  process exits, so that freeing them then cannot hang or abort it.
"""

from .agreement import Agreement
from .engine import DistributedEngine
from .gather import SavesGather

__all__ = ["DistributedEngine", "SavesGather", "Agreement"]
