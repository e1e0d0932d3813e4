"""Gradient flow across layers and ranks: which layer's gradients vanish or explode, and which
rank's gradients differ from the others'. See docs/flow.rst. ::

    import distgrad.flow
    flow = distgrad.flow.Recorder(model, layers="transformer.h")
    for batch in data:
        with model.trace(batch):
            with model.output.loss.backward():
                pass
        flow.step()                 # every rank: one all_gather of a small vector
        opt.step(); opt.zero_grad()
    flow.save("run.json")           # rank 0

``python -m distgrad.flow run.json -o flow.png`` draws a run, without ``-o`` prints a table.
"""

from __future__ import annotations

from .draw import draw
from .flow_run import FlowRun
from .recorder import Recorder


def load(path: str) -> FlowRun:
    """A run written by :meth:`Recorder.save`."""
    return FlowRun.load(path)


__all__ = ["Recorder", "FlowRun", "load", "draw"]
