"""Pipeline parallel: a ``torch.distributed.pipelining`` schedule (``engine.py``) or DeepSpeed's
pipeline engine (``deepspeed_pipe.py``), the body run once per microbatch on every rank.

* ``adapter.py``: ``PipelineAdapter``, what a traced step asks of either engine, and what the
  two share (the placement set-up, the model's modules on this rank's stages);
* ``engine.py``, ``deepspeed_pipe.py``: the two engines;
* ``placement.py``: which rank runs which stage, and at which action a rank takes another
  stage's value;
* ``schedule_run.py``: one trace, the step as the run and one body per microbatch;
* ``body_requests.py``: what a body asks for, and where each value comes from;
* ``waits.py``: the action events passed, and the bodies waiting for one;
* ``direct.py``: the step on the trace's own stack (one thread); ``threaded.py``: in a worker
  thread (a CUDA backward);
* ``messages.py``: values between stages, in bundles; ``checks.py``: bodies that differ between
  ranks; ``value_stages.py``: the stage each value came from.
"""

from .adapter import PipelineAdapter
from .deepspeed_pipe import DeepSpeedPipeEngine
from .engine import PipelineEngine
from .schedule_run import ScheduleRun

__all__ = ["DeepSpeedPipeEngine", "PipelineAdapter", "PipelineEngine", "ScheduleRun"]
