"""nnsight's gradient tests, ported: tests/test_backward.py (the MLP), test_backward_batching.py
and test_backward_errors.py (GPT-2, here the tiny random one), and the gradient tests of
test_lm.py.

Every gradient is checked against plain autograd on the same weights (``torch.autograd.grad``,
tensor hooks, ``retain_grad``), fp32, atol 1e-6 (1e-5 for parameter gradients).
"""
import pytest
import torch

import distgrad
from conftest import PARAM_ATOL, reference
from nnsight_port import assert_close, encode, hooked_run, mlp, mlp_fc1_grad

# every body mode: a generator the hooks resume, in place in a greenlet, the backward in a thread
pytestmark = pytest.mark.usefixtures("backward_mode")

PROMPT_A = "The quick brown fox jumps"
PROMPT_B = "Madison Square Garden is located in"


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


# --- tests/test_backward_batching.py and test_backward_errors.py (GPT-2) -------------------

def _single_grad(gpt2, tokenizer, prompt, module=lambda net: net.transformer.h[-1]):
    inputs = encode(tokenizer, prompt)
    _, grad, _ = reference(gpt2, inputs, module(gpt2))
    return grad


@pytest.mark.parametrize("which", ["first", "second"])
def test_grad_in_one_of_two_invokes(gpt2, tokenizer, which):
    """test_backward_batching.py::TestBackwardWithBatchedInvokes::test_grad_in_second_invoke
    and ::test_grad_in_first_invoke"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke("Hello" if which == "second" else "World"):
            if which == "first":
                x = model.transformer.h[-1].output
                x.requires_grad_(True)
                with model.lm_head.output.sum().backward():
                    grad = x.grad.save()
            else:
                clean = model.transformer.h[-1].output.save()
        with tracer.invoke("World" if which == "second" else "Hello"):
            if which == "second":
                x = model.transformer.h[-1].output
                x.requires_grad_(True)
                with model.lm_head.output.sum().backward():
                    grad = x.grad.save()
            else:
                clean = model.transformer.h[-1].output.save()
    # "Hello" and "World" tokenize to the same length, so there is no padding in the batch
    assert grad.shape[0] == 1 and clean.shape[0] == 1
    assert_close(grad, _single_grad(gpt2, tokenizer, "World"))


def test_attribution_patching(gpt2, tokenizer):
    """test_backward_batching.py::TestBackwardWithBatchedInvokes::test_attribution_patching"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    paris, rome = 80, 85
    prompts = ["The Eiffel Tower is in", "The Colosseum is in"]
    with model.trace() as tracer:
        with tracer.invoke(prompts[0]):
            pass
        with tracer.invoke(prompts[1]):
            hs = model.transformer.h[1].output
            logits = model.lm_head.output[:, -1]
            metric = logits[0, paris] - logits[0, rome]
            with metric.backward():
                attr = hs.grad.save()
    batch = encode(tokenizer, prompts)
    _, expected, _ = reference(gpt2, batch, gpt2.transformer.h[1],
                               loss_fn=lambda logits: logits[1, -1, paris] - logits[1, -1, rome])
    assert_close(attr, expected[1:])


def test_grad_deterministic(gpt2, tokenizer):
    """test_backward_batching.py::TestBackwardWithBatchedInvokes::test_grad_deterministic"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    grads = []
    for _ in range(2):
        with model.trace() as tracer:
            with tracer.invoke("Hello"):
                pass
            with tracer.invoke("World"):
                x = model.transformer.h[-1].output
                with model.lm_head.output.sum().backward():
                    grads.append(x.grad.save())
    assert torch.equal(grads[0], grads[1])
    assert_close(grads[0], _single_grad(gpt2, tokenizer, "World"))


def test_grad_modification(gpt2, tokenizer):
    """test_backward_batching.py::TestBackwardWithBatchedInvokes::test_grad_modification"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke("Hello"):
            pass
        with tracer.invoke("World"):
            x = model.transformer.h[-1].output
            with model.lm_head.output.sum().backward():
                orig = x.grad.clone().save()
                x.grad[:] = 0
                zeroed = x.grad.save()
    assert (orig != 0).any() and (zeroed == 0).all()
    # the zeroed gradient flowed on: nothing reaches block 0 from "World"'s row
    assert gpt2.transformer.h[0].mlp.c_fc.weight.grad.abs().max() == 0


def test_single_invoke_grad(gpt2, tokenizer):
    """test_backward_batching.py::TestBackwardRegressions::test_single_invoke"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace("Hello"):
        x = model.transformer.h[-1].output
        x.requires_grad_(True)
        with model.lm_head.output.sum().backward():
            grad = x.grad.save()
    assert_close(grad, _single_grad(gpt2, tokenizer, "Hello"))


def test_input_plus_empty_invoke(gpt2, tokenizer):
    """test_backward_batching.py::TestBackwardRegressions::test_input_plus_empty_invoke"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke("Hello"):
            x = model.transformer.h[-1].output
            with model.lm_head.output.sum().backward():
                grad = x.grad.save()
        with tracer.invoke():
            out = model.transformer.h[-1].output.save()
    assert_close(grad, _single_grad(gpt2, tokenizer, "Hello"))
    assert out.shape[0] == 1


