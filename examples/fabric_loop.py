"""A Lightning Fabric loop whose backward is a trace: ``fabric.backward(loss)`` runs as the
backward of the block that reads and doubles the gradient reaching the first block's output.

The module ``fabric.setup`` returned is wrapped as it is: distgrad picks the engine of what
Fabric runs (DDP on several processes) and names paths in the user's own module. At the end,
the parameters are checked against plain PyTorch whose raw tensor hook makes the same edit.

    python examples/fabric_loop.py
"""

import logging
import sys

import torch
from lightning.fabric import Fabric

import distgrad
from distgrad.demo.models import build_gpt2

logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
TOLERANCE = 1e-5  # fp32: parameters after 3 SGD steps, gradients read


def build_net():
    net = build_gpt2()
    for module in net.modules():  # dropout off: the oracle below repeats the arithmetic
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return net


fabric = Fabric(accelerator="cpu", devices=1)  # or devices=2, strategy="ddp"
fabric.launch()
net = build_net()
module, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
model = distgrad.wrap(module)  # the Fabric module itself

data = torch.randint(0, 384, (6, 8), generator=torch.Generator().manual_seed(0))
grads = []
for ids in data.split(2):
    opt.zero_grad()
    with model.trace_step(lambda: module(input_ids=ids, labels=ids).loss, fabric.backward) as tr:
        hidden = model.transformer.h[0].output
        with tr.loss.backward():  # fabric.backward(loss)
            grad = hidden.grad.save()
            hidden.grad = grad * 2
    opt.step()
    grads.append(grad)
    print(f"h[0] gradient norm {grad.norm():.3e}")

# The oracle: plain PyTorch, the edit made by a raw tensor hook.


def plain_run(factor):
    """Train as the loop did, a raw hook multiplying h[0]'s gradient by factor."""
    net, seen = build_net(), []

    def on_gradient(grad):
        seen.append(grad)
        return grad * factor

    def on_output(module, args, out):
        out.register_hook(on_gradient)  # returns None: the output itself stays as it is

    net.transformer.h[0].register_forward_hook(on_output)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for ids in data.split(2):
        opt.zero_grad()
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return net, seen


def largest_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


oracle, seen = plain_run(2.0)
unedited, _ = plain_run(1.0)
edit_moved = largest_difference(oracle.parameters(), unedited.parameters())
off = max(
    largest_difference(net.parameters(), oracle.parameters()), largest_difference(grads, seen)
)
if len(grads) != len(seen) or edit_moved < 1e-4 or off > TOLERANCE:
    sys.exit(
        f"mismatch: {len(grads)} gradients for {len(seen)} steps; the edit moved the "
        f"parameters by {edit_moved:.1e}; against raw hooks the parameters and saved gradients "
        f"differ by {off:.1e} (tolerance {TOLERANCE})"
    )
print(
    f"ok: Fabric loop, {len(seen)} steps: saved gradients and parameters equal the raw-hook "
    f"run's (largest difference {off:.1e})"
)
