"""Invokes under an engine: a case of job.py, on every data-parallel engine.

Each rank splits its rows of the global batch into two invokes of one row each: the first
reads h[0]'s gradient and doubles it, the second reads it; one backward runs over the sum of
the invokes' losses. Saved values reach rank 0 as every rank's rows of that invoke, in rank
order. Oracle: gpt2_oracle.oracle on the global batch, the doubling on the first invoke's rows
only; parameter gradients divided by the world size (the engines average). atol 1e-5.
"""
from __future__ import annotations

import torch

from cases import close  # noqa: E402  (tests/dist is the script's folder)
from flow_job import clear_grads  # noqa: E402
from gpt2_oracle import PARAMS, SCALE, global_ids, oracle, param_envoy  # noqa: E402


def case_invokes(model, wrapped, rank, world):
    ids = global_ids(2 * world)
    local = ids[2 * rank: 2 * rank + 2]
    edit = torch.ones(2 * world, 1, 1)
    edit[0::2] = 2.0  # the first invoke's row on every rank
    ref = oracle(ids, edit=edit)
    with model.trace() as tr:
        with tr.invoke(local[:1]):
            a = model.transformer.h[0].output
            with (model.output.logits.sum() * SCALE).backward():
                ga = a.grad.save()
                a.grad = a.grad * 2
        with tr.invoke(local[1:]):
            b = model.transformer.h[0].output
            h1 = model.transformer.h[1].output.save()
            with (model.output.logits.sum() * SCALE).backward():
                gb = b.grad.save()
    if rank == 0:
        close(ga, ref["g0"][0::2], "first invoke's h[0] gradient, every rank's row")
        close(gb, ref["g0"][1::2], "second invoke's h[0] gradient, every rank's row")
        close(h1, ref["h1"][1::2], "second invoke's h[1] output, every rank's row")
    else:
        close(ga, ref["g0"][2 * rank: 2 * rank + 1], "this rank's first invoke's gradient")
        close(gb, ref["g0"][2 * rank + 1: 2 * rank + 2], "this rank's second invoke's gradient")
    for name in PARAMS:  # a collective on sharded engines: every rank reads
        close(param_envoy(model, name).grad, ref["params"][name] / world,
              f"reduced grad of {name} after the invokes' backward")
    clear_grads(wrapped)
