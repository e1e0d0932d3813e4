"""Lightning Fabric's loop traced by distgrad (``lightning_job.py`` runs these): the module
``fabric.setup`` returned is wrapped as it is, the block's backward is ``fabric.backward``
(``model.trace_step``), against the one-process oracle of ``lightning_job.py`` (rel 1e-5); a
plain backward block raises on every rank, and so does a plain ``.backward()`` in the body."""

from __future__ import annotations

import torch

import distgrad
from cases import expect_error
from distgrad.trace import engine_of
from lightning_job import LR, STEPS, build_net, check_run, rel_close, rows


def fabric_for(world: int):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()  # (the ranks' processes exist: this joins the process group)
    return fabric


def set_up(world: int):
    fabric = fabric_for(world)
    net = build_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    return fabric, net, model, opt, distgrad.wrap(model)


def case_fabric_loop(world, rank):
    fabric, net, model, opt, traced = set_up(world)
    engine = engine_of(traced)
    assert engine.name == "fabric" and engine.inner.name == ("ddp" if world > 1 else "local")
    h0s, g0s = [], []
    for step in range(STEPS):
        ids = rows(world, rank, step)
        opt.zero_grad()
        with traced.trace_step(
            lambda: model(input_ids=ids, labels=ids).loss, fabric.backward
        ) as tr:
            hidden = traced.transformer.h[0].output.save()  # paths of the user's module
            with tr.loss.backward():  # fabric.backward(loss)
                grad = hidden.grad.save()
                hidden.grad = grad * 2
        opt.step()
        h0s.append(hidden)
        g0s.append(grad)
    check_run(world, rank, net, h0s, g0s)


def case_fabric_block_raises(world, rank):
    fabric, net, model, opt, traced = set_up(world)
    ids = rows(world, rank, 0)

    def slip():
        with traced.trace(input_ids=ids, labels=ids):
            with traced.output.loss.backward():
                pass

    expect_error(slip, distgrad.TraceStateError, "fabric.backward")
    assert all(p.grad is None for p in net.parameters()), "the refused backward ran"


def case_fabric_plain_backward_raises(world, rank):
    fabric, net, model, opt, traced = set_up(world)
    ids = rows(world, rank, 0)

    def slip():
        with traced.trace(input_ids=ids, labels=ids):
            traced.output.loss.backward()

    expect_error(slip, distgrad.TraceStateError, "fabric.backward")


def case_fabric_steering_vector(world, rank):
    """A steering vector beside the model, trained with it through ``fabric.backward``: its
    gradient averaged over the ranks (beside.py) through Fabric's engine around DDP's, so that
    after the steps it equals one process's on the global batch, as the model does."""
    fabric, net, model, opt, traced = set_up(world)
    vector = torch.nn.Parameter(torch.zeros(net.config.n_embd))
    vector_opt = torch.optim.SGD([vector], lr=LR)
    for step in range(STEPS):
        ids = rows(world, rank, step)
        opt.zero_grad()
        vector_opt.zero_grad()
        with traced.trace_step(
            lambda: model(input_ids=ids, labels=ids).loss, fabric.backward
        ) as tr:
            block = traced.transformer.h[0]
            block.output = block.output + vector
            with tr.loss.backward():
                pass
        opt.step()
        vector_opt.step()
    # one process, plain autograd, the global batch: each rank's mean loss averaged, as DDP's
    # mean of the ranks' gradients is
    ref = build_net()
    ref_vector = torch.nn.Parameter(torch.zeros(ref.config.n_embd))
    ref_opt = torch.optim.SGD([*ref.parameters(), ref_vector], lr=LR)
    handle = ref.transformer.h[0].register_forward_hook(
        lambda m, a, out: out + ref_vector
    )
    for step in range(STEPS):
        ref_opt.zero_grad()
        losses = [
            ref(input_ids=rows(world, r, step), labels=rows(world, r, step)).loss
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        ref_opt.step()
    handle.remove()
    rel_close(vector.detach(), ref_vector.detach(), "the vector after the steps")
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        rel_close(p.detach(), q.detach(), name)


FABRIC_CASES = [case_fabric_loop, case_fabric_steering_vector]
FABRIC_FAILURES = [case_fabric_block_raises, case_fabric_plain_backward_raises]
