"""Interventions trained beside the model, on 2 ranks of every data-parallel engine: a steering
vector added to h[0]'s output and a low-rank ReFT-style module applied to h[1]'s output in the
trace body, both in the optimizer with the model's parameters, 3 SGD steps. Started once per
rank by tests/test_interventions.py; each case builds its own engine in the one process group.

The oracle is one process with plain PyTorch on the global batch (forward hooks make the same
edits; the loss is divided by the world size, since every engine averages over the ranks).
fp32; parameters compared by relative norm, 1e-5 (REL).
"""

from __future__ import annotations

import argparse
import os
import sys

import intervention_layouts as layouts  # (tests/dist is the script's folder)
import torch
import torch.distributed as dist
from cases import run_cases
from intervention_setup import LR, REL, SCALE, STEPS, batches, interventions, mine, rel

import distgrad
from distgrad.demo.models import build_gpt2
from distgrad.demo.ranks import LAUNCH_DIR, wrap_with_engine

torch.set_num_threads(1)


def oracle(world: int, steps: int = STEPS, accumulate: int = 1):
    """Plain PyTorch on one process, the global batch: the final model parameters (by name)
    and the interventions' parameters. With ``accumulate`` k, k batches per step, each loss
    divided by k (as accelerate divides it)."""
    net = build_gpt2()
    steer, low = interventions()
    net.transformer.h[0].register_forward_hook(lambda m, a, out: out + steer)
    net.transformer.h[1].register_forward_hook(lambda m, a, out: low(out))
    opt = torch.optim.SGD([*net.parameters(), steer, *low.parameters()], lr=LR)
    for i, ids in enumerate(batches(world, steps)):
        (net(ids).logits.sum() * SCALE / world / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return dict(net.named_parameters()), [steer, *low.parameters()]


def check(got_model: dict, got_beside: list, ref, what: str) -> None:
    ref_model, ref_beside = ref
    for name, p in ref_model.items():
        err = rel(got_model[name].detach(), p.detach())
        assert err <= REL, f"{what}: model parameter {name}: rel {err:.2e} > {REL}"
    for i, (p, q) in enumerate(zip(got_beside, ref_beside)):
        err = rel(p.detach(), q.detach())
        assert err <= REL, f"{what}: intervention parameter {i}: rel {err:.2e} > {REL}"
    # every rank holds the same interventions afterwards
    for i, p in enumerate(got_beside):
        table = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(table, p.detach().contiguous())
        assert all(torch.equal(t, table[0]) for t in table), f"{what}: parameter {i} differs"


def body(model, steer, low, how: str = "block"):
    """The user's trace body: the two edits, the loss, its backward."""
    model.transformer.h[0].output = model.transformer.h[0].output + steer
    model.transformer.h[1].output = low(model.transformer.h[1].output)
    loss = model.output.logits.sum() * SCALE
    if how == "block":
        with loss.backward():
            pass
    else:
        loss.backward()


def full_params(engine: str, wrapped) -> dict:
    """The model's parameters by name, whole (gathered where the engine shards them)."""
    if engine == "fsdp2":
        return {n: p.full_tensor() for n, p in wrapped.named_parameters()}
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(wrapped):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in wrapped.named_parameters()
            }
    if engine.startswith("zero"):
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p) for n, p in wrapped.module.named_parameters()}
    inner = wrapped.module if hasattr(wrapped, "module") else wrapped
    return dict(inner.named_parameters())


def train(engine: str, rank: int, world: int, how: str = "block"):
    """3 SGD steps of the traced loop under ``engine``; the parameters afterwards."""
    net = build_gpt2()
    steer, low = interventions()
    beside = [steer, *low.parameters()]
    if engine.startswith("zero"):  # DeepSpeed steps the model; the interventions its own SGD
        config = os.path.join(LAUNCH_DIR, f"{engine}.json")
        wrapped, _ = wrap_with_engine(engine, net, lr=LR, ds_config=config)
        opt = torch.optim.SGD(beside, lr=LR)
    else:
        wrapped, _ = wrap_with_engine(engine, net, lr=LR)
        # foreach=False: FSDP2's DTensor parameters beside plain ones in one optimizer
        opt = torch.optim.SGD([*wrapped.parameters(), *beside], lr=LR, foreach=False)
    model = distgrad.wrap(wrapped)
    for ids in batches(world):
        rows = mine(ids, rank)
        if how == "invokes":  # a body per row, their blocks' backward one over the batch
            with model.trace() as tr:
                for row in (rows[:1], rows[1:]):
                    with tr.invoke(row):
                        body(model, steer, low)
        else:
            with model.trace(rows):
                body(model, steer, low, how)
        if engine.startswith("zero"):
            wrapped.step()
        opt.step()
        opt.zero_grad()
    return full_params(engine, wrapped), beside


def engine_case(engine: str, how: str = "block"):
    def case(rank, world, ref):
        check(*train(engine, rank, world, how), ref, engine)

    case.__name__ = f"case_{engine}" + {"block": "", "plain": "_plain_backward"}.get(how, f"_{how}")
    return case


