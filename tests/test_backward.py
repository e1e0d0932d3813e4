"""Backward blocks: gradient reads and edits against plain autograd, ordering, and errors.

Each test runs in every body mode (conftest.backward_mode): the body as a generator, in place
with the backward in a greenlet (CPU), and in place with the backward in a worker thread (the
path CUDA takes, where autograd calls hooks on its own threads).
"""

import threading

import pytest
import torch
from conftest import ATOL, PARAM_ATOL, TEXT, assert_param_grads, param_grads

import distgrad

pytestmark = pytest.mark.usefixtures("backward_mode")


def _retained(net, tokenizer, modules, loss_fn=lambda o: o.logits.sum()):
    """Plain autograd with retain_grad on each module's output."""
    outs = []

    def keep(mod, args, out):
        out.retain_grad()
        outs.append(out)

    handles = [m.register_forward_hook(keep) for m in modules]
    net.zero_grad(set_to_none=True)
    out = net(**dict(tokenizer([TEXT], return_tensors="pt")))
    for h in handles:
        h.remove()
    loss_fn(out).backward()
    grads = param_grads(net)
    net.zero_grad(set_to_none=True)
    return [o.grad for o in outs], grads


def test_reverse_order_reads_match_retain_grad(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXT):
        h0 = model.transformer.h[0].output
        h1 = model.transformer.h[1].output
        loss = model.output.logits.sum()
        with loss.backward():
            g1 = h1.grad.save()
            g0 = h0.grad.save()
    got = param_grads(gpt2)
    (r0, r1), ref = _retained(gpt2, tokenizer, [gpt2.transformer.h[0], gpt2.transformer.h[1]])
    torch.testing.assert_close(g1, r1, atol=ATOL, rtol=0)
    torch.testing.assert_close(g0, r0, atol=ATOL, rtol=0)
    for n in ref:  # reading changes nothing
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0)


