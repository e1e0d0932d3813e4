"""What every multi-process engine shares.

* ``engine.py``: ``DistributedEngine``, the base of every multi-process engine: ranks, and a
  failure on one rank reaching all of them (the failure watch);
* ``gather.py``: the end-of-trace gather of saved values to rank 0 (or to every rank), and
  ``layout.py``: how the saves are laid out in its buffers and cut back into global values;
* ``agreement.py``: ranks agreeing they are at the same request before a collective distgrad
  makes for the body, so that rank-dependent bodies raise instead of hanging.
"""
from .agreement import Agreement
from .engine import DistributedEngine
from .gather import SavesGather

__all__ = ["DistributedEngine", "SavesGather", "Agreement"]
