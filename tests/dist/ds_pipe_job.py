"""DeepSpeed's pipeline engine: the demo's 4-block MLP as a PipelineModule over the ranks (one
stage each), one train_batch per trace. Usage: ds_pipe_job.py --microbatches M --out DIR
[--cases {train_batch,rank_dependent}]; train_batch's group also runs case_flow_refused.

Oracle (pp_job.oracle): the unsplit model on one process with the same edits; DeepSpeed
backpropagates each microbatch's loss / M, so the body's gradients equal the whole batch's, and
after train_batch's SGD step (lr 0.1) the weights equal one SGD step of the oracle.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import distgrad  # noqa: E402
import distgrad.flow  # noqa: E402
from cases import close, expect_error, run_cases  # noqa: E402
from distgrad.demo.models import build_mlp  # noqa: E402
from flow_job import expect_refusal  # noqa: E402
from pp_job import batch, oracle  # noqa: E402

LR = 0.1


def case_train_batch(model, net, engine, ctx):
    m = ctx["m"]
    x, y = batch()
    micro = list(zip(x.chunk(m), y.chunk(m)))
    with model.trace(micro) as tr:
        h0 = model.layers[0].output.save()
        h1 = model.layers[1].output.save()
        model.layers[2].output = model.layers[2].output + h0.detach()
        h3 = model.layers[3].output.save()
        loss = tr.loss.save()
        with tr.loss.backward():
            g3 = h3.grad.save()
            g1 = h1.grad.save()
            h1.grad = h1.grad * 2
    ref = oracle(x, y, m)
    close(h1, ref["h1"], "layers[1] output")
    close(h3, ref["h3"], "layers[3] output after the cross-stage edit")
    close(loss, ref["losses"], "per-microbatch losses")
    close(g3, ref["g3"], "layers[3] gradient (the whole batch's mean loss)")
    close(g1, ref["g1"], "layers[1] gradient")
    start = build_mlp(8)
    for (name, param), (_, before) in zip(net.named_parameters(), start.named_parameters()):
        if name.startswith(tuple(f"layers.{i}." for i in ctx["mine"])):
            close(param.detach(), before.detach() - LR * ref["params"][name],
                  f"{name} after train_batch's SGD step")


def case_rank_dependent(model, net, engine, ctx):
    """Only the last stage asks for stage 0's layers[1] output. DeepSpeed's messages carry no
    batch of distgrad's, so the last stage waits for one that stage 0 never sends, while stage 0
    waits in train_batch for the last stage's gradients. The last stage asks where stage 0 is,
    learns it has sent that batch without the value, and raises; stage 0 hears of it."""
    m = ctx["m"]
    x, y = batch()
    micro = list(zip(x.chunk(m), y.chunk(m)))

    def run():
        with model.trace(micro) as tr:
            if ctx["rank"] == ctx["world"] - 1:
                model.layers[1].output
            with tr.loss.backward():
                pass

    expect_error(run, distgrad.TraceStateError, "did not send")


def case_flow_refused(model, net, engine, ctx):
    """distgrad.flow under train_batch: Recorder refuses on every rank, also where the layers
    named are all on stage 0 (rank 1 runs none of them and would otherwise go on to wait in
    step()'s collective), and leaves no hook on any module."""
    for layers in ("layers", ["layers.0"]):
        expect_refusal(lambda: distgrad.flow.Recorder(model, layers=layers), net,
                       "torch.distributed.pipelining")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backward-mode", default="auto", help="distgrad.config.backward_mode")
    parser.add_argument("--cases", default="train_batch", choices=["train_batch", "rank_dependent"])
    args = parser.parse_args()
    distgrad.config.backward_mode = args.backward_mode
    import deepspeed
    from deepspeed.pipe import PipelineModule
    distgrad.config.failure_timeout = 3.0
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = build_mlp(8)
    pipe = PipelineModule(layers=list(net.layers), num_stages=world, loss_fn=nn.MSELoss(),
                          partition_method="uniform")
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // args.microbatches,
              "gradient_accumulation_steps": args.microbatches, "steps_per_print": 10 ** 6,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=LR),
                                      config=config)
    model = distgrad.wrap(engine, full_model=net)
    ctx = {"rank": rank, "world": world, "m": args.microbatches,
           "mine": list(range(pipe._local_start, pipe._local_stop))}
    cases = {"train_batch": (case_train_batch, case_flow_refused),
             "rank_dependent": (case_rank_dependent,)}[args.cases]
    run_cases(cases, args.out, rank, model, net, engine, ctx)


if __name__ == "__main__":
    sys.exit(main())
