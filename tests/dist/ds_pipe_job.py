"""DeepSpeed's pipeline engine: the demo's 4-block MLP as a PipelineModule over the ranks (one
stage each), one train_batch per trace. Usage: ds_pipe_job.py --microbatches M --out DIR
[--cases {train_batch,rank_dependent}] [--zero {0,1}]; train_batch's group also runs case_flow
(distgrad.flow over two train_batch steps) and case_flow_refused_in_bf16.

Oracle (pp_job.oracle): the unsplit model on one process with the same edits; DeepSpeed
backpropagates each microbatch's loss / M, so the body's gradients equal the whole batch's, and
after train_batch's SGD step (lr 0.1) the weights equal one SGD step of the oracle.
"""
from __future__ import annotations

import argparse
import copy
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
from flow_job import expect_refusal, hooks_on  # noqa: E402
from pp_job import batch, oracle  # noqa: E402

LR = 0.1
FLOW_RTOL = 1e-5


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
    bundle of distgrad's, so the last stage waits for one that stage 0 never sends, while stage 0
    waits in train_batch for the last stage's gradients. The last stage asks where stage 0 is,
    learns it has sent that bundle without the value, and raises; stage 0 hears of it."""
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


def full_weights(model, net):
    """A one-process copy of the whole MLP as it is now: each layer's weights from the rank
    whose stage trains it (the other ranks' copies of it are the stale initial ones)."""
    engine = model._engine
    whole = copy.deepcopy(net)
    for i, layer in enumerate(whole.layers):
        owner = engine.placement.rank_of_stage[engine.stage_of_name[f"layers.{i}"]]
        for param in layer.parameters():
            dist.broadcast(param.data, src=owner)
    return whole


def flow_oracle(whole, x, y):
    """Plain autograd on the whole batch: per block, the norm of the gradient reaching its
    output and of its parameters' gradients; then one SGD step (train_batch's), in place.
    DeepSpeed backpropagates each microbatch's loss / M: the gradient reaching a block in a
    microbatch is the whole batch's mean loss's gradient at those rows, and their squares
    summed over the microbatches are the whole batch's."""
    grads = {}

    def watch(i):
        def on_output(mod, args, out):
            out.register_hook(lambda g: grads.__setitem__(i, g.double()))
        return on_output

    handles = [block.register_forward_hook(watch(i)) for i, block in enumerate(whole.layers)]
    nn.MSELoss()(whole(x), y).backward()
    for handle in handles:
        handle.remove()
    acts = torch.stack([grads[i].pow(2).sum().sqrt() for i in range(len(whole.layers))])
    params = torch.stack([sum(p.grad.double().pow(2).sum() for p in block.parameters()).sqrt()
                          for block in whole.layers])
    with torch.no_grad():
        for p in whole.parameters():
            p -= LR * p.grad
            p.grad = None
    return acts, params


def near(got, want, what):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=FLOW_RTOL,
                               atol=0, msg=lambda msg: f"{what}: {msg}")


def case_flow(model, net, engine, ctx):
    """distgrad.flow under train_batch, 2 steps (the first in a trace, the second a plain
    train_batch): per block, the global and per-rank norms against plain autograd on the whole
    batch, rtol 1e-5. The parameter gradients are taken at train_batch's optimizer step; each
    rank's row holds its own stage's blocks, 0 at the others'. A step() with no train_batch
    before it raises on every rank; nothing is left on the engine or the modules after."""
    m, world = ctx["m"], ctx["world"]
    whole = full_weights(model, net)
    before = hooks_on(net)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(2)]
    adapter = model._engine
    owner = torch.tensor([adapter.placement.rank_of_stage[adapter.stage_of_name[f"layers.{i}"]]
                          for i in range(len(net.layers))])
    with distgrad.flow.Recorder(model, layers="layers") as flow:
        for step, (x, y) in enumerate(batches):
            micro = list(zip(x.chunk(m), y.chunk(m)))
            if step == 0:
                with model.trace(micro) as tr:
                    with tr.loss.backward():
                        pass
            else:
                engine.train_batch(data_iter=iter(micro))
            record = flow.step()
            acts, params = flow_oracle(whole, x, y)
            near(record["activation_global"], acts, f"step {step}: global activation norms")
            near(record["param_global"], params, f"step {step}: global parameter norms")
            for r in range(world):
                near(record["activation"][r], torch.where(owner == r, acts, 0.0),
                     f"step {step}: rank {r}'s activation norms")
                near(record["param"][r], torch.where(owner == r, params, 0.0),
                     f"step {step}: rank {r}'s parameter norms")
        assert flow.run.layers == [f"layers.{i}" for i in range(len(net.layers))], flow.run.layers
        expect_error(flow.step, RuntimeError, "ran [0, 0] times", heard=False)
    assert "_INSTRUCTION_MAP" not in engine.__dict__, "the Recorder left its wrap on the engine"
    assert hooks_on(net) == before, "the Recorder left hooks behind"
    for name, param in net.named_parameters():  # the weights the oracle stepped alike
        if name.startswith(tuple(f"layers.{i}." for i in ctx["mine"])):
            close(param.detach(), dict(whole.named_parameters())[name].detach(),
                  f"{name} after the two steps")


def case_flow_refused_in_bf16(model, net, engine, ctx):
    """Under bf16 DeepSpeed's optimizer keeps the gradients in fp32 buffers of its own:
    Recorder refuses on every rank, also where the layers named are all on stage 0 (rank 1
    runs none of them and would otherwise go on to wait in step()'s collective), and leaves
    nothing behind. (A fresh MLP: DeepSpeed casts the modules it is given to bf16.)"""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    fresh = build_mlp(8)
    pipe = PipelineModule(layers=list(fresh.layers), num_stages=ctx["world"],
                          loss_fn=nn.MSELoss(), partition_method="uniform")
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // ctx["m"],
              "gradient_accumulation_steps": ctx["m"], "steps_per_print": 10 ** 6,
              "bf16": {"enabled": True}}
    bf16, *_ = deepspeed.initialize(model=pipe, config=config,
                                    optimizer=torch.optim.SGD(pipe.parameters(), lr=LR))
    wrapped = distgrad.wrap(bf16, full_model=fresh)
    for layers in ("layers", ["layers.0"]):
        expect_refusal(lambda: distgrad.flow.Recorder(wrapped, layers=layers), fresh, "bf16 True")
    assert "_INSTRUCTION_MAP" not in bf16.__dict__


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backward-mode", default="auto", help="distgrad.config.backward_mode")
    parser.add_argument("--cases", default="train_batch", choices=["train_batch", "rank_dependent"])
    parser.add_argument("--zero", type=int, default=0, help="zero_optimization stage (0 or 1)")
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
              "gradient_clipping": 0.0, "zero_optimization": {"stage": args.zero},
              "zero_allow_untested_optimizer": True}  # torch's SGD under ZeRO-1
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=LR),
                                      config=config)
    model = distgrad.wrap(engine, full_model=net)
    ctx = {"rank": rank, "world": world, "m": args.microbatches,
           "mine": list(range(pipe._local_start, pipe._local_stop))}
    cases = {"train_batch": (case_train_batch, case_flow, case_flow_refused_in_bf16),
             "rank_dependent": (case_rank_dependent,)}[args.cases]
    run_cases(cases, args.out, rank, model, net, engine, ctx)


if __name__ == "__main__":
    sys.exit(main())
