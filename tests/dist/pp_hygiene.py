"""What a pipeline job refuses and what its traces leave behind: the cases of ``pp_job.py``
that check wrap's refusals, a body it cannot capture, and the process's footprint over many
traces. ``ctx`` carries the job's ``batch()`` and its parity case (``read_edit``)."""
from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

import distgrad
from cases import expect_error  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import Blocks, build_mlp
from cases import close  # noqa: E402


# what a trace patches on a stage or the schedule for its duration (PipelineEngine.instrument
# and piggyback): instance attributes over the class's methods
_PATCHED = {"forward_one_chunk", "backward_one_chunk", "get_fwd_send_ops", "get_fwd_recv_ops",
            "get_bwd_send_ops", "get_bwd_recv_ops", "_maybe_compute_loss"}


def footprint(model, net, ctx) -> dict:
    """What a pipeline trace could leave behind on this rank: hooks on the whole model's and
    the stages' modules, patched stage and schedule methods, registered bodies, threads, the
    engine's per-step records, idle runner greenlets."""
    from distgrad.interleave.transports import _idle
    from distgrad.interleave.session import BODIES
    engine = model._engine
    modules = {id(m): m for root in [net] + [st.submod for st in ctx["stages"]]
               for m in root.modules()}.values()
    owners = ctx["stages"] + [engine.schedule]
    return {"hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) +
                         len(m._backward_hooks) for m in modules),
            "patched": sorted(n for o in owners for n in vars(o) if n in _PATCHED),
            "bodies": len(BODIES), "threads": threading.active_count(),
            "answering": len(engine.answering), "receive buffers": len(engine.piggyback_buffers),
            "idle runners": len(getattr(_idle, "runners", ()))}


def _plain_step(ctx) -> dict:
    """case_nothing_left_behind's step with plain autograd on the unsplit model (built with the
    job's weights), the whole batch at once: layers[1]'s output, layers[3]'s gradient, and the
    parameter gradients after layers[1]'s gradient is doubled."""
    net = build_mlp(ctx["width"], ctx["blocks"])
    x, y = ctx["batch"]()
    seen = {}

    def on_layer1(module, args, out):
        seen["h1"] = out.detach().clone()
        out.register_hook(lambda g: g * 2)

    def on_layer3(module, args, out):
        out.register_hook(lambda g: seen.__setitem__("g3", g.detach().clone()))

    handles = [net.layers[1].register_forward_hook(on_layer1),
               net.layers[3].register_forward_hook(on_layer3)]
    nn.MSELoss()(net(x), y).backward()
    for handle in handles:
        handle.remove()
    seen["params"] = {n: p.grad.clone() for n, p in net.named_parameters()}
    return seen


def case_nothing_left_behind(model, net, ctx):
    """30 more traces leave the footprint of the first: nothing grows (hooks, patched methods,
    registered bodies, threads other than pooled idle helpers, the engine's records, pooled
    greenlets); and every one of them gives the numbers of plain autograd on the unsplit model
    (atol 1e-5; the body's gradient is its microbatch's, M times the whole batch's: pp_job)."""
    x, y = ctx["batch"]()
    ref = _plain_step(ctx)

    def step(i):
        with model.trace(x, target=y) as tr:
            h = model.layers[1].output.save()
            model.layers[2].output = model.layers[2].output * 1
            h3 = model.layers[3].output
            with tr.loss.backward():
                g = h3.grad.save()
                h.grad = h.grad * 2
        close(h, ref["h1"], f"trace {i}: layers[1] output")
        close(g, ref["g3"] * ctx["m"], f"trace {i}: layers[3] gradient")
        mine = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        assert mine, "this rank's stages got no parameter gradient"
        for name, grad in mine.items():
            close(grad, ref["params"][name], f"trace {i}: gradient of {name}")
        net.zero_grad(set_to_none=True)
    step(0)
    first = footprint(model, net, ctx)
    assert first["hooks"] == 0 and not first["patched"] and first["bodies"] == 0, first
    for i in range(1, 31):
        step(i)
    assert footprint(model, net, ctx) == first, (first, footprint(model, net, ctx))


def case_body_without_source(model, net, ctx):
    """A pipeline trace whose source cannot be read (code from a string) raises a RuntimeError
    saying so on every rank, before anything is sent, and leaves nothing open: the next trace
    runs and gives the numbers of one process, and leaves a trace function installed."""
    x, y = ctx["batch"]()
    code = ("with model.trace(x, target=y) as tr:\n"
            "    h = model.layers[1].output.save()\n")
    expect_error(lambda: exec(code, {"model": model, "x": x, "y": y}), RuntimeError,
                 "cannot read the source of <string>, so a pipeline trace's body", heard=False)
    # A body that can be captured is skipped in place by raising from a line trace, which makes
    # CPython switch the thread's tracing off: a debugger's or coverage's trace function installed
    # before the trace must be back after it.
    def debugger(frame, event, arg):
        return None
    before = sys.gettrace()
    sys.settrace(debugger)
    try:
        ctx["read_edit"](model, net, ctx)
        after = sys.gettrace()
    finally:
        sys.settrace(before)
    assert after is debugger, f"the trace function installed before the trace is now {after!r}"


def case_refused(model, net, ctx):
    """Schedules and placements distgrad does not run are refused at wrap, on every rank alike,
    even where only one rank's own stages show the problem (that rank refusing alone would
    leave the others waiting in wrap's all_gather): zero-bubble schedules (the backward split
    into input and weight parts), and, in a custom schedule, a V-shaped placement (two
    neighbouring stages on one rank), one that is not round robin, and a rank with fewer stages
    than the others; and a pipeline replicated for data parallelism."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleavedZeroBubble)
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti
    schedule = ScheduleInterleavedZeroBubble(ctx["stages"], n_microbatches=ctx["m"],
                                             loss_fn=nn.MSELoss())
    expect_error(lambda: distgrad.wrap(schedule, full_model=net), NotImplementedError,
                 "zero-bubble", heard=False)
    rank, world = ctx["rank"], ctx["world"]
    n = 2 * world
    placements = {  # what this rank runs in each refused placement -> a word of the message
        "V-shaped": (rank, n - 1 - rank),  # the rank in the middle holds two neighbours
        "round robin": ((rank + 1) % world, (rank + 1) % world + world),
        "same number of stages": (rank, rank + world) if rank else (rank,),
    }
    for says, mine in placements.items():
        stages = [PipelineStage(Blocks(net.layers[s:s + 1]), s, n, torch.device("cpu"))
                  for s in mine]
        # torch's own multi-stage schedules place stages round robin and check it; these
        # placements come from a custom schedule (its own action order) on torch's base class
        schedule = PipelineScheduleMulti(stages, n_microbatches=ctx["m"], loss_fn=nn.MSELoss())
        before = threading.active_count()
        expect_error(lambda: distgrad.wrap(schedule, full_model=net), NotImplementedError,
                     says, heard=False)
        assert threading.active_count() == before, "wrap left a thread behind"
    # a pipeline replicated for data parallelism: every rank runs the whole model as stage 0
    # of a one-stage pipeline of its own
    groups = [dist.new_group([r]) for r in range(world)]  # (every rank makes every group)
    whole = PipelineStage(Blocks(net.layers), 0, 1, torch.device("cpu"), group=groups[rank])
    schedule = Schedule1F1B(whole, n_microbatches=ctx["m"], loss_fn=nn.MSELoss())
    expect_error(lambda: distgrad.wrap(schedule, full_model=net), NotImplementedError,
                 "replicated for data parallelism", heard=False)
