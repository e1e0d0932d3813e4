"""An accelerate training loop with gradient accumulation, on every rank (accelerate's DDP over
gloo), whose ``accelerator.backward(loss)`` is replaced by a distgrad trace.

Started once per rank by tests/test_accelerate_loop.py. Each rank trains on its own batches
(2 micro-batches per optimizer step, 3 steps). The oracles are plain PyTorch: the same
accelerate loop with raw hooks doing the same gradient edit, and a plain copy of the model
(no DDP) for the rank-local gradients DDP must leave alone inside ``no_sync``.
Tolerance: fp32, atol 1e-5 (cases.ATOL) for parameters and gradients.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

import distgrad
from cases import close, run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2

logging.getLogger("transformers").setLevel(logging.ERROR)
torch.set_num_threads(1)
STEPS = 2          # gradient_accumulation_steps
MICRO_BATCHES = 6  # 3 optimizer steps
LR = 0.1
# a gradient DDP averaged and one it left rank-local differ by far more than this
DIFFERENT = 1e-4


def batches_of(rank: int) -> list:
    """This rank's micro-batches: different on every rank, so that an all-reduce shows."""
    return [torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(100 * rank + i))
            for i in range(MICRO_BATCHES)]


# the loop of examples/accelerate_loop.py, as a function the cases can run twice
def fine_tune(model, accelerator, optimizer, batches):
    """Train on ``batches``, doubling the gradient that flows into the first block's output."""
    seen = []
    for ids in batches:
        with accelerator.accumulate(model):  # DDP's no_sync on all but every k-th batch
            with model.trace(ids):
                hidden = model.transformer.h[0].output
                loss = model.output.logits.sum() * 1e-3
                with loss.backward():  # runs accelerator.backward(loss)
                    seen.append(hidden.grad.save())
                    hidden.grad = hidden.grad * 2
            optimizer.step()  # accelerate steps on every k-th batch only
            optimizer.zero_grad()
    return seen


def fine_tune_with_hooks(net, accelerator, optimizer, batches):
    """The oracle: ``fine_tune`` in plain accelerate, the edit made by raw hooks."""
    seen = []

    def edit(grad):
        seen.append(grad.detach().clone())
        return grad * 2

    def on_output(mod, args, out):
        out.register_hook(edit)

    handle = accelerator.unwrap_model(net).transformer.h[0].register_forward_hook(on_output)
    try:
        for ids in batches:
            with accelerator.accumulate(net):
                accelerator.backward(net(ids).logits.sum() * 1e-3)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        handle.remove()
    return seen


def prepared(accelerator):
    net = build_gpt2()
    return accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))


def every_rank(tensor) -> list:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def case_recipe_matches_raw_hooks(accelerator, rank):
    batches = batches_of(rank)
    net, opt = prepared(accelerator)
    accelerator.step = 0  # each loop starts an accumulation cycle
    seen = fine_tune(distgrad.wrap(net, accelerator=accelerator), accelerator, opt, batches)
    ref_net, ref_opt = prepared(accelerator)
    accelerator.step = 0
    ref_seen = fine_tune_with_hooks(ref_net, accelerator, ref_opt, batches)
    start = build_gpt2().state_dict()
    moved = max((p - start[n]).abs().max().item() for n, p in ref_net.module.named_parameters())
    assert moved > DIFFERENT, "the oracle's steps changed nothing: the comparison would prove nothing"
    for (name, p), ref in zip(net.module.named_parameters(), ref_net.module.parameters()):
        close(p.detach(), ref.detach(), f"parameter {name} after 3 steps")
    for i, (got, ref) in enumerate(zip(seen, ref_seen)):
        whole = torch.cat(every_rank(ref))  # rank 0 holds every rank's rows, the others their own
        close(got, whole if rank == 0 else ref, f"h[0]'s gradient at micro-batch {i}")


def check_accumulation(model, net, accelerator, rank, window):
    """Two micro-batches per step, through ``window(i)`` (the context for micro-batch i): DDP's
    .grad must be this rank's own gradient after the first (no all-reduce) and the average over
    ranks of the accumulated gradients after the second, as a plain copy of the model says."""
    plain = None
    for i, ids in enumerate(batches_of(rank)[:4]):
        if i % STEPS == 0:  # a plain copy of the weights the DDP model has now
            plain = build_gpt2()
            plain.load_state_dict(net.module.state_dict())
        with window(i):
            with model.trace(ids):
                loss = model.output.logits.sum() * 1e-3
                with loss.backward():
                    pass
        (plain(ids).logits.sum() * 1e-3 / STEPS).backward()  # accelerator.backward divides
        got = net.module.transformer.h[0].mlp.c_fc.weight.grad
        local = plain.transformer.h[0].mlp.c_fc.weight.grad
        ranks = every_rank(got)
        spread = max((r - ranks[0]).abs().max().item() for r in ranks)
        if i % STEPS == 0:
            close(got, local, f"rank-local .grad inside no_sync, micro-batch {i}")
            assert spread > DIFFERENT, f"micro-batch {i}: .grad is the same on every rank: all-reduced"
        else:
            close(got, sum(every_rank(local)) / len(ranks), f"averaged .grad, micro-batch {i}")
            assert spread == 0, f"micro-batch {i}: ranks differ by {spread} after the sync step"
            torch.optim.SGD(net.parameters(), lr=LR).step()
            net.zero_grad(set_to_none=True)


def case_accumulate_reaches_no_sync(accelerator, rank):
    net, _ = prepared(accelerator)
    model = distgrad.wrap(net, accelerator=accelerator)
    accelerator.step = 0
    check_accumulation(model, net, accelerator, rank, lambda i: accelerator.accumulate(model))


def case_model_no_sync_is_ddps(accelerator, rank):
    net, _ = prepared(accelerator)
    model = distgrad.wrap(net, accelerator=accelerator)
    assert model.no_sync.__self__ is net, "model.no_sync is not the DDP wrapper's"
    check_accumulation(model, net, accelerator, rank,
                       lambda i: model.no_sync() if i % STEPS == 0 else contextlib.nullcontext())


CASES = [case_recipe_matches_raw_hooks, case_accumulate_reaches_no_sync,
         case_model_no_sync_is_ddps]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 3.0
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    rank = dist.get_rank()
    run_cases(CASES, args.out, rank, accelerator, rank)


if __name__ == "__main__":
    sys.exit(main())
