"""Mixed precision on the CPU: float16 autocast with a loss scaler, and bfloat16 autocast.

``with loss.backward(scaler=scaler):`` runs the backward of ``scaler.scale(loss)`` and shows
each gradient divided by the scale; an edit is made on that unscaled gradient and scaled back.
Here the gradient reaching the first MLP's hidden layer is clipped (on the scaled gradient
the same clip would give other numbers); then ``scaler.step``. Under bfloat16 no scaler is
needed and the gradient is doubled. Each step is checked against plain PyTorch whose raw tensor hook
makes the same edit, unscaling and scaling back by hand in the float16 case.

    python examples/mixed_precision.py
"""

import sys

import torch

import distgrad
from distgrad.demo.models import build_gpt2

# the scales are powers of two, so unscaling is exact: fp32 tolerances
GRAD_TOLERANCE, PARAM_TOLERANCE = 1e-6, 1e-5
ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(0))

# float16 with a GradScaler: one training step
net, scaler = build_gpt2(), torch.amp.GradScaler("cpu")
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
model = distgrad.wrap(net)
with torch.autocast("cpu", dtype=torch.float16), model.trace(ids):
    fc = model.transformer.h[0].mlp.c_fc.output
    loss = model.output.logits.float().mean()  # .sum() would overflow float16
    with loss.backward(scaler=scaler):
        fp16_grad = fc.grad.save()  # unscaled, shown in float32
        fc.grad = fc.grad.clamp(-1e-4, 1e-4)  # clips the largest unscaled values only
scaler.step(optimizer)
scaler.update()

# bfloat16: no scaler; the gradients of this backward only
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.bfloat16), model.trace(ids):
    fc = model.transformer.h[0].mlp.c_fc.output
    with model.output.logits.float().mean().backward():
        bf16_grad = fc.grad.save()  # a bfloat16 gradient
        fc.grad = fc.grad * 2

# The oracle: the same steps in plain PyTorch, the edits made by raw tensor hooks.
plain, plain_scaler = build_gpt2(), torch.amp.GradScaler("cpu")
plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
seen = []


def unscale_clip_rescale(g):
    scale = plain_scaler.get_scale()
    seen.append(g.float() / scale)
    return ((g.float() / scale).clamp(-1e-4, 1e-4) * scale).to(g.dtype)


def save_and_double(g):
    seen.append(g)
    return g * 2


def on_first_mlp_gradient(on_gradient):
    def on_output(module, args, out):
        out.register_hook(on_gradient)  # returns None: the output stays as it is

    return plain.transformer.h[0].mlp.c_fc.register_forward_hook(on_output)


def check(got, expected, tolerance, what):
    difference = (got.float() - expected.float()).abs().max().item()
    if difference > tolerance:
        sys.exit(
            f"mismatch: {what} differs from plain PyTorch's by {difference:.1e} "
            f"(tolerance {tolerance})"
        )


handle = on_first_mlp_gradient(unscale_clip_rescale)
with torch.autocast("cpu", dtype=torch.float16):
    plain_loss = plain(ids).logits.float().mean()
plain_scaler.scale(plain_loss).backward()
plain_scaler.step(plain_optimizer)
plain_scaler.update()
handle.remove()
check(fp16_grad, seen[0], GRAD_TOLERANCE, "float16: the unscaled gradient read")
for p, q in zip(net.parameters(), plain.parameters()):
    check(p, q, PARAM_TOLERANCE, "float16: a parameter after scaler.step")

plain_optimizer.zero_grad()
on_first_mlp_gradient(save_and_double)
with torch.autocast("cpu", dtype=torch.bfloat16):
    plain(ids).logits.float().mean().backward()
check(bf16_grad, seen[1], GRAD_TOLERANCE, "bfloat16: the gradient read")
for p, q in zip(net.parameters(), plain.parameters()):
    check(p.grad, q.grad, PARAM_TOLERANCE, "bfloat16: a parameter gradient")
print(
    "ok: float16 with a GradScaler and bfloat16: the gradients read, the parameters after "
    "scaler.step and the bfloat16 parameter gradients equal plain PyTorch's"
)
