"""The three steps the pipeline benchmarks time (``pp_overhead.py`` on two ranks,
``pp_one_process.py`` on one): the same read and edit with raw hooks and with distgrad, and a
distgrad body that reads nothing."""
from __future__ import annotations

import os


def pipeline_steps(model, net, x, y, step, owns_layer1: bool) -> dict:
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

    return {"raw hooks": raw, "distgrad": traced, "distgrad, a body that reads nothing": traced_empty}


def one_process_steps(width: int, port: str) -> tuple:
    """``(net, {name: step function})`` for a 1F1B step on ONE process: one stage holding the
    whole 4-block model of ``distgrad/demo_pp.py``, 4 microbatches of 8 rows (the set-up of
    ``pp_one_process.py`` and ``pp_bytecodes.py``). Starts a one-rank gloo group on ``port``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import distgrad
    from distgrad.demo_pp import Blocks, Net
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
    return net, pipeline_steps(model, net, x, y, lambda: schedule.step(x, target=y),
                               owns_layer1=True)
