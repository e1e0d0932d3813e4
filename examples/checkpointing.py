"""Gradient checkpointing: edits inside a block whose forward the backward runs again.

With ``use_reentrant=False`` a forward edit inside a checkpointed block is made again in the
recompute, and gradients of values read there can be read and edited. Here one training step
halves the first MLP's hidden activation and doubles the gradient reaching that MLP's output.
At the end, the gradient read and every parameter gradient are checked against the same step
without checkpointing, the edits made by raw forward and tensor hooks.

    python examples/checkpointing.py
"""

import sys
import warnings

import torch

import distgrad
from distgrad.demo.models import build_gpt2

TOLERANCE = 1e-5  # fp32: parameter gradients and the gradient read
ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(0))

# transformers 5 renames the method; the old name works in every version distgrad supports
warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*")
net = build_gpt2().train()  # Hugging Face checkpoints only in training mode
net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = distgrad.wrap(net)
torch.manual_seed(1)  # dropout: the same masks in the oracle's step
with model.trace(ids, labels=ids):
    mlp = model.transformer.h[0].mlp
    mlp.c_fc.output = mlp.c_fc.output * 0.5  # inside the checkpointed block: made again
    hidden = mlp.output
    with model.output.loss.backward():  # the model's own language-modelling loss
        grad = hidden.grad.save()
        hidden.grad = hidden.grad * 2
print(f"h[0].mlp gradient {tuple(grad.shape)}, norm {grad.norm():.3e}")

# The oracle: the same step without checkpointing, the edits made by raw hooks.
plain = build_gpt2().train()
seen = []


def on_gradient(g):
    seen.append(g)
    return g * 2


def on_mlp_output(module, args, out):
    out.register_hook(on_gradient)  # returns None: the output stays as it is


plain.transformer.h[0].mlp.c_fc.register_forward_hook(lambda module, args, out: out * 0.5)
plain.transformer.h[0].mlp.register_forward_hook(on_mlp_output)
torch.manual_seed(1)
plain(ids, labels=ids).loss.backward()

grads = {name: p.grad for name, p in net.named_parameters()}
worst = (grad - seen[0]).abs().max().item()
for name, p in plain.named_parameters():
    if grads[name] is None:
        sys.exit(f"mismatch: {name} has no gradient after the traced step")
    worst = max(worst, (grads[name] - p.grad).abs().max().item())
if len(seen) != 1 or worst > TOLERANCE:
    sys.exit(
        f"mismatch: the hook saw {len(seen)} gradients (expected 1); the traced step "
        f"differs from the raw-hook step by {worst:.1e} (tolerance {TOLERANCE})"
    )
print(
    f"ok: checkpointed step: the gradient read and {len(grads)} parameter gradients equal "
    f"the raw-hook step's (largest difference {worst:.1e})"
)
