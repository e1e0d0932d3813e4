"""``torch.autograd.backward`` and ``torch.autograd.grad`` called in an invoke body.

A body's value is its rows of the batch's tensor, and the graph goes on from the batch's tensor:
PyTorch called on those rows would differentiate a tensor the loss does not depend on. Each
case is checked against plain autograd on the invoke's input alone (the MLP, same weights),
fp32, atol 1e-6 (1e-5 for parameter gradients).
"""

import pytest
import torch
from conftest import ATOL, PARAM_ATOL, param_grads, reference

import distgrad

pytestmark = pytest.mark.usefixtures("backward_mode")


def _xs(n=2, rows=3):
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(rows, 8, generator=gen) for _ in range(n)]


def _plain(mlp, x):
    """Plain autograd on ``x`` alone: the first layer's output, its gradient for
    ``mlp(x).sum()`` and the parameter gradients (conftest.reference)."""
    return reference(mlp, x, mlp[0])


def _close(got, expected, atol=ATOL):
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def test_retain_grad_with_autograd_backward(mlp):
    model = distgrad.wrap(mlp)
    xs = _xs()
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h0 = model[0].output.save()
            h0.retain_grad()
            torch.autograd.backward(model.output.sum(), retain_graph=True)
        with tr.invoke(xs[1]):
            h1 = model[0].output.save()
            h1.retain_grad()
            torch.autograd.backward([model.output.sum()])
    got = param_grads(mlp)
    (_, ref0, params0), (_, ref1, params1) = _plain(mlp, xs[0]), _plain(mlp, xs[1])
    _close(h0.grad, ref0)
    _close(h1.grad, ref1)
    for name in params0:
        _close(got[name], params0[name] + params1[name], atol=PARAM_ATOL)
    mlp.zero_grad(set_to_none=True)


def test_autograd_grad_of_the_invokes_rows(mlp):
    """grad(loss, h) is the gradient plain autograd gives for h on the invoke's input alone;
    a parameter beside it gets its gradient of this loss (the batch's graph, other rows
    contributing nothing); nothing accumulates into .grad."""
    model = distgrad.wrap(mlp)
    xs = _xs()
    weight = mlp[0].weight
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h0 = model[0].output
            # (the batch's graph is one: a later body differentiates it again)
            both = distgrad.save(
                torch.autograd.grad(model.output.sum(), [h0, weight], retain_graph=True)
            )
        with tr.invoke(xs[1]):
            h1 = model[0].output
            g1 = distgrad.save(torch.autograd.grad(model.output.sum(), h1)[0])
    assert all(p.grad is None for p in mlp.parameters())
    (_, ref0, params0), (_, ref1, _) = _plain(mlp, xs[0]), _plain(mlp, xs[1])
    _close(both[0], ref0)
    _close(g1, ref1)
    _close(both[1], params0["0.weight"], atol=PARAM_ATOL)


def test_autograd_grad_keyed_inputs_and_retained_rows(mlp):
    """Inputs given as a dict come back keyed; a retained value of the body gets its rows of
    the gradient too, as plain autograd.grad fills a retained tensor's .grad."""
    model = distgrad.wrap(mlp)
    xs = _xs()
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h0 = model[0].output.save()
            h0.retain_grad()
            a0 = model[1].output
            out = distgrad.save(torch.autograd.grad(model.output.sum(), {"act": a0}))
        with tr.invoke(xs[1]):
            pass
    h = mlp[0](xs[0])
    a = mlp[1](h)
    h.retain_grad()
    ref = torch.autograd.grad(mlp[2:](a).sum(), {"act": a})
    assert list(out) == ["act"]
    _close(out["act"], ref["act"])
    _close(h0.grad, h.grad)


def test_autograd_grad_allow_unused_still_none_for_what_is_unused(mlp):
    model = distgrad.wrap(mlp)
    xs = _xs()
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h0 = model[0].output
            a0 = model[1].output
            got = distgrad.save(
                torch.autograd.grad(a0.sum(), [h0, mlp[2].weight], allow_unused=True)
            )
        with tr.invoke(xs[1]):
            pass
    h = mlp[0](xs[0])
    ref = torch.autograd.grad(mlp[1](h).sum(), [h, mlp[2].weight], allow_unused=True)
    _close(got[0], ref[0])
    assert got[1] is None and ref[1] is None


def test_backward_inputs_naming_the_rows_raises(mlp):
    model = distgrad.wrap(mlp)
    xs = _xs()
    with pytest.raises(NotImplementedError, match=r"backward\(inputs=\[...\]\) in an invoke body"):
        with model.trace() as tr:
            with tr.invoke(xs[0]):
                h0 = model[0].output
                model.output.sum().backward(inputs=[h0])
            with tr.invoke(xs[1]):
                pass
    mlp.zero_grad(set_to_none=True)


def test_torch_autograd_is_put_back(mlp):
    """The functions are torch's own after a trace, also after a body raised; and a call in
    a trace without invokes is plain autograd's."""
    backward, grad = torch.autograd.backward, torch.autograd.grad
    model = distgrad.wrap(mlp)
    xs = _xs()
    with pytest.raises(ValueError, match="mine"):
        with model.trace() as tr:
            with tr.invoke(xs[0]):
                model[0].output
                raise ValueError("mine")
            with tr.invoke(xs[1]):
                pass
    assert torch.autograd.backward is backward and torch.autograd.grad is grad
    with model.trace(xs[0]):
        h = model[0].output
        g = distgrad.save(torch.autograd.grad(model.output.sum(), h)[0])
    assert torch.autograd.backward is backward and torch.autograd.grad is grad
    _close(g, _plain(mlp, xs[0])[1])


def test_retained_grad_reset_between_backwards(mlp):
    """h.grad = None between two plain backwards in a body: the second starts from nothing,
    as in PyTorch (it added the first backward's rows again)."""
    model = distgrad.wrap(mlp)
    xs = _xs()
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h0 = model[0].output.save()
            h0.retain_grad()
            loss = model.output.sum()
            loss.backward(retain_graph=True)
            h0.grad = None
            torch.autograd.backward(loss, retain_graph=True)
        with tr.invoke(xs[1]):
            pass
    _close(h0.grad, _plain(mlp, xs[0])[1])
    mlp.zero_grad(set_to_none=True)


@pytest.mark.parametrize("reset", [True, False])
def test_retained_grad_with_the_body_on_the_path(mlp, reset):
    """The body's loss also uses h itself (h's own retain_grad adds its part before the rows
    arrive): two backwards accumulate, or start again after h.grad = None, as in PyTorch."""
    model = distgrad.wrap(mlp)
    xs = _xs()
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h = model[0].output.save()
            h.retain_grad()
            loss = model.output.sum() + h.pow(2).sum()
            loss.backward(retain_graph=True)
            if reset:
                h.grad = None
            loss.backward(retain_graph=True)
        with tr.invoke(xs[1]):
            pass
    mlp.zero_grad(set_to_none=True)
    p = mlp[0](xs[0])
    p.retain_grad()
    plain = mlp[1:](p).sum() + p.pow(2).sum()
    plain.backward(retain_graph=True)
    if reset:
        p.grad = None
    plain.backward()
    _close(h.grad, p.grad)
    mlp.zero_grad(set_to_none=True)
