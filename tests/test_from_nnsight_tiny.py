"""nnsight's tests/test_tiny.py, ported: the two-layer tiny model, saving, edits, conditionals
and loops in the body (plain Python), values from outside the trace.

Every value is checked against plain PyTorch on the same weights (forward hooks, autograd),
fp32, atol 1e-6. nnsight's session-based tests (``model.session()``) are ported without the
session where the pattern itself is plain Python; ``tracer.stop()`` tests are not ported (see
nnsight_port.py for what is not mirrored).
"""

import pytest
import torch
from nnsight_port import ATOL, assert_close, hooked_run, tiny, tiny_input

import distgrad


@pytest.fixture
def net():
    return tiny()


@pytest.fixture
def model(net):
    return distgrad.wrap(net)


@pytest.fixture
def x():
    return tiny_input()


def test_tiny_1(net, model, x):
    """test_tiny.py::test_tiny_1"""
    with torch.no_grad():
        with model.trace(x):
            hs = model.layer2.output.save()
    assert isinstance(hs, torch.Tensor)
    assert_close(hs, net(x).detach())


def test_grad_setting(net, model, x, backward_mode):
    """test_tiny.py::test_grad_setting: reading, doubling, re-reading layer1's gradient."""
    with model.trace(x):
        l1o = model.layer1.output
        loss = model.output.sum()
        with loss.backward():
            l1_grad = l1o.grad.clone().save()
            l1o.grad = l1o.grad.clone() * 2
            l1_grad_double = l1o.grad.save()
    assert torch.equal(l1_grad * 2, l1_grad_double)
    a1 = net.layer1(x)
    expected = torch.autograd.grad(net.layer2(a1).sum(), a1)[0]
    assert_close(l1_grad, expected)
    # the doubled gradient flowed on: layer1's weight gradient is twice plain autograd's
    got = net.layer1.weight.grad.clone()
    net.zero_grad(set_to_none=True)
    net(x).sum().backward()
    assert_close(got, 2 * net.layer1.weight.grad, atol=1e-5)
    net.zero_grad(set_to_none=True)


def test_external_proxy_intervention_executed_locally(model, x):
    """test_tiny.py::test_external_proxy_intervention_executed_locally (no session)."""
    with model.trace(x):
        l1_out = model.layer1.output.save()
    with model.trace(x):
        # deliberate difference: a saved value is a real tensor, so this edits that tensor
        # (in nnsight, the proxy of a session's earlier trace); no session is needed
        l1_out[:, 2] = 5
    assert l1_out[:, 2] == 5


def test_true_conditional_protocol(net, model, x):
    """test_tiny.py::test_true_conditional_protocol"""
    with model.trace(x):
        num = 5
        if num > 0:
            model.layer1.output[:] = 1
            l1_out = model.layer1.output.save()
        out = model.output.save()
    assert torch.all(l1_out == 1).item()
    assert_close(out, net.layer2(torch.ones(1, 10)).detach())


def test_false_conditional_protocol(net, model, x):
    """test_tiny.py::test_false_conditional_protocol"""
    with model.trace(x):
        num = 5
        if num < 0:
            model.layer1.output[:] = 1
            l1_out = model.layer1.output.save()
        l2_out = model.layer2.output.save()
    with pytest.raises(UnboundLocalError):
        l1_out
    assert_close(l2_out, net(x).detach())


def test_node_as_condition(net, model, x):
    """test_tiny.py::test_node_as_condition: a tensor comparison as an ``if``."""
    with model.trace(x):
        out = model.layer1.output
        out[:, 0] = 1
        if out[:, 0] != 1:
            model.layer1.output[:] = 1
            l1_out = model.layer1.output.save()
        l2 = model.layer2.output.save()
    with pytest.raises(UnboundLocalError):
        l1_out
    seen, _ = hooked_run(
        net,
        x,
        {"l1": net.layer1, "l2": net.layer2},
        edits={"l1": lambda o: torch.cat([torch.ones_like(o[:, :1]), o[:, 1:]], 1)},
    )
    assert_close(l2, seen["l2"])


def test_multiple_dependent_conditionals(model, x):
    """test_tiny.py::test_multiple_dependent_conditionals"""
    with model.trace(x):
        num = 5
        l1_out = model.layer1.output
        l2_out = model.layer2.output.save()
        if num > 0:
            l1_out[:] = 1
        if l1_out[:, 0] != 1:
            model.layer2.output[:] = 2
        if l1_out[:, 0] == 1:
            l2_out[:] = 3
    assert torch.all(l2_out == 3).item()