def test_retain_graph(gpt2, tokenizer):
    """test_backward_batching.py::TestBackwardRegressions::test_retain_graph, and
    test_lm.py::test_multi_grad"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace("Hello"):
        x = model.transformer.h[-1].output
        logits = model.lm_head.output
        with logits.sum().backward(retain_graph=True):
            g1 = x.grad.save()
        modified = logits * 2
        with modified.sum().backward():
            g2 = x.grad.save()
    assert not torch.all(g1.eq(g2))
    assert_close(g1, _single_grad(gpt2, tokenizer, "Hello"))
    assert_close(g2, g1 * 2)


def test_pop_back_pattern(gpt2, tokenizer):
    """test_backward_batching.py::TestSwapSelfReferentialGuard::test_pop_back_pattern: read an
    output, assign it back, take its gradient."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke("Hello"):
            clean = model.transformer.h[-1].output.save()
        with tracer.invoke("World"):
            x = model.transformer.h[-1].output
            x.requires_grad_(True)
            model.transformer.h[-1].output = x
            with model.lm_head.output.sum().backward():
                grad = x.grad.save()
    assert clean.shape[0] == 1  # the first invoke's row only
    assert_close(grad, _single_grad(gpt2, tokenizer, "World"))


def test_normal_swap_unaffected(gpt2, tokenizer):
    """test_backward_batching.py::TestSwapSelfReferentialGuard::test_normal_swap_unaffected"""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke("Hello"):
            pass
        with tracer.invoke("World"):
            model.transformer.h[-1].output = model.transformer.h[-1].output * 2
            logits = model.lm_head.output.save()
    _, expected = hooked_run(gpt2, encode(tokenizer, "World"), {"h": gpt2.transformer.h[-1]},
                             edits={"h": lambda out: out * 2})
    assert_close(logits, expected.logits)


@pytest.mark.parametrize("count", [2, 3])
def test_retain_graph_across_invokes(gpt2, tokenizer, count):
    """test_backward_errors.py::TestRetainGraphAcrossInvokes::test_retain_graph_on_all_but_last
    and ::test_three_invokes"""
    prompts = [PROMPT_A, PROMPT_B, "A completely different sentence appears"][:count]
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    grads = []
    with model.trace() as tracer:
        for index, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                x = model.transformer.h[1].attn.c_proj.output
                with model.lm_head.output.sum().backward(retain_graph=index < count - 1):
                    grads.append(x.grad.save())
    batch = encode(tokenizer, prompts)
    _, expected, _ = reference(gpt2, batch, gpt2.transformer.h[1].attn.c_proj)
    for index, grad in enumerate(grads):
        # rows padded on the right: the pad positions' gradients are part of the batch's too
        assert_close(grad, expected[index:index + 1])


# --- tests/test_lm.py gradients --------------------------------------------------------------

def test_retain_grad(gpt2, tokenizer):
    """test_lm.py::test_retain_grad: ``retain_grad()`` and a plain ``.backward()`` in the body."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke("Hello World"):
            hidden_states = model.transformer.h[-1].output.save()
            hidden_states.retain_grad()
            model.lm_head.output.sum().backward()
    assert_close(hidden_states.grad, _single_grad(gpt2, tokenizer, "Hello World"))


def test_retain_grad_without_invoke(gpt2, tokenizer):
    """test_lm.py::test_retain_grad, in a trace with its input (the body runs in place)."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace("Hello World"):
        hidden_states = model.transformer.h[-1].output.save()
        hidden_states.retain_grad()
        model.lm_head.output.sum().backward()
    got = hidden_states.grad
    assert_close(got, _single_grad(gpt2, tokenizer, "Hello World"))


def test_grad(gpt2, tokenizer):
    """test_lm.py::test_grad: an in-place edit and an assignment of the gradient."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke("Hello World"):
            hidden_states = model.transformer.h[-1].output
            logits = model.lm_head.output.save()
            with logits.sum().backward():
                hidden_states_grad = hidden_states.grad.save()
                hidden_states_grad[:] = 0
    assert (hidden_states_grad == 0).all().item()
    gpt2.zero_grad(set_to_none=True)
    with model.trace() as tracer:
        with tracer.invoke("Hello World"):
            hidden_states = model.transformer.h[-1].output
            with model.lm_head.output.sum().backward():
                grad = hidden_states.grad.clone()
                grad[:] = 0
                hidden_states.grad = grad
                hidden_states_2grad = hidden_states.grad.save()
    assert (hidden_states_2grad == 0).all().item()
    got = {n: p.grad.clone() for n, p in gpt2.named_parameters() if p.grad is not None}
    _, _, expected = reference(gpt2, encode(tokenizer, "Hello World"), gpt2.transformer.h[-1],
                               edit=torch.zeros_like)
    assert got.keys() == expected.keys()
    for name in expected:
        assert_close(got[name], expected[name], atol=PARAM_ATOL)
