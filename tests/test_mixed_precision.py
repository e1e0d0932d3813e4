"""Mixed precision: float16 autocast with a loss scaler, and bfloat16 autocast.

``with loss.backward(scaler=scaler):`` runs the backward on ``scaler.scale(loss)`` and shows
each gradient divided by the scale. Oracle: the same step in plain PyTorch, the loss scaled by
a second ``torch.amp.GradScaler("cpu")`` with the same settings and the edit done by a tensor
hook that unscales, edits and scales back by hand; then ``scaler.step(opt)`` on both. Runs on
the CPU: ``torch.autocast("cpu", dtype=torch.float16)`` and ``GradScaler("cpu")``. The scales
are powers of two, so dividing and multiplying by them is exact: gradients read agree to
``ATOL`` (1e-6), parameters after the step to ``PARAM_ATOL`` (1e-5).
"""

import copy

import pytest
import torch
from conftest import ATOL, PARAM_ATOL, TEXT, hook_count, param_grads

import distgrad

pytestmark = pytest.mark.usefixtures("backward_mode")

FP16 = dict(device_type="cpu", dtype=torch.float16)
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def clip(g):
    """The edit of every test here: not linear, so an edit applied to the scaled gradient
    instead of the unscaled one gives other numbers."""
    return g.clamp(-1e-3, 1e-3)


