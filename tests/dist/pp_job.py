"""One pipeline-parallel job: a 4-block MLP split over the ranks (one stage each) and run by a
torch.distributed.pipelining schedule; every case in one process group.
Usage: pp_job.py --schedule {gpipe,1f1b,interleaved,looped} --microbatches M --out DIR (ranks from
the environment); interleaved and looped run two stages per rank (one block each, on 2 ranks).

Oracle: the same model unsplit on one process, plain hooks doing the same edits, the whole batch
at once (fp32, atol 1e-5). torch's schedules backpropagate each microbatch's mean loss and then
divide parameter gradients by M, so activation gradients seen in the body are M times the
whole-batch ones and parameter gradients are equal.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn

import distgrad
from cases import close, expect_error, run_cases  # noqa: E402  (tests/dist is the script's folder)

torch.set_num_threads(1)


from distgrad.demo.models import Blocks, build_mlp  # noqa: E402  the demo's 4-block MLP
from flow_pp import case_flow  # noqa: E402
from pp_edits import (case_edits_read_back, case_edits_read_back_thread,  # noqa: E402
                      case_inputs_refused)
from pp_failures import (case_failure, case_killed, case_rank_dependent,  # noqa: E402
                         case_rank_dependent_far, case_rank_dependent_grad, case_slow_owner)
from pp_hygiene import (case_body_without_source, case_nothing_left_behind,  # noqa: E402
                        case_refused, footprint)


WIDTH = 8  # --width; 2048 makes each microbatch's values larger than one message carries
BLOCKS = 4  # blocks of the MLP: 4, or one per stage for two stages per rank on more than 2 ranks


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def oracle(x, y, m):
    net = build_mlp(WIDTH, BLOCKS)
    seen = {}

    def keep(i, factor=1.0):
        def hook(mod, args, out):
            if i == 2:
                out = out + seen["h0"]  # the body adds stage 0's value to layer 2's output
            seen[f"h{i}"] = out.detach().clone()

            def on_grad(g):
                seen[f"g{i}"] = g.detach().clone()
                return g * factor
            out.register_hook(on_grad)
            return out
        return hook

    for i in range(4):
        net.layers[i].register_forward_hook(keep(i, 2.0 if i == 1 else 1.0))
    out = net(x)
    nn.MSELoss()(out, y).backward()
    seen["losses"] = torch.stack([nn.MSELoss()(o, t) for o, t in
                                  zip(out.detach().chunk(m), y.chunk(m))])
    seen["params"] = {n: p.grad.clone() for n, p in net.named_parameters()}
    return seen


def case_read_edit(model, net, ctx, on_trace_stack=True):
    """Reads on every stage, an edit that uses another stage's value, a gradient edit that
    flows back across stages, the per-microbatch losses; all on every rank. On one thread the
    step runs on the trace's own stack, its hooks waking the bodies (engines/pipeline/direct.py);
    ``on_trace_stack=False``: in the worker thread, the bodies run in turns on the trace's stack
    (engines/pipeline/threaded.py)."""
    import warnings

    import greenlet
    m = ctx["m"]
    x, y = batch()
    trace_glet, where = greenlet.getcurrent(), []

    def other_library(module, args, out):  # a hook of someone else's inside the step
        where.append(greenlet.getcurrent() is trace_glet)
        with warnings.catch_warnings():  # (a non-leaf's .grad warns)
            warnings.simplefilter("ignore")
            assert out.grad is None, "a hook in the step got distgrad's .grad, not PyTorch's"

    handle = ctx["stages"][0].submod.register_forward_hook(other_library)
    with model.trace(x, target=y) as tr:
        h0 = model.layers[0].output.save()
        h1 = model.layers[1].output.save()
        # applied by layer 2's stage, with stage 0's value as a constant (see case_cross_grad)
        model.layers[2].output = model.layers[2].output + h0.detach()
        h3 = model.layers[3].output.save()
        wide = (h3 * 1).save(dim=1)                              # microbatches joined on dim 1
        both = distgrad.save({"h3": h3, "h1": h1})              # a dict: joined per key
        loss = tr.loss.save()
        with tr.loss.backward():
            g3 = h3.grad.save()
            g1 = h1.grad.save()
            h1.grad = h1.grad * 2                               # applied by layer 1's stage
    handle.remove()
    # (m calls, and one more in a job's first step: the schedule infers its shapes)
    assert len(where) >= m and set(where) == {on_trace_stack}, \
        f"the stage's forward ran on the trace's stack: {where}"
    ref = oracle(x, y, m)
    close(h0, ref["h0"], "layers[0] output")
    close(h1, ref["h1"], "layers[1] output")
    close(h3, ref["h3"], "layers[3] output after the cross-stage edit")
    close(wide, torch.cat(ref["h3"].chunk(m), dim=1), "a save joined on dim 1")
    close(both["h1"], ref["h1"], "a saved dict's item")
    close(loss, ref["losses"], "per-microbatch losses")
    close(g3, ref["g3"] * m, "layers[3] gradient (each microbatch's own loss)")
    close(g1, ref["g1"] * m, "layers[1] gradient")
    for name, param in net.named_parameters():
        if param.grad is not None:  # this stage's parameters
            close(param.grad, ref["params"][name], f"gradient of {name}")
    net.zero_grad(set_to_none=True)


def case_read_edit_thread(model, net, ctx):
    """The same with the step in a worker thread (what CUDA needs: the schedule's backward calls
    tensor hooks on autograd's device threads)."""
    distgrad.config.backward_mode = "thread"
    try:
        case_read_edit(model, net, ctx, on_trace_stack=False)
    finally:
        distgrad.config.backward_mode = "auto"


def case_out_of_order(model, net, ctx):
    """A gradient of an earlier stage before one of a later stage raises on every rank, and
    leaves behind no hook, patched method or registered body."""
    x, y = batch()
    before = footprint(model, net, ctx)

    def run():
        with model.trace(x, target=y) as tr:
            h1 = model.layers[1].output
            h3 = model.layers[3].output
            with tr.loss.backward():
                h1.grad
                h3.grad

    expect_error(run, distgrad.OutOfOrderError, "stage")
    after = footprint(model, net, ctx)
    for key in ("hooks", "patched", "bodies"):
        assert after[key] == before[key], (key, before, after)


def case_late_read(model, net, ctx):
    """A forward value read after its stage has run it for the microbatch (layers[0] after
    layers[1]): its owner raises OutOfOrderError, and no rank waits for it forever."""
    x, y = batch()

    def run():
        with model.trace(x, target=y) as tr:
            model.layers[1].output
            model.layers[0].output
            with tr.loss.backward():
                pass

    expect_error(run, distgrad.OutOfOrderError, "forward order")


def case_after_loss(model, net, ctx):
    """A forward value read after tr.loss (here after the backward block) raises on every rank,
    although the block is empty and the value's stage could still serve it."""
    x, y = batch()

    def run():
        with model.trace(x, target=y) as tr:
            with tr.loss.backward():
                pass
            model.layers[0].output

    expect_error(run, distgrad.OutOfOrderError, "after tr.loss", heard=False)


def case_grad_order(model, net, ctx):
    """Two gradients of one stage in forward order: its owner passes the second before the body
    asks for it, so the bundle it sends lacks it; the rank waiting for it raises instead of
    hanging (its owner cannot end the step while it waits)."""
    x, y = batch()

    def run():
        with model.trace(x, target=y) as tr:
            h2 = model.layers[2].output
            h3 = model.layers[3].output
            with tr.loss.backward():
                h2.grad
                h3.grad

    expect_error(run, distgrad.OutOfOrderError, "did not send")


def case_cross_grad(model, net, ctx):
    """An edit on stage 1 built from stage 0's value (not detached): on one process its gradient
    would reach stage 0, which the pipeline does not carry back; stage 1 refuses at the end of
    its backward instead of leaving stage 0 with wrong gradients, and every rank raises."""
    x, y = batch()

    def run():
        with model.trace(x, target=y) as tr:
            h0 = model.layers[0].output
            model.layers[2].output = model.layers[2].output + h0
            with tr.loss.backward():
                pass

    expect_error(run, NotImplementedError, "layers[0].output.detach()")
    net.zero_grad(set_to_none=True)


def main():
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleLoopedBFS,
                                              SplitPoint, pipeline)
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", required=True,
                        choices=["gpipe", "1f1b", "interleaved", "looped"])
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="all",
                        choices=["all", "failure", "late_read", "after_loss", "grad_order",
                                 "cross_grad", "killed", "rank_dependent", "rank_dependent_grad",
                                 "rank_dependent_far", "slow_owner", "refused", "inputs_refused"])
    parser.add_argument("--split", default="manual", choices=["manual", "frontend"])
    parser.add_argument("--width", type=int, default=8)
    args = parser.parse_args()
    global WIDTH, BLOCKS
    WIDTH = args.width
    world = int(__import__("os").environ["WORLD_SIZE"])
    BLOCKS = max(4, 2 * world) if args.schedule in ("interleaved", "looped") else 4
    distgrad.config.failure_timeout = 3.0
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = build_mlp(WIDTH, BLOCKS)
    per = len(net.layers) // world
    looped = {"interleaved": ScheduleInterleaved1F1B, "looped": ScheduleLoopedBFS}
    if args.schedule in looped:  # two stages per rank, round robin: rank r runs r and r + world
        stages = [PipelineStage(Blocks(net.layers[s:s + 1]), s, 2 * world, torch.device("cpu"))
                  for s in (rank, rank + world)]
        stage = stages[0]
    elif args.split == "manual":  # each rank keeps its own blocks of the whole model
        stage = PipelineStage(Blocks(net.layers[rank * per:(rank + 1) * per]), rank, world,
                              torch.device("cpu"))
    else:  # the pipeline() frontend traces the model and splits it at the given layers
        x, _ = batch()
        pipe = pipeline(net, mb_args=(x.chunk(args.microbatches)[0],),
                        split_spec={f"layers.{per * r}": SplitPoint.BEGINNING for r in range(1, world)})
        stage = pipe.build_stage(rank, torch.device("cpu"))
    if args.schedule in looped:
        schedule = looped[args.schedule](stages, n_microbatches=args.microbatches,
                                         loss_fn=nn.MSELoss())
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
        schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=nn.MSELoss())
    model = distgrad.wrap(schedule, full_model=net)
    ctx = {"rank": rank, "world": world, "m": args.microbatches,
           "stages": stages if args.schedule in looped else [stage],
           "batch": batch, "read_edit": case_read_edit,  # (for pp_hygiene's and pp_failures')
           "width": WIDTH, "blocks": BLOCKS}
    # each ends the job's group when it raises, so an error case runs last
    cases = {"all": (case_read_edit, case_read_edit_thread, case_edits_read_back,
                     case_edits_read_back_thread, case_body_without_source,
                     case_nothing_left_behind, case_flow, case_out_of_order), "failure": (case_failure,),
             "late_read": (case_late_read,), "after_loss": (case_after_loss,), "grad_order": (case_grad_order,),
             "cross_grad": (case_cross_grad,), "killed": (case_killed,),
             "rank_dependent": (case_rank_dependent,),
             "rank_dependent_grad": (case_rank_dependent_grad,),
             "rank_dependent_far": (case_rank_dependent_far,),
             "slow_owner": (case_slow_owner,), "refused": (case_refused,),
             "inputs_refused": (case_inputs_refused,)}[args.cases]
    run_cases(cases, args.out, rank, model, net, ctx)


if __name__ == "__main__":
    sys.exit(main())
