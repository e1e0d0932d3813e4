"""The main job under pipeline parallelism:
``torchrun --nproc_per_node 2 -m distgrad.demo --engine pp-1f1b`` (or ``pp-gpipe``;
``pp-interleaved``: ScheduleInterleaved1F1B over two one-block stages per rank, on 2 ranks; or
``deepspeed-pipe``: the same blocks as a DeepSpeed PipelineModule run by ``train_batch``).

A 4-block MLP regression model is split over the ranks, one stage each (a manual split: each rank
builds the whole model and keeps its blocks), and trained for a few SGD steps by a
``torch.distributed.pipelining`` schedule with 4 microbatches. Every step the body, written
against the whole model's paths and run once per microbatch on every rank, saves the gradient
reaching each block and halves the one reaching ``layers[1]``. Rank 0 prints a table of the
saved gradients' norms (whole batch). ``--check`` replays the steps on one process, unsplit,
and compares the saved gradients and the trained weights (fp32, atol 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import distgrad

from .models import Net, build_mlp, interleaved_stages, layers_of, stage_of
from .ranks import end_job

MICROBATCHES = 4


def batches(steps: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]


def deepspeed_pipeline(net: Net, world: int):
    """The same blocks as a DeepSpeed PipelineModule; its train_batch steps the optimizer."""
    import deepspeed  # optional
    from deepspeed.pipe import PipelineModule

    pipe = PipelineModule(
        layers=list(net.layers), num_stages=world, loss_fn=nn.MSELoss(), partition_method="uniform"
    )
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 8 // MICROBATCHES,
        "gradient_accumulation_steps": MICROBATCHES,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = deepspeed.initialize(
        model=pipe, config=config, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1)
    )
    return engine


def run(schedule_name: str, steps: int, check: bool) -> int:
    # here, not at the top: about 1 s to import, which the other demos need not pay (deepspeed
    # is optional: imported only for deepspeed-pipe)
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    deepspeed = schedule_name == "deepspeed-pipe"
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        net = build_mlp()
        if deepspeed:
            model = distgrad.wrap(deepspeed_pipeline(net, world), full_model=net)
        elif schedule_name == "pp-interleaved":
            schedule = ScheduleInterleaved1F1B(
                interleaved_stages(net, rank, world),
                n_microbatches=MICROBATCHES,
                loss_fn=nn.MSELoss(),
            )
            model = distgrad.wrap(schedule, full_model=net)
        else:
            kind = {"pp-gpipe": ScheduleGPipe, "pp-1f1b": Schedule1F1B}[schedule_name]
            schedule = kind(
                stage_of(net, rank, world), n_microbatches=MICROBATCHES, loss_fn=nn.MSELoss()
            )
            model = distgrad.wrap(schedule, full_model=net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        tables = []
        for x, y in batches(steps):
            inputs = (
                ((list(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))),), {})
                if deepspeed
                else ((x,), {"target": y})
            )
            with model.trace(*inputs[0], **inputs[1]) as tr:
                acts = [model.layers[i].output for i in range(len(net.layers))]
                with tr.loss.backward():
                    grads = []
                    for i in reversed(range(len(acts))):  # gradients come last stage first
                        grads.insert(0, acts[i].grad.save())
                        if i == 1:
                            acts[1].grad = acts[1].grad * 0.5
            if not deepspeed:  # (DeepSpeed's train_batch has stepped its own optimizer)
                opt.step()  # this stage's parameters have gradients; the others stay None
                opt.zero_grad(set_to_none=True)
            tables.append([g.norm().item() for g in grads])
        if rank == 0:
            scale = "the whole batch's mean loss" if deepspeed else "each microbatch's own loss"
            stages = len(net.layers) if schedule_name == "pp-interleaved" else world
            print(
                f"engine {schedule_name}, {stages} stages on {world} ranks, {MICROBATCHES} "
                f"microbatches, {steps} "
                f"steps; norms of the saved gradients ({scale}):"
            )
            print("step " + "".join(f"{f'layers[{i}]':>12}" for i in range(len(tables[0]))))
            for s, row in enumerate(tables):
                print(f"{s:4} " + "".join(f"{v:12.6f}" for v in row))
        if not check:
            return 0
        ref_tables, ref = reference(batches(steps), 1 if deepspeed else MICROBATCHES)
        mine = layers_of(net, rank, world, interleaved=schedule_name == "pp-interleaved")
        own = [p for i in mine for p in net.layers[i].parameters()]
        want = [p for i in mine for p in ref.layers[i].parameters()]
        ok = all(
            torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
            for a, b in zip(tables, ref_tables)
        )
        ok = ok and all(torch.allclose(p, q, atol=1e-5, rtol=0) for p, q in zip(own, want))
        verdict = torch.tensor([int(ok)])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # every stage checks its own weights
        if rank == 0:
            print(
                "check against one process, unsplit, plain autograd:",
                "OK" if verdict.item() else "MISMATCH",
            )
        return 0 if verdict.item() else 1
    finally:
        model = schedule = net = opt = None  # (see end_job)
        end_job()


def reference(data, scale: int):
    """One process, unsplit: the same steps with a tensor hook halving layers[1]'s gradient.
    torch's schedules backpropagate each microbatch's mean loss and divide parameter gradients
    by the number of microbatches: the same parameter gradients as the whole batch's mean loss,
    and activation gradients MICROBATCHES times the whole-batch ones (``scale``). DeepSpeed
    backpropagates loss / MICROBATCHES: scale 1."""
    net = build_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    tables = []
    for x, y in data:
        acts = []

        def keep(mod, args, out):
            acts.append(out)
            out.retain_grad()
            if mod is net.layers[1]:
                out.register_hook(lambda g: g * 0.5)

        hooks = [layer.register_forward_hook(keep) for layer in net.layers]
        nn.MSELoss()(net(x), y).backward()
        for h in hooks:
            h.remove()
        norms = [(a.grad * scale).norm().item() for a in acts]
        norms[1] = (acts[1].grad * 2 * scale).norm().item()  # seen before the halving
        tables.append(norms)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tables, net