def plain_scaled_step(net, ids, module, scaler, edit=None):
    """Plain autograd under float16 autocast: the gradient reaching ``module``'s output
    (unscaled by hand), then ``edit`` of it scaled back by a hook; ``scaler.step`` with SGD."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = {}

    def on_output(mod, args, out):
        def on_grad(grad):
            scale = scaler.get_scale()
            seen["grad"] = grad.float() / scale
            if edit is not None:
                return (edit(grad.float() / scale) * scale).to(grad.dtype)
            return None

        out.register_hook(on_grad)
        seen["dtype"] = out.dtype

    handle = module.register_forward_hook(on_output)
    try:
        with torch.autocast(**FP16):
            logits = net(ids).logits
    finally:
        handle.remove()
    scaler.scale(logits.float().mean()).backward()
    grads = param_grads(net)
    scaler.step(opt)
    scaler.update()
    return seen, grads


def test_unscaled_read_and_edit_match_a_hand_unscaling_hook(gpt2, tokenizer):
    gpt2 = copy.deepcopy(gpt2)  # the step below moves the weights: not the shared fixture's
    ids = torch.tensor(tokenizer([TEXT])["input_ids"])
    plain_net = copy.deepcopy(gpt2)
    plain_scaler = torch.amp.GradScaler("cpu")
    seen, plain_grads = plain_scaled_step(
        plain_net, ids, plain_net.transformer.h[0].mlp.c_fc, plain_scaler, clip
    )
    assert seen["dtype"] == torch.float16  # an autocast region: float16 gradients flow there

    model = distgrad.wrap(gpt2)
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(gpt2.parameters(), lr=0.1)
    with torch.autocast(**FP16), model.trace(ids):
        fc = model.transformer.h[0].mlp.c_fc.output
        loss = model.output.logits.float().mean()  # .sum() would overflow float16
        with loss.backward(scaler=scaler):
            g = fc.grad.save()
            fc.grad = clip(fc.grad)
    assert g.dtype == torch.float32  # shown in float32: unscaled in float16 it would flush
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, seen["grad"], atol=ATOL, rtol=0)
    got = param_grads(gpt2)
    assert got.keys() == plain_grads.keys()
    for name, expected in plain_grads.items():  # still scaled, as plain PyTorch leaves them
        torch.testing.assert_close(
            got[name], expected, atol=PARAM_ATOL * scaler.get_scale(), rtol=0, msg=name
        )
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == plain_scaler.get_scale() == 2.0**16  # no inf: a real step
    for (name, p), q in zip(gpt2.named_parameters(), plain_net.parameters()):
        torch.testing.assert_close(p, q, atol=PARAM_ATOL, rtol=0, msg=name)


def _plain_fp32(mlp, x):
    """Plain autograd in float32: the gradient reaching the first Tanh, parameter gradients."""
    mlp.zero_grad(set_to_none=True)
    h = mlp[1](mlp[0](x))
    h.retain_grad()
    mlp[4](mlp[3](mlp[2](h))).sum().backward()
    grads = param_grads(mlp)
    mlp.zero_grad(set_to_none=True)
    return h.grad, grads


def test_scaled_and_unscaled_reads(mlp):
    x = torch.randn(4, 8)
    plain, plain_grads = _plain_fp32(mlp, x)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = distgrad.wrap(mlp)
    with model.trace(x):
        h = model[1].output
        loss = model.output.sum()
        with scaler.scale(loss).backward():  # no scaler=: the gradients autograd computes
            scaled = h.grad.save()
    torch.testing.assert_close(scaled, plain * 2.0**10, atol=ATOL * 2.0**10, rtol=0)
    mlp.zero_grad(set_to_none=True)
    with model.trace(x):
        h = model[1].output
        loss = model.output.sum()
        with loss.backward(scaler=scaler):
            unscaled = h.grad.save()
        w = model[0].weight.grad.save()  # a parameter's gradient is PyTorch's own: scaled
    torch.testing.assert_close(unscaled, plain, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        w, plain_grads["0.weight"] * 2.0**10, atol=PARAM_ATOL * 2.0**10, rtol=0
    )
    # unedited gradients flow on as autograd made them: unscaling equals plain autograd's step
    scaler.unscale_(torch.optim.SGD(mlp.parameters(), lr=0.1))
    for name, expected in plain_grads.items():
        torch.testing.assert_close(param_grads(mlp)[name], expected, atol=PARAM_ATOL, rtol=0)


def test_a_disabled_scaler_shows_plain_gradients(mlp):
    x = torch.randn(4, 8)
    plain, plain_grads = _plain_fp32(mlp, x)
    model = distgrad.wrap(mlp)
    with model.trace(x):
        h = model[1].output
        with model.output.sum().backward(scaler=torch.amp.GradScaler("cpu", enabled=False)):
            g = h.grad.save()
    torch.testing.assert_close(g, plain, atol=ATOL, rtol=0)
    for name, expected in plain_grads.items():
        torch.testing.assert_close(param_grads(mlp)[name], expected, atol=PARAM_ATOL, rtol=0)


def test_scaler_misuse_raises(mlp):
    x = torch.randn(4, 8)
    model = distgrad.wrap(mlp)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(TypeError, match="takes a torch.amp.GradScaler"):
        with model.trace(x):
            with model.output.sum().backward(scaler=65536.0):
                pass
    with pytest.raises(ValueError, match="has scaled that loss already"):
        with model.trace(x):
            loss = model.output.sum()
            with scaler.scale(loss).backward(scaler=scaler):
                pass
    with pytest.raises(NotImplementedError, match="without invokes"):
        with model.trace() as tr:
            with tr.invoke(x):
                with model.output.sum().backward(scaler=scaler):
                    pass
    assert hook_count(mlp) == 0
    # after the errors, the same model traces and scales as before
    with model.trace(x):
        h = model[1].output
        with model.output.sum().backward(scaler=scaler):
            g = h.grad.save()
    torch.testing.assert_close(g, _plain_fp32(mlp, x)[0], atol=ATOL, rtol=0)


def test_bfloat16_autocast_matches_plain_autograd(gpt2, tokenizer):
    """bfloat16 needs no scaler: its exponent range is float32's. Reads and edits under
    ``torch.autocast(..., dtype=torch.bfloat16)`` are plain autograd's under the same autocast."""
    ids = torch.tensor(tokenizer([TEXT])["input_ids"])
    module = gpt2.transformer.h[0].mlp.c_fc
    seen = {}

    def on_output(mod, args, out):
        def on_grad(grad):
            seen["grad"] = grad.clone()
            return grad * 2

        out.register_hook(on_grad)

    handle = module.register_forward_hook(on_output)
    try:
        with torch.autocast(**BF16):
            logits = gpt2(ids).logits
    finally:
        handle.remove()
    logits.float().sum().backward()
    plain_grads = param_grads(gpt2)
    gpt2.zero_grad(set_to_none=True)

    model = distgrad.wrap(gpt2)
    with torch.autocast(**BF16), model.trace(ids):
        fc = model.transformer.h[0].mlp.c_fc.output
        with model.output.logits.float().sum().backward():
            g = fc.grad.save()
            fc.grad = fc.grad * 2
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(g, seen["grad"], atol=ATOL, rtol=0)
    got = param_grads(gpt2)
    assert got.keys() == plain_grads.keys()
    for name, expected in plain_grads.items():
        torch.testing.assert_close(got[name], expected, atol=PARAM_ATOL, rtol=0, msg=name)