def test_forward_order_grad_requests_raise(gpt2, tokenizer, backward_mode):
    """The error names the value asked too late and, as its example, the order that works,
    in the model's own paths."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(
        distgrad.OutOfOrderError,
        match=r"model\.transformer\.h\[1\]\.output\.grad was requested after.*"
        r"\(model\.transformer\.h\[1\]\.output\.grad before "
        r"model\.transformer\.h\[0\]\.output\.grad\)",
    ):
        with model.trace(TEXT):
            h0 = model.transformer.h[0].output
            h1 = model.transformer.h[1].output
            with model.output.logits.sum().backward():
                h0.grad
                h1.grad


def test_inplace_edit_reaches_only_its_branch():
    x = torch.randn(4, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    a, b = x * 2, y * 3
    loss = (a + b).sum()  # AddBackward hands the same gradient tensor to a and b
    with loss.backward():
        a.grad[:] = 0
    assert torch.equal(x.grad, torch.zeros(4))
    assert torch.equal(y.grad, torch.full((4,), 3.0))


def test_gradient_and_retain_graph_two_blocks(mlp):
    x = torch.randn(3, 8)
    model = distgrad.wrap(mlp)
    seed = torch.randn(3, 4)
    with model.trace(x):
        h = model[2].output
        out = model.output
        with out.backward(gradient=seed, retain_graph=True):
            g_first = h.grad.save()
            h.grad = h.grad * 3
        with out.backward(seed):
            g_second = h.grad.save()
    got = param_grads(mlp)

    mlp.zero_grad(set_to_none=True)
    hx = mlp[:3](x)
    hx.retain_grad()
    out = mlp[3:](hx)
    (g_ref,) = torch.autograd.grad(out, hx, seed, retain_graph=True)
    out.backward(seed, retain_graph=True)
    hx.register_hook(lambda g: g * 3)
    out.backward(seed)  # first block tripled h's gradient; the second left it alone
    ref = param_grads(mlp)
    torch.testing.assert_close(g_first, g_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(g_second, g_ref, atol=ATOL, rtol=0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0)


def test_bare_backward_is_unchanged(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXT):
        loss = model.output.logits.sum()
        assert loss.backward() is None
    got = param_grads(gpt2)
    _, ref = _retained(gpt2, tokenizer, [])
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0)
    assert torch.Tensor.backward.__wrapped__ is not None


def test_library_hooks_see_plain_grad_during_a_block(gpt2, tokenizer):
    """A post-accumulate hook (as FSDP and ZeRO use) and another thread read real .grad."""
    weight = gpt2.transformer.h[1].mlp.c_fc.weight
    seen = []
    handle = weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    try:
        with model.trace(TEXT):
            h0 = model.transformer.h[0].output
            loss = model.output.logits.sum()
            with loss.backward():
                h0.grad = h0.grad * 2
                assert weight.grad is not None  # a Parameter: plain PyTorch in the body too
                from_thread = []
                t = threading.Thread(target=lambda: from_thread.append(weight.grad.clone()))
                t.start()
                t.join()
    finally:
        handle.remove()
    _, ref = _retained(gpt2, tokenizer, [])
    torch.testing.assert_close(seen[0], ref["transformer.h.1.mlp.c_fc.weight"], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        from_thread[0], ref["transformer.h.1.mlp.c_fc.weight"], atol=1e-5, rtol=0
    )


def test_retain_grad_tensors_stay_plain(mlp):
    """A backward block outside a trace leaves retain_grad alone: after it, ``h.grad`` and the
    parameter gradients are the ones plain autograd gives (atol 1e-6 and 1e-5)."""
    x = torch.randn(2, 8)
    plain_h = mlp[:3](x)
    plain_out = mlp[3:](plain_h).sum()
    (expected_h_grad,) = torch.autograd.grad(plain_out, plain_h, retain_graph=True)
    plain_out.backward()
    expected = param_grads(mlp)
    mlp.zero_grad(set_to_none=True)

    h = mlp[:3](x)
    h.retain_grad()
    out = mlp[3:](h).sum()
    with out.backward():
        pass
    assert h.grad is not None and h.grad.shape == h.shape
    torch.testing.assert_close(h.grad, expected_h_grad, atol=ATOL, rtol=0)
    assert_param_grads(mlp, expected, atol=PARAM_ATOL)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (lambda g: torch.zeros(3), ValueError, r"shape \[3\] instead of"),
        (lambda g: g.double(), ValueError, "dtype torch.float64 instead of torch.float32"),
        (lambda g: torch.zeros_like(g, device="meta"), ValueError, "device meta instead of cpu"),
        (lambda g: 2.0, TypeError, "needs a torch.Tensor"),
    ],
)
def test_bad_replacement_is_refused_by_name(gpt2, tokenizer, bad, error, match):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(error, match=match) as info:
        with model.trace(TEXT):
            a1 = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                a1.grad = bad(a1.grad)
    assert "model.transformer.h[0].output.grad" in str(info.value)


def test_grad_outside_a_block_and_untracked_tensors(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(distgrad.TraceStateError, match=r"h\[0\]\.output\.grad was read outside"):
        with model.trace(TEXT):
            model.transformer.h[0].output.grad
    with pytest.raises(ValueError, match="not on the path"):
        with model.trace(TEXT):
            h0 = model.transformer.h[0].output
            side = h0 * 2  # never used by the loss
            with model.output.logits.sum().backward():
                side.grad


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "frozen"])
def test_no_graph_means_not_implemented(gpt2, tokenizer, how):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how)
    if how == "frozen":
        gpt2.requires_grad_(False)
    try:
        with pytest.raises(NotImplementedError, match="no gradient tracking"):
            with ctx() if ctx else torch.enable_grad():
                with model.trace(TEXT):
                    loss = model.output.logits.sum()
                    with loss.backward():
                        pass
    finally:
        gpt2.requires_grad_(True)


def test_forward_values_after_backward_starts_raise(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(distgrad.OutOfOrderError, match="after the forward had finished"):
        with model.trace(TEXT):
            with model.output.logits.sum().backward():
                model.transformer.h[0].output


def test_block_outside_a_trace_and_execute():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    loss = (h * h).sum()
    with loss.backward():
        g = h.grad.save()
        h.grad = torch.ones_like(h.grad)
    torch.testing.assert_close(g, 2 * h.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(x.grad, x.detach().exp(), atol=ATOL, rtol=0)

    x.grad = None
    h = x.exp()
    loss = (h * h).sum()
    tracer = distgrad.BackwardTracer(loss, torch.Tensor.backward.__wrapped__)
    assert (tracer.tensor, tracer.args, tracer.kwargs, tracer.backend) == (loss, (), {}, None)
    code = compile("h.grad = h.grad * 0", "<body>", "exec")
    tracer.execute(code)
    assert torch.equal(x.grad, torch.zeros(3))
