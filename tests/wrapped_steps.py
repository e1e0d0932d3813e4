"""The step every wrapped-model test runs, twice: with plain PyTorch hooks on an eager model
(the oracle) and through distgrad; and the tolerances it is compared with (conftest.py: atol
1e-6 for values, 1e-5 for parameter gradients). Shared by tests/test_peft.py and
tests/test_compiled.py."""

from __future__ import annotations

import torch
from conftest import ATOL, PARAM_ATOL, param_grads

IDS = torch.tensor([[84, 107, 104, 32, 69, 105, 102], [70, 101, 108, 32, 84, 111, 119]])


def plain_step(net, block, scale=0.5, grad_scale=2.0):
    """Plain autograd: ``block``'s output scaled by ``scale`` (a forward edit), its gradient
    read and then scaled by ``grad_scale``. Returns (edited output, gradient read, logits,
    parameter gradients)."""
    net.zero_grad(set_to_none=True)
    seen = {}

    def on_output(mod, args, out):
        out = out * scale
        seen["out"] = out

        def on_grad(grad):
            seen["grad"] = grad.detach().clone()
            return grad * grad_scale

        out.register_hook(on_grad)
        return out

    handle = block.register_forward_hook(on_output)
    try:
        logits = net(IDS).logits
    finally:
        handle.remove()
    logits.sum().backward()
    grads = param_grads(net)
    net.zero_grad(set_to_none=True)
    return seen["out"].detach(), seen["grad"], logits.detach(), grads


def traced_step(model, block, scale=0.5, grad_scale=2.0):
    """The same step as ``plain_step`` through distgrad, ``block`` an envoy."""
    with model.trace(IDS):
        block.output = block.output * scale
        h = block.output
        logits = model.output.logits
        with logits.sum().backward():
            g = h.grad.save()
            h.grad = h.grad * grad_scale
    return h.detach(), g, logits.detach()


def assert_close(got, expected, atol=ATOL):
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def assert_grads(got: dict, expected: dict, prefix: str = ""):
    assert got.keys() == {prefix + name for name in expected}
    for name, g in expected.items():
        torch.testing.assert_close(got[prefix + name], g, atol=PARAM_ATOL, rtol=0, msg=name)