def test_nested_conditionals(net, model, x):
    """test_tiny.py::test_nested_conditionals"""
    with model.trace(x):
        num = 5
        if num > 0:
            l1_out = model.layer1.output.save()
            if num > 0:
                model.layer1.output[:] = 1
            if num < 0:
                model.layer1.output[:] = 2
        if num < 0:
            model.layer2.output[:] = 0
            if num > 0:
                l2_out = model.layer2.output.save()
        out = model.output.save()
    assert torch.all(l1_out == 1).item()
    with pytest.raises(UnboundLocalError):
        l2_out
    assert_close(out, net.layer2(torch.ones(1, 10)).detach())


def test_conditional_trace(net, model, x):
    """test_tiny.py::test_conditional_trace: a trace under an ``if`` (no session)."""
    num = 5
    if num > 0:
        with model.trace(x):
            output = model.output.save()
    assert_close(output, net(x).detach())


def test_conditional_iteration(model, x):
    """test_tiny.py::test_conditional_iteration: traces inside a loop and an ``if``."""
    result = []
    for item in [0, 1, 2]:
        if item % 2 == 0:
            with model.trace(x):
                result.append(item)
    assert result == [0, 2]


def test_bridge_protocol(model, x):
    """test_tiny.py::test_bridge_protocol: a value from outside the trace used in an edit."""
    val = 0
    with model.trace(x):
        model.layer1.output[:] = val
        l1_out = model.layer1.output.save()
    assert torch.all(l1_out == 0).item()


def test_sequential_graph_based_context_exit(model, x):
    """test_tiny.py::test_sequential_graph_based_context_exit: ``break`` in a body's loop."""
    with model.trace(x):
        kept = distgrad.save([])
        kept.append(0)
        for item in [1, 2, 3, 4]:
            if item == 3:
                break
            kept.append(item)
        kept.append(5)
    assert kept == [0, 1, 2, 5]


def test_bridged_node_cleanup(model, x):
    """test_tiny.py::test_bridged_node_cleanup"""
    with model.trace(x):
        kept = distgrad.save([])
        for item in [0, 1, 2]:
            if item == 2:
                break
            kept.append(item)
    assert kept == [0, 1]


def test_nested_iterator(model, x):
    """test_tiny.py::test_nested_iterator"""
    with model.trace(x):
        kept = distgrad.save([])
        kept.append([0])
        kept.append([1])
        kept.append([2])
        l2 = distgrad.save([])
        for item in kept:
            for item_2 in item:
                l2.append(item_2)
    assert l2 == [0, 1, 2]


def test_nnsight_builtins(model, x):
    """test_tiny.py::test_nnsight_builtins: builtin values saved from a body."""
    with model.trace(x):
        nn_list = distgrad.save([])
        sesh_list = distgrad.save([])
        apply_list = distgrad.save([])
        for kept in [nn_list, sesh_list, apply_list]:
            kept.append(int)
            kept.append("Hello World")
            kept.append({"a": "1"})
    assert nn_list == sesh_list == apply_list == [int, "Hello World", {"a": "1"}]


def test_torch_creation_operations_patch(net, model, x):
    """test_tiny.py::test_torch_creation_operations_patch: torch factories on a value's shape."""
    with model.trace(x):
        l1_output = model.layer1.output
        made = [
            torch.arange(l1_output.shape[0], l1_output.shape[1]),
            torch.empty(l1_output.shape),
            torch.eye(l1_output.shape[0]),
            torch.full(l1_output.shape, 5),
            torch.linspace(l1_output.shape[0], l1_output.shape[1], 5),
            torch.logspace(l1_output.shape[0], l1_output.shape[1], 5),
            torch.ones(l1_output.shape),
            torch.rand(l1_output.shape),
            torch.randint(5, l1_output.shape),
            torch.randn(l1_output.shape),
            torch.randperm(l1_output.shape[0]),
            torch.zeros(l1_output.shape),
        ]
    # deliberate difference: names bound in the body stay real tensors after the trace
    assert all(isinstance(t, torch.Tensor) for t in made)
    assert made[0].tolist() == list(range(1, 10))
    assert made[6].shape == (1, 10) and torch.equal(made[3], torch.full((1, 10), 5))
    assert_close(l1_output, net.layer1(x).detach(), atol=ATOL)
