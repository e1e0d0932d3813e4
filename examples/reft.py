"""Train a low-rank intervention (ReFT's LoReFT) beside the model: a module of the user's own,
applied to the second block's output in the trace body, trained with the model.

LoReFT edits a hidden state h as h + R^T (W h + b - R h), with R a low-rank projection. The
module is not registered on the model; its parameters go in the optimizer with the model's.
Under FSDP2 (``fully_shard``) distgrad averages their gradients over the ranks after each
backward, as FSDP2 reduces the model's. At the end, the model's and the intervention's
parameters are checked against the same steps in plain PyTorch on one process, over the
global batch, with a raw forward hook applying the intervention. Runs on one process or many
(FSDP2 over gloo):

    python examples/reft.py
    torchrun --nproc_per_node 2 examples/reft.py
"""

import os
import sys

import torch
import torch.distributed as dist

import distgrad
from distgrad.demo.models import build_gpt2

TOLERANCE = 1e-5  # fp32, relative: parameters after 3 SGD steps
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
g = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 384, (2 * world, 8), generator=g) for _ in range(3)]


class LoReFT(torch.nn.Module):
    """h + R^T (W h + b - R h): a rank-4 edit of a 64-wide hidden state."""

    def __init__(self, width: int = 64, rank: int = 4):
        super().__init__()
        torch.manual_seed(1)  # the same intervention on every rank
        self.rotate = torch.nn.Parameter(torch.linalg.qr(torch.randn(width, rank))[0].T)
        self.learned = torch.nn.Linear(width, rank)

    def forward(self, h):
        return h + (self.learned(h) - h @ self.rotate.T) @ self.rotate


def sharded(net):
    if world == 1:
        return net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in net.transformer.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(net, mesh=mesh)


net, reft = sharded(build_gpt2()), LoReFT()
model = distgrad.wrap(net)
# foreach=False: FSDP2's sharded (DTensor) parameters and plain ones in one optimizer
optimizer = torch.optim.SGD([*net.parameters(), *reft.parameters()], lr=0.1, foreach=False)
for ids in batches:
    rows = ids[2 * rank : 2 * rank + 2]
    with model.trace(rows, labels=rows):
        model.transformer.h[1].output = reft(model.transformer.h[1].output)
        with model.output.loss.backward():
            pass
    optimizer.step()  # reft's gradients: averaged over the ranks, as the model's
    optimizer.zero_grad()

# The oracle: the same steps in plain PyTorch on one process, over the global batch.
ref, ref_reft = build_gpt2(), LoReFT()
ref.transformer.h[1].register_forward_hook(lambda module, args, out: ref_reft(out))
ref_optimizer = torch.optim.SGD([*ref.parameters(), *ref_reft.parameters()], lr=0.1)
for ids in batches:
    # each rank's loss is the mean over its rows; DDP and FSDP average those: the mean of
    # the per-rank means is the oracle's loss
    losses = [ref(ids[2 * r : 2 * r + 2], labels=ids[2 * r : 2 * r + 2]).loss for r in range(world)]
    (sum(losses) / world).backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()


def whole(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


worst = max(rel(whole(p).detach(), q.detach()) for p, q in zip(net.parameters(), ref.parameters()))
start = LoReFT()
moved = max(rel(p.detach(), q.detach()) for p, q in zip(ref_reft.parameters(), start.parameters()))
worst_reft = max(
    rel(p.detach(), q.detach()) for p, q in zip(reft.parameters(), ref_reft.parameters())
)
if worst > TOLERANCE or worst_reft > TOLERANCE or moved == 0:
    sys.exit(
        f"rank {rank}: mismatch: the intervention differs from plain PyTorch's by "
        f"{worst_reft:.1e} (relative), the model's parameters by up to {worst:.1e} "
        f"(tolerance {TOLERANCE})"
    )
if rank == 0:
    print(
        f"ok: LoReFT on {world} process(es): the intervention and the model after 3 steps equal "
        f"plain PyTorch's on the global batch (relative differences {worst_reft:.1e}, "
        f"{worst:.1e})"
    )
if world > 1:
    dist.destroy_process_group()
