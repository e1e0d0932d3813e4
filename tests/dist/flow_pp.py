"""distgrad.flow under pipeline parallelism: a case of pp_job.py (every schedule it runs).

Each rank hooks its own stages' blocks; the one all_gather puts every block on every rank's
run, in the model's order. Oracle: the unsplit MLP on one process with raw hooks on each block's
output, the whole batch at once. torch's schedules backpropagate each microbatch's own loss
(the gradient reaching a block is m times the whole batch's, its squares summed over the m
microbatches) and divide parameter gradients by m (equal to the whole batch's). rtol 1e-5.
"""
from __future__ import annotations

import torch
from torch import nn

import distgrad.flow
from distgrad.demo.models import build_mlp

RTOL = 1e-5


def oracle(x, y, m: int, width: int, blocks: int):
    net = build_mlp(width, blocks)
    grads = {}

    def watch(i):
        def on_output(mod, args, out):
            out.register_hook(lambda g: grads.__setitem__(i, g.detach().double()))
        return on_output

    for i, block in enumerate(net.layers):
        block.register_forward_hook(watch(i))
    nn.MSELoss()(net(x), y).backward()
    acts = torch.stack([sum((g * m).pow(2).sum() for g in grads[i].chunk(m)).sqrt()
                        for i in range(len(net.layers))])
    params = torch.stack([torch.stack([p.grad.double().pow(2).sum() for p in block.parameters()])
                          .sum().sqrt() for block in net.layers])
    return acts, params


def near(got, want, what):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=RTOL, atol=0,
                               msg=lambda msg: f"{what}: {msg}")


def case_flow(model, net, ctx):
    """Every block recorded on the rank whose stage runs it, every block on every rank's run;
    a rank's row is zero at the blocks of other stages."""
    m, world = ctx["m"], ctx["world"]
    x, y = ctx["batch"]()
    with distgrad.flow.Recorder(model, layers="layers") as flow:
        with model.trace(x, target=y) as tr:
            with tr.loss.backward():
                pass
        record = flow.step()
    net.zero_grad(set_to_none=True)
    acts, params = oracle(x, y, m, ctx["width"], ctx["blocks"])
    assert flow.run.layers == [f"layers.{i}" for i in range(len(net.layers))], flow.run.layers
    near(record["activation_global"], acts, "global activation norms")
    near(record["param_global"], params, "global parameter norms")
    owner = [model._engine.placement.rank_of_stage[model._engine.stage_of_name[path]]
             for path in flow.run.layers]
    for r in range(world):
        near(record["activation"][r], torch.where(torch.tensor(owner) == r, acts, 0.0),
             f"rank {r}'s activation norms (its stages' blocks only)")
    assert flow.run.odd_ranks() == {}, flow.run.odd_ranks()
