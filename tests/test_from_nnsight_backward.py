"""nnsight's gradient tests on its MLP, ported: tests/test_backward.py (the GPT-2 ones are in
test_from_nnsight_lm_backward.py).

Every gradient is checked against plain autograd on the same weights (``torch.autograd.grad``,
tensor hooks, ``retain_grad``), fp32, atol 1e-6 (1e-5 for parameter gradients).
"""

import pytest
import torch
from conftest import PARAM_ATOL
from nnsight_port import assert_close, mlp, mlp_fc1_grad

import distgrad

# both backward modes: the run in a greenlet, the backward in a worker thread
pytestmark = pytest.mark.usefixtures("backward_mode")


@pytest.fixture
def x():
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


# --- tests/test_backward.py ----------------------------------------------------------------


def test_grad_matches_reference(x):
    """test_backward.py::TestBackward::test_grad_matches_reference"""
    net = mlp()
    model = distgrad.wrap(net)
    with model.trace(x):
        a1 = model.fc1.output
        loss = model.output.sum()
        with loss.backward():
            g = a1.grad.clone()
    assert_close(g, mlp_fc1_grad(net, x))


def test_grad_edit_is_visible(x):
    """test_backward.py::TestBackward::test_grad_edit_is_visible"""
    model = distgrad.wrap(mlp())
    with model.trace(x):
        a1 = model.fc1.output
        with model.output.sum().backward():
            g1 = a1.grad.clone()
            a1.grad = a1.grad * 2
            g2 = a1.grad.clone()
    assert torch.equal(g2, g1 * 2)


def test_grad_edit_propagates_downstream(x):
    """test_backward.py::TestBackward::test_grad_edit_propagates_downstream"""
    net = mlp()
    model = distgrad.wrap(net)
    with model.trace(x):
        a1 = model.fc1.output
        with model.output.sum().backward():
            a1.grad = a1.grad * 2
    edited = net.fc1.weight.grad.clone()
    net.zero_grad()
    net(x).sum().backward()
    assert_close(edited, 2 * net.fc1.weight.grad, atol=PARAM_ATOL)


def test_multiple_grads_in_backward_order(x):
    """test_backward.py::TestBackward::test_multiple_grads_in_backward_order"""
    net = mlp()
    model = distgrad.wrap(net)
    with model.trace(x):
        a1 = model.fc1.output
        a2 = model.fc2.output
        with model.output.sum().backward():
            g2 = a2.grad.clone()
            g1 = a1.grad.clone()
    assert_close(g2, torch.ones(2, 8))
    assert_close(g1, mlp_fc1_grad(net, x))


def test_out_of_order_grad_raises(x):
    """test_backward.py::TestBackward::test_out_of_order_grad_raises"""
    model = distgrad.wrap(mlp())
    with pytest.raises(distgrad.OutOfOrderError):
        with model.trace(x):
            a1 = model.fc1.output
            a2 = model.fc2.output
            with model.output.sum().backward():
                a1.grad
                a2.grad


def test_grad_escapes_via_variable(x):
    """test_backward.py::TestBackward::test_grad_escapes_via_variable"""
    net = mlp()
    model = distgrad.wrap(net)
    with model.trace(x):
        a1 = model.fc1.output
        with model.output.sum().backward():
            g = distgrad.save(a1.grad.clone())
    assert_close(g, mlp_fc1_grad(net, x))


def test_backward_without_with_block_is_untouched():
    """test_backward.py::TestBareBackward::test_backward_without_with_block_is_untouched"""
    t = torch.tensor([2.0], requires_grad=True)
    (t * 3).sum().backward()
    assert torch.equal(t.grad, torch.tensor([3.0]))


XS = [torch.randn(n, 8, generator=torch.Generator().manual_seed(2 + n)) for n in (2, 3, 1)]


def test_each_invoke_gets_its_own_gradient():
    """test_backward.py::TestBackwardAcrossInvokes::test_each_invoke_gets_its_own_gradient"""
    net = mlp()
    model = distgrad.wrap(net)
    x0, x1 = XS[0], XS[1]
    with model.trace() as tracer:
        with tracer.invoke(x0):
            a0 = model.fc1.output
            with model.output.sum().backward(retain_graph=True):
                g0 = distgrad.save(a0.grad.clone())
        with tracer.invoke(x1):
            a1 = model.fc1.output
            with model.output.sum().backward():
                g1 = distgrad.save(a1.grad.clone())
    assert_close(g0, mlp_fc1_grad(net, x0))
    assert_close(g1, mlp_fc1_grad(net, x1))


@pytest.mark.parametrize("target", [0, 1, 2])
def test_gradient_from_any_invoke_of_three(target):
    """test_backward.py::TestBackwardAcrossInvokes::test_gradient_from_any_invoke_of_three"""
    net = mlp()
    model = distgrad.wrap(net)
    captured = {}
    with model.trace() as tracer:
        for index, x in enumerate(XS):
            with tracer.invoke(x):
                if index == target:
                    a1 = model.fc1.output
                    with model.output.sum().backward(retain_graph=True):
                        captured["g"] = distgrad.save(a1.grad.clone())
                else:
                    distgrad.save(model.output.sum())
    assert_close(captured["g"], mlp_fc1_grad(net, XS[target]))


def test_grad_edit_stays_within_its_invoke():
    """test_backward.py::TestBackwardAcrossInvokes::test_grad_edit_stays_within_its_invoke"""
    net = mlp()
    model = distgrad.wrap(net)
    x0, x1 = XS[0], XS[1]
    with model.trace() as tracer:
        with tracer.invoke(x0):
            a0 = model.fc1.output
            with model.output.sum().backward(retain_graph=True):
                a0.grad = a0.grad * 3.0
                g0 = distgrad.save(a0.grad.clone())
        with tracer.invoke(x1):
            a1 = model.fc1.output
            with model.output.sum().backward():
                g1 = distgrad.save(a1.grad.clone())
    assert_close(g0, mlp_fc1_grad(net, x0) * 3.0)
    assert_close(g1, mlp_fc1_grad(net, x1))


def test_two_invokes_without_retain_graph():
    """test_backward.py::TestFreedGraphDiagnostic::test_message_names_the_cause_and_the_fix,
    and test_backward_errors.py::test_backward_in_two_invokes_explains_the_shared_graph."""
    net = mlp()
    model = distgrad.wrap(net)
    with model.trace() as tracer:
        with tracer.invoke(XS[0]):
            a0 = model.fc1.output
            with model.output.sum().backward():
                g0 = distgrad.save(a0.grad.clone())
        with tracer.invoke(XS[1]):
            a1 = model.fc1.output
            with model.output.sum().backward():
                g1 = distgrad.save(a1.grad.clone())
    # deliberate difference: one backward runs over the sum of the invokes' losses, so
    # invokes do not free each other's graph and need no retain_graph=True (nnsight raises)
    assert_close(g0, mlp_fc1_grad(net, XS[0]))
    assert_close(g1, mlp_fc1_grad(net, XS[1]))


def test_other_runtime_errors_are_not_reworded(x):
    """test_backward.py::TestFreedGraphDiagnostic::test_other_runtime_errors_are_not_reworded,
    test_backward_errors.py::test_unrelated_runtime_errors_are_not_reworded"""
    model = distgrad.wrap(mlp())
    with pytest.raises(RuntimeError, match="shape"):
        with model.trace(x):
            a1 = model.fc1.output
            with model.output.sum().backward(gradient=torch.zeros(3, 3)):
                distgrad.save(a1.grad.clone())
