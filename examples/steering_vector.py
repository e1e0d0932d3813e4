"""Train a steering vector beside the model: a tensor added to the first block's output in the
trace body, in the optimizer with the model's parameters.

The vector is the user's own ``nn.Parameter``, not registered on the model. Under DDP distgrad
averages its gradient over the ranks after each backward, as DDP averages the model's, so
every rank takes the same optimizer step. At the end, the model's and the vector's parameters
are checked against the same steps in plain PyTorch on one process, over the global batch,
with a raw forward hook adding the vector. Runs on one process or many (DDP over gloo):

    python examples/steering_vector.py
    torchrun --nproc_per_node 2 examples/steering_vector.py
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import distgrad
from distgrad.demo.models import build_gpt2

TOLERANCE = 1e-5  # fp32, relative: parameters after 3 SGD steps
TARGET = 42  # the token the vector steers towards
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
# the global batches: each rank trains on its own 2 rows of each
g = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 384, (2 * world, 8), generator=g) for _ in range(3)]


def vector():
    return torch.nn.Parameter(torch.zeros(64))  # GPT-2's width; beside the model


net, steer = build_gpt2(), vector()
model = distgrad.wrap(DistributedDataParallel(net) if world > 1 else net)
optimizer = torch.optim.SGD([*net.parameters(), steer], lr=0.1)
for ids in batches:
    with model.trace(ids[2 * rank : 2 * rank + 2]):
        model.transformer.h[0].output = model.transformer.h[0].output + steer
        loss = -model.output.logits[..., TARGET].mean()  # raise the target's logit
        with loss.backward():
            pass
    # here steer.grad is the mean over the ranks, as every parameter's of the model
    optimizer.step()
    optimizer.zero_grad()
if rank == 0:
    print(f"steering vector after 3 steps: norm {steer.norm():.3e}")

# The oracle: the same steps in plain PyTorch on one process, over the global batch.
ref, ref_steer = build_gpt2(), vector()
ref.transformer.h[0].register_forward_hook(lambda module, args, out: out + ref_steer)
ref_optimizer = torch.optim.SGD([*ref.parameters(), ref_steer], lr=0.1)
for ids in batches:
    (-ref(ids).logits[..., TARGET].mean()).backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


worst = max(rel(p.detach(), q.detach()) for p, q in zip(net.parameters(), ref.parameters()))
worst_vector = rel(steer.detach(), ref_steer.detach())
if worst > TOLERANCE or worst_vector > TOLERANCE or ref_steer.norm() == 0:
    sys.exit(
        f"rank {rank}: mismatch: the vector differs from plain PyTorch's by {worst_vector:.1e} "
        f"(relative), the model's parameters by up to {worst:.1e} (tolerance {TOLERANCE})"
    )
if rank == 0:
    print(
        f"ok: steering vector on {world} process(es): the vector and the model after 3 steps "
        f"equal plain PyTorch's on the global batch (relative differences {worst_vector:.1e}, "
        f"{worst:.1e})"
    )
if world > 1:
    dist.destroy_process_group()
