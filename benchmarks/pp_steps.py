"""The three steps the pipeline benchmarks time (``pp_overhead.py`` on two ranks,
``pp_one_process.py`` on one): the same read and edit with raw hooks and with distgrad, and a
distgrad body that reads nothing."""

from __future__ import annotations

import os


def pipeline_steps(model, net, x, y, step, owns_layer1: bool, send_to: dict | None = None) -> dict:
    """``{name: step function}``. ``step()`` runs the schedule's step as raw hooks need it;
    ``owns_layer1``: whether this rank runs ``net.layers[1]`` (raw hooks act only there). The
    step: save layers[1]'s output and its gradient, and double that gradient."""

    def raw():
        kept = []

        def on_grad(grad):
            kept.append(grad.clone())
            return grad * 2

        def on_output(module, inputs, out):
            kept.append(out.detach())
            out.register_hook(on_grad)

        handle = net.layers[1].register_forward_hook(on_output) if owns_layer1 else None
        step()
        if handle is not None:
            handle.remove()
        return kept

    def traced():
        with model.trace(x, target=y) as tr:
            h = model.layers[1].output.save()
            with tr.loss.backward():
                g1 = h.grad.save()
                h.grad = h.grad * 2
        return h, g1

    def traced_empty():
        with model.trace(x, target=y) as tr:
            with tr.loss.backward():
                pass

    steps = {"raw hooks": raw}
    if send_to is not None:
        steps["raw hooks, values sent by hand"] = _raw_sent(net, step, owns_layer1, send_to, x)
        steps["... and every rank tells the owner it has them"] = _raw_sent(
            net, step, owns_layer1, send_to, x, handshake=True
        )
    steps.update({"distgrad": traced, "distgrad, a body that reads nothing": traced_empty})
    return steps


def _raw_sent(net, step, owns_layer1: bool, send_to: dict, x, handshake: bool = False) -> callable:
    """The raw step that also ends with the values on every rank, as distgrad's body does: the
    owner's hooks send layers[1]'s output and gradient of each microbatch to every other rank
    as they appear (``isend`` on a group of their own); the other ranks post the receives before
    the step into buffers kept across steps and wait for them after it. ``send_to``:
    ``{"group": the group, "peers": the other ranks, "owner": layers[1]'s rank, "n": the
    microbatches}``. The schedule's first step infers its shapes by running the stage on real
    tensors, which fires the hooks too: run another step before this one (the benchmarks' first
    variant, ``raw``, does). ``handshake``: the owner's step also waits until every other rank
    has told it (one message each, after its receives) that it has the values: the round trip
    distgrad's end-of-step check makes (``engines/pipeline/checks.py``), so that an error reaches
    every rank in the same step."""
    import torch
    import torch.distributed as dist

    group, peers, owner, n = send_to["group"], send_to["peers"], send_to["owner"], send_to["n"]
    rows = x.shape[0] // n
    buffers = [torch.empty(rows, x.shape[1]) for _ in range(2 * n)]
    flags = {r: torch.zeros(1) for r in peers + [owner]}

    def raw_sent():
        kept, works = [], []
        if owns_layer1:

            def on_grad(grad):
                kept.append(grad.clone())
                works.extend(dist.isend(grad, p, group=group, tag=len(kept)) for p in peers)
                return grad * 2

            def on_output(module, inputs, out):
                value = out.detach()
                kept.append(value)
                works.extend(dist.isend(value, p, group=group, tag=len(kept)) for p in peers)
                out.register_hook(on_grad)

            handle = net.layers[1].register_forward_hook(on_output)
        else:
            works = [
                dist.irecv(buf, owner, group=group, tag=i + 1) for i, buf in enumerate(buffers)
            ]
        if handshake and owns_layer1:  # posted before the step, as distgrad's check is
            told = [dist.irecv(flags[p], p, group=group, tag=0) for p in peers]
        step()
        if owns_layer1:
            handle.remove()
        for work in works:
            work.wait()
        if handshake:
            if owns_layer1:
                for work in told:
                    work.wait()
            else:
                dist.send(flags[owner], owner, group=group, tag=0)
        return kept if owns_layer1 else [b.clone() for b in buffers]

    return raw_sent


def one_process_steps(width: int, port: str) -> tuple:
    """``(net, {name: step function})`` for a 1F1B step on ONE process: one stage holding the
    whole 4-block model of ``distgrad/demo/models.py``, 4 microbatches of 8 rows (the set-up of
    ``pp_one_process.py`` and ``pp_bytecodes.py``). Starts a one-rank gloo group on ``port``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import distgrad
    from distgrad.demo.models import Blocks, Net

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    net = Net(width=width)
    stage = PipelineStage(Blocks(net.layers), 0, 1, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.MSELoss())
    model = distgrad.wrap(schedule, full_model=net)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)
    return net, pipeline_steps(
        model, net, x, y, lambda: schedule.step(x, target=y), owns_layer1=True
    )
