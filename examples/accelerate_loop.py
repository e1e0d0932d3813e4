"""An accelerate training loop with gradient accumulation whose backward is a distgrad trace.

``accelerator.backward(loss)`` becomes a trace with ``with loss.backward():``; the block runs
accelerate's backward itself. The block doubles the gradient reaching the first block's
output. At the end, the parameters are checked against the same loop in plain accelerate
with a raw tensor hook making that edit. Runs on one process or many (DDP over gloo):

    python examples/accelerate_loop.py
    torchrun --nproc_per_node 2 examples/accelerate_loop.py
    accelerate launch --config_file launch/accelerate_cpu.yaml examples/accelerate_loop.py
"""

import sys

import torch
from accelerate import Accelerator

import distgrad
from distgrad.demo.models import build_gpt2

TOLERANCE = 1e-5  # fp32 parameters after 3 SGD steps (DDP may sum in another order)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
# each rank trains on its own micro-batches: 6 of them, 3 optimizer steps
batches = [
    torch.randint(
        0, 384, (2, 8), generator=torch.Generator().manual_seed(100 * accelerator.process_index + i)
    )
    for i in range(6)
]


def prepared():
    net = build_gpt2().train()
    return accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))


net, optimizer = prepared()
model = distgrad.wrap(net, accelerator=accelerator)
for ids in batches:
    with accelerator.accumulate(model):  # DDP skips its all-reduce on all but every 2nd batch
        with model.trace(ids):
            hidden = model.transformer.h[0].output
            loss = model.output.logits.sum() * 1e-3
            with loss.backward():  # runs accelerator.backward(loss): the gradients of loss / 2
                grad = hidden.grad.save()  # on rank 0: every rank's rows
                hidden.grad = hidden.grad * 2
        accelerator.print(f"h[0] gradient {tuple(grad.shape)}, norm {grad.norm():.3e}")
        optimizer.step()  # accelerate steps on every 2nd batch only
        optimizer.zero_grad()

# The oracle: the same loop in plain accelerate, the edit made by a raw tensor hook.
ref_net, ref_optimizer = prepared()


def on_output(module, args, out):
    out.register_hook(lambda grad: grad * 2)  # returns None: the output stays as it is


accelerator.unwrap_model(ref_net).transformer.h[0].register_forward_hook(on_output)
for ids in batches:
    with accelerator.accumulate(ref_net):
        accelerator.backward(ref_net(ids).logits.sum() * 1e-3)
        ref_optimizer.step()
        ref_optimizer.zero_grad()

start = build_gpt2()
moved = max((p - q).abs().max().item() for p, q in zip(ref_net.parameters(), start.parameters()))
worst = max((p - q).abs().max().item() for p, q in zip(net.parameters(), ref_net.parameters()))
if moved < 1e-4 or worst > TOLERANCE:
    sys.exit(
        f"rank {accelerator.process_index}: mismatch: the steps moved the parameters by "
        f"{moved:.1e}; they differ from the raw-hook loop's by {worst:.1e} "
        f"(tolerance {TOLERANCE})"
    )
accelerator.print(
    f"ok: accelerate loop on {accelerator.num_processes} process(es): parameters "
    f"after 3 steps equal the raw-hook loop's (largest difference {worst:.1e})"
)
