"""Pipeline parallel: a ``torch.distributed.pipelining`` schedule (``engine.py``) or DeepSpeed's
pipeline engine (``deepspeed.py``), the body run once per microbatch on every rank.

* ``engine.py``: the engine (stages, placement, the schedule's hooks);
* ``run.py``: one trace, the step as the run and one body per microbatch;
* ``requests.py``: what a body asks for, and where each value comes from;
* ``direct.py``: the step on the trace's own stack (one thread);
* ``messages.py``: values between stages; ``checks.py``: bodies that differ between ranks.
"""
from .deepspeed import DeepSpeedPipeEngine
from .engine import PipelineEngine
from .run import PipelineRun

__all__ = ["PipelineEngine", "DeepSpeedPipeEngine", "PipelineRun"]
