"""Several backward blocks over one forward under DDP (and accelerate's DDP): cases of job.py.

DDP's reducer reduces the first backward after a forward only; a second one would leave this
rank's own gradients in the averaged ones with no error from PyTorch. Inside ``no_sync()`` no
backward reduces, so two blocks are served and each rank keeps its own sums.

Oracle: the GPT-2 on one process, the global batch, plain autograd with tensor hooks doing the
blocks' reads and edits, the same two backwards (the first with retain_graph). Tolerance atol
1e-5 (cases.ATOL), the parameter gradients after an all-reduce of the ranks' sums.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cases import close, expect_error  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from flow_job import clear_grads  # noqa: E402

SCALE = 1e-3


def ids_for(world: int):
    return torch.randint(0, 384, (2 * world, 8), generator=torch.Generator().manual_seed(77))


def losses(logits):
    return logits.sum() * SCALE, logits.pow(2).sum() * SCALE


def oracle(ids, second: bool = True):
    """Block 1 reads h[1]'s gradient and doubles it; block 2 reads h[0]'s and triples it."""
    net = build_gpt2()
    seen, phase = {}, [1]

    def on_h1(g):
        if phase[0] == 1:
            seen["g1"] = g.detach().clone()
            return g * 2

    def on_h0(g):
        if phase[0] == 2:
            seen["g0"] = g.detach().clone()
            return g * 3

    def hook(on_grad):
        def on_output(mod, args, out):
            out.register_hook(on_grad)  # (returns None: the output stays)
        return on_output

    net.transformer.h[1].register_forward_hook(hook(on_h1))
    net.transformer.h[0].register_forward_hook(hook(on_h0))
    loss1, loss2 = losses(net(ids).logits)
    loss1.backward(retain_graph=True)
    if second:
        phase[0] = 2
        loss2.backward()
    seen["params"] = {n: p.grad.clone() for n, p in net.named_parameters()}
    return seen


def two_blocks(model, local):
    with model.trace(local):
        h0 = model.transformer.h[0].output
        h1 = model.transformer.h[1].output
        loss1, loss2 = losses(model.output.logits)
        with loss1.backward(retain_graph=True):
            g1 = h1.grad.save()
            h1.grad = h1.grad * 2
        with loss2.backward():
            g0 = h0.grad.save()
            h0.grad = h0.grad * 3
    return g1, g0


def case_two_backward_blocks_in_no_sync(model, wrapped, rank, world):
    """Both blocks read and edit; the gathered gradients and the ranks' summed parameter
    gradients are plain autograd's on the global batch."""
    ids = ids_for(world)
    local = ids[2 * rank:2 * rank + 2]
    with wrapped.no_sync():
        g1, g0 = two_blocks(model, local)
    ref = oracle(ids)
    rows = slice(None) if rank == 0 else slice(2 * rank, 2 * rank + 2)  # rank 0: gathered
    close(g1, ref["g1"][rows], "h[1] gradient in the first block")
    close(g0, ref["g0"][rows], "h[0] gradient in the second block (after the first's edit)")
    for name, param in wrapped.module.named_parameters():
        summed = param.grad.clone()
        dist.all_reduce(summed)  # no_sync left each rank its own sum
        close(summed, ref["params"][name], f"{name}.grad summed over the ranks")
    clear_grads(wrapped)


def case_two_backward_blocks_refused(model, wrapped, rank, world):
    """Outside no_sync the second block raises on every rank before its backward runs: the
    gradients are the first block's, averaged by DDP."""
    ids = ids_for(world)
    expect_error(lambda: two_blocks(model, ids[2 * rank:2 * rank + 2]), NotImplementedError,
                 "no_sync()")
    ref = oracle(ids, second=False)
    for name, param in wrapped.module.named_parameters():
        close(param.grad, ref["params"][name] / world, f"{name}.grad after the first block")
    clear_grads(wrapped)


def case_plain_backward_then_block_refused(model, wrapped, rank, world):
    """A plain ``loss.backward()`` in the body is a backward too: the block after it raises on
    every rank before its backward runs."""
    ids = ids_for(world)

    def run():
        with model.trace(ids[2 * rank:2 * rank + 2]):
            h0 = model.transformer.h[0].output
            loss1, loss2 = losses(model.output.logits)
            loss1.backward(retain_graph=True)
            with loss2.backward():
                h0.grad.save()

    expect_error(run, NotImplementedError, "no_sync()")
    clear_grads(wrapped)


CASES = [case_two_backward_blocks_in_no_sync, case_two_backward_blocks_refused,
         case_plain_backward_then_block_refused]
