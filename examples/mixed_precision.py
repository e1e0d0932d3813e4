"""Mixed precision on the CPU: float16 autocast with a loss scaler, and bfloat16 autocast.

``with loss.backward(scaler=scaler):`` runs the backward of ``scaler.scale(loss)`` and shows
each gradient divided by the scale; an edit is made on that unscaled gradient and scaled back.
Here the gradient reaching the first MLP's hidden layer is clipped (on the scaled gradient
the same clip would give other numbers); then ``scaler.step``. Under bfloat16 no scaler is needed
and the gradient is doubled. Each step is checked against plain PyTorch whose raw tensor hook
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
worst = 0.0


def check(got, expected, tolerance, what):
    global worst
    difference = (got.float() - expected.float()).abs().max().item()
    if difference > tolerance:
        sys.exit(f"mismatch: {what} differs from plain PyTorch's by {difference:.1e} "
                 f"(tolerance {tolerance})")
    worst = max(worst, difference)


def clip(grad):
    return grad.clamp(-1e-4, 1e-4)  # below the largest unscaled values, far below the scaled


def on_first_mlp_gradient(net, on_gradient):
    """A raw forward hook that puts ``on_gradient`` on the gradient of h[0].mlp.c_fc's output."""
    def on_output(module, args, out):
        out.register_hook(on_gradient)  # returns None: the output stays as it is

    return net.transformer.h[0].mlp.c_fc.register_forward_hook(on_output)


# float16 with a GradScaler
net, scaler = build_gpt2(), torch.amp.GradScaler("cpu")
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
model = distgrad.wrap(net)
with torch.autocast("cpu", dtype=torch.float16), model.trace(ids):
    fc = model.transformer.h[0].mlp.c_fc.output
    loss = model.output.logits.float().mean()  # .sum() would overflow float16
    with loss.backward(scaler=scaler):
        grad = fc.grad.save()  # unscaled, shown in float32
        fc.grad = clip(fc.grad)
scaler.step(optimizer)
scaler.update()

plain, plain_scaler = build_gpt2(), torch.amp.GradScaler("cpu")
plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
seen = []


def unscale_clip_rescale(g):
    scale = plain_scaler.get_scale()
    seen.append(g.float() / scale)
    return (clip(g.float() / scale) * scale).to(g.dtype)


handle = on_first_mlp_gradient(plain, unscale_clip_rescale)
with torch.autocast("cpu", dtype=torch.float16):
    plain_loss = plain(ids).logits.float().mean()
plain_scaler.scale(plain_loss).backward()
plain_scaler.step(plain_optimizer)
plain_scaler.update()
handle.remove()
check(grad, seen[0], GRAD_TOLERANCE, "float16: the unscaled gradient read")
for p, q in zip(net.parameters(), plain.parameters()):
    check(p, q, PARAM_TOLERANCE, "float16: a parameter after scaler.step")

# bfloat16: no scaler
optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.bfloat16), model.trace(ids):
    fc = model.transformer.h[0].mlp.c_fc.output
    with model.output.logits.float().mean().backward():
        grad = fc.grad.save()  # a bfloat16 gradient
        fc.grad = fc.grad * 2



def save_and_double(g):
    seen.append(g)
    return g * 2


seen.clear()
on_first_mlp_gradient(plain, save_and_double)
plain_optimizer.zero_grad()
with torch.autocast("cpu", dtype=torch.bfloat16):
    plain(ids).logits.float().mean().backward()
check(grad, seen[0], GRAD_TOLERANCE, "bfloat16: the gradient read")
for p, q in zip(net.parameters(), plain.parameters()):
    check(p.grad, q.grad, PARAM_TOLERANCE, "bfloat16: a parameter gradient")
print(f"ok: float16 with GradScaler and bfloat16: gradients read and parameters equal plain "
      f"PyTorch's with hand-unscaling hooks (largest difference {worst:.1e})")
