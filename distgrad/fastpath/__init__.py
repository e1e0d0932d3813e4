"""The fast path: a trace body that qualifies runs as a generator that the run's own hooks
resume, on the trace's stack, with no greenlet switch per value.

One entry point, in two steps: ``plan_for(frame)`` surveys the body of the ``with`` block
starting in ``frame`` and, if it qualifies, gives the rewritten generator's plan (else None);
``GeneratorDriver(trace, plan)`` is the trace's ``Requests`` for that body. The modules:

* ``survey.py``: whether a body qualifies (every request in the block itself, no call that
  could read values out of sight);
* ``rewrite.py``: the body's code rewritten so that each request yields;
* ``driver.py``: ``GeneratorDriver``, which runs the model and the backward and serves the
  generator's requests;
* ``session.py``: ``GeneratorSession``, the hooks' side: each value handed to the generator.
"""
from .driver import GeneratorDriver
from .rewrite import plan_for

__all__ = ["GeneratorDriver", "plan_for"]
