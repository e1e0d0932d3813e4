"""The main job on one process: ``python -m distgrad.demo [--check]``.

Runs the README program on the tiny GPT-2 of ``models.build_gpt2``: capture the gradient reaching
``transformer.h[0]`` and double it. Prints the saved gradient's norm and every parameter gradient
the edit changed. ``--check`` also runs the same step with plain autograd and exits non-zero if
any number differs.
"""

from __future__ import annotations

import torch

import distgrad

from .models import build_gpt2, build_tokenizer

TEXT = "The Eiffel Tower is in"


def traced_step(net, tokenizer):
    model = distgrad.wrap(net, tokenizer=tokenizer)
    with model.trace(TEXT):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum()
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    return g, take_grads(net)


def autograd_step(net, tokenizer, factor: float):
    """The same step in plain PyTorch: a tensor hook on h[0]'s output."""
    seen = {}

    def on_output(module, args, out):
        def on_grad(grad):
            seen["grad"] = grad.clone()
            return grad * factor

        out.register_hook(on_grad)

    handle = net.transformer.h[0].register_forward_hook(on_output)
    try:
        out = net(**tokenizer([TEXT], return_tensors="pt"))
    finally:
        handle.remove()
    out.logits.sum().backward()
    return seen["grad"], take_grads(net)


def take_grads(net):
    """The parameter gradients, copied, and cleared on ``net`` for the next step."""
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    return grads


def run(check: bool) -> int:
    net, tokenizer = build_gpt2(), build_tokenizer()
    g, grads = traced_step(net, tokenizer)
    _, plain = autograd_step(net, tokenizer, 1.0)
    print(f"saved gradient at transformer.h[0]: shape {list(g.shape)}, norm {g.norm():.6f}")
    print(f"\n{'parameter':40} {'grad norm (edited)':>20} {'grad norm (plain)':>20}")
    changed = [n for n in grads if not torch.allclose(grads[n], plain[n], atol=1e-6)]
    for name in changed:
        print(f"{name:40} {grads[name].norm():20.6f} {plain[name].norm():20.6f}")
    print(
        f"\n{len(changed)} of {len(grads)} parameter gradients changed by the edit "
        "(upstream of h[0]); the rest are unchanged."
    )
    if not check:
        return 0
    ref_g, ref = autograd_step(net, tokenizer, 2.0)
    bad = [n for n in ref if not torch.allclose(grads[n], ref[n], atol=1e-5, rtol=0)]
    if not torch.allclose(g, ref_g, atol=1e-6, rtol=0):
        bad.insert(0, "saved gradient")
    print("check against plain autograd (atol 1e-5):", "OK" if not bad else f"MISMATCH {bad}")
    return 1 if bad else 0
