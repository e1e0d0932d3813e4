"""A torch.compile'd model: traced steps run eager, the steps between them stay compiled.

``distgrad.wrap(torch.compile(net))`` wraps the compiled module as it is. While a trace is
open the model runs its eager code (hooks have no place in a compiled graph), so a traced
step gives plain autograd's numbers; steps outside traces run the compiled graph. Here a
compiled training step without a trace alternates with a traced one that halves the first
block's output and doubles its gradient. At the end, each traced step's gradient read and
parameter gradients are checked against the eager model with raw hooks making those edits.

    python examples/compiled.py
"""

import copy
import sys

import torch

import distgrad
from distgrad.demo.models import build_gpt2

TOLERANCE = 1e-5  # fp32: parameter gradients and the gradient read
ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(0))

net = build_gpt2()
eager = copy.deepcopy(net)  # the oracle, with the same weights, never compiled
compiled = torch.compile(net, backend="aot_eager")  # "inductor" needs a C++ compiler
model = distgrad.wrap(compiled)

traced = []
for step in range(2):
    compiled(ids, labels=ids).loss.backward()  # a compiled step, no trace
    net.zero_grad()
    with model.trace(ids, labels=ids):
        block = model.transformer.h[0]
        block.output = block.output * 0.5
        hidden = block.output
        with model.output.loss.backward():
            grad = hidden.grad.save()
            hidden.grad = hidden.grad * 2
    traced.append((grad, {name: p.grad for name, p in net.named_parameters()}))
    print(f"traced step {step}: h[0] gradient norm {grad.norm():.3e}")
    net.zero_grad()

# The oracle: one step of the eager copy, the edits made by raw hooks.
seen = []


def save_and_double(g):
    seen.append(g)
    return g * 2


def on_block_output(module, args, out):
    out = out * 0.5
    out.register_hook(save_and_double)
    return out  # replaces the block's output


eager.transformer.h[0].register_forward_hook(on_block_output)
eager(ids, labels=ids).loss.backward()
worst = 0.0
for grad, grads in traced:
    worst = max(worst, (grad - seen[0]).abs().max().item())
    for name, p in eager.named_parameters():
        worst = max(worst, (grads[name] - p.grad).abs().max().item())
if worst > TOLERANCE:
    sys.exit(
        f"mismatch: a traced step of the compiled model differs from the eager model's "
        f"raw-hook step by {worst:.1e} (tolerance {TOLERANCE})"
    )
print(
    f"ok: torch.compile (aot_eager): traced steps between compiled steps equal the eager "
    f"raw-hook step (largest difference {worst:.1e})"
)