def case_accelerate_accumulation(rank, world, ref):
    """accelerate with gradient_accumulation_steps=2: DDP's no_sync on every other batch, the
    interventions kept rank-local there as the model's, averaged at the synchronising one."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = build_gpt2()
    steer, low = interventions()
    beside = [steer, *low.parameters()]
    opt = torch.optim.SGD([*net.parameters(), *beside], lr=LR)
    prepared, opt = accelerator.prepare(net, opt)
    model = distgrad.wrap(prepared, accelerator=accelerator)
    seen = []
    for ids in batches(world, 2 * STEPS):
        with accelerator.accumulate(model):
            with model.trace(mine(ids, rank)):
                body(model, steer, low)
            seen.append(steer.grad.detach().clone())
            opt.step()
            opt.zero_grad()
    # inside no_sync (the first batch of each step) each rank keeps its own gradient
    table = [torch.empty_like(seen[0]) for _ in range(world)]
    dist.all_gather(table, seen[0])
    assert not torch.allclose(table[0], table[1]), "no_sync: the vector's gradient was averaged"
    check(
        dict(prepared.module.named_parameters()),
        beside,
        oracle(world, 2 * STEPS, 2),
        "accelerate, gradient_accumulation_steps=2",
    )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def case_traced_trainer(rank, world, ref):
    """TracedTrainer (Trainer's own step and accelerator.backward, DDP, gradient accumulation
    2): a vector added in the intervention trains as a plain Trainer's does whose raw hook
    adds it and whose callback averages its gradient by hand before each optimizer step."""
    from trainer_job import arguments, samples
    from transformers import Trainer, TrainerCallback

    from distgrad.trainer import TracedTrainer

    class Average(TrainerCallback):
        def __init__(self, steer):
            self.steer = steer

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            dist.all_reduce(self.steer.grad)
            self.steer.grad /= world

    def add(model, tr):
        model.transformer.h[0].output = model.transformer.h[0].output + steer

    got, steer = build_gpt2(), interventions()[0]
    opt = torch.optim.SGD([*got.parameters(), steer], lr=LR)
    TracedTrainer(
        model=got,
        args=arguments(2),
        train_dataset=samples(world),
        optimizers=(opt, None),
        intervention=add,
    ).train()
    ref_net = build_gpt2()
    ref_steer = interventions()[0]
    ref_net.transformer.h[0].register_forward_hook(lambda m, a, out: out + ref_steer)
    opt = torch.optim.SGD([*ref_net.parameters(), ref_steer], lr=LR)
    trainer = Trainer(
        model=ref_net,
        args=arguments(2),
        train_dataset=samples(world),
        optimizers=(opt, None),
        callbacks=[Average(ref_steer)],
    )
    trainer.train()
    assert rel(ref_steer.detach(), interventions()[0].detach()) > 1e-3, "the vector did not move"
    check(
        dict(got.named_parameters()),
        [steer],
        (dict(ref_net.named_parameters()), [ref_steer]),
        "TracedTrainer",
    )


def case_keep_rank_local(rank, world, ref):
    """The opt-out: a vector marked keep_rank_local keeps each rank's own gradient (that of
    this rank's rows alone), while the unmarked module beside it is averaged."""
    from torch.nn.parallel import DistributedDataParallel

    net = build_gpt2()
    steer, low = interventions()
    distgrad.keep_rank_local(steer)
    model = distgrad.wrap(DistributedDataParallel(net))
    ids = batches(world, 1)[0]
    with model.trace(mine(ids, rank)):
        body(model, steer, low)
    # the oracle of this rank's rows alone (on one process, divided by the world size as the
    # averaged parameters are) and of the global batch for the averaged module
    ref_net, ref_steer, ref_low = build_gpt2(), *interventions()
    ref_net.transformer.h[0].register_forward_hook(lambda m, a, out: out + ref_steer)
    ref_net.transformer.h[1].register_forward_hook(lambda m, a, out: ref_low(out))
    (ref_net(mine(ids, rank)).logits.sum() * SCALE).backward()
    err = rel(steer.grad, ref_steer.grad)
    assert err <= REL, f"keep_rank_local: the vector's gradient is not this rank's own ({err:.2e})"
    ref_low.zero_grad()
    ref_net.zero_grad()
    (ref_net(ids).logits.sum() * SCALE / world).backward()
    err = rel(low.rotate.grad, ref_low.rotate.grad)
    assert err <= REL, f"keep_rank_local: the unmarked module was not averaged ({err:.2e})"


def case_plain_leaf_stays_rank_local(rank, world, ref):
    """A plain leaf tensor requiring grad (inputs_embeds the user made) is per-rank data: its
    gradient stays this rank's own, as the gradient of the batch's rows does."""
    from torch.nn.parallel import DistributedDataParallel

    net = build_gpt2()
    model = distgrad.wrap(DistributedDataParallel(net, find_unused_parameters=True))
    ids = mine(batches(world, 1)[0], rank)
    embeds = net.transformer.wte(ids).detach().requires_grad_()
    with model.trace(inputs_embeds=embeds):
        with (model.output.logits.sum() * SCALE).backward():
            pass
    ref_net = build_gpt2()
    ref_embeds = ref_net.transformer.wte(ids).detach().requires_grad_()
    (ref_net(inputs_embeds=ref_embeds).logits.sum() * SCALE).backward()
    err = rel(embeds.grad, ref_embeds.grad)
    assert err <= REL, f"inputs_embeds' gradient is not this rank's own ({err:.2e})"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 10.0
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = oracle(world)
    cases = [
        engine_case("ddp"),
        engine_case("ddp", "plain"),
        engine_case("ddp", "invokes"),
        engine_case("fsdp2"),
        engine_case("fsdp1"),
        engine_case("zero2"),
        engine_case("zero3"),
        case_accelerate_accumulation,
        case_traced_trainer,
        case_keep_rank_local,
        case_plain_leaf_stays_rank_local,
        layouts.case_pipeline_vector_on_the_stage,
        layouts.case_backward_after_the_trace_raises,
        layouts.case_tensor_parallel_raises,
        layouts.case_pipeline_raises,
    ]
    run_cases(cases, args.out, rank, rank, world, ref)


if __name__ == "__main__":
    sys.exit(main())
