"""nnsight's gradient tests on GPT-2 (here the tiny random one), ported:
test_backward_batching.py, test_backward_errors.py and the gradient tests of test_lm.py (the
MLP ones of test_backward.py are in test_from_nnsight_backward.py).

Every gradient is checked against plain autograd on the same weights (``torch.autograd.grad``,
tensor hooks, ``retain_grad``), fp32, atol 1e-6 (1e-5 for parameter gradients).
"""

import pytest
import torch
from conftest import PARAM_ATOL, reference
from nnsight_port import assert_close, encode, hooked_run

import distgrad

# both backward modes: the run in a greenlet, the backward in a worker thread
pytestmark = pytest.mark.usefixtures("backward_mode")

PROMPT_A = "The quick brown fox jumps"
PROMPT_B = "Madison Square Garden is located in"


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
    _, expected, _ = reference(
        gpt2,
        batch,
        gpt2.transformer.h[1],
        loss_fn=lambda logits: logits[1, -1, paris] - logits[1, -1, rome],
    )
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
    _, expected = hooked_run(
        gpt2,
        encode(tokenizer, "World"),
        {"h": gpt2.transformer.h[-1]},
        edits={"h": lambda out: out * 2},
    )
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
        assert_close(grad, expected[index : index + 1])


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
    _, _, expected = reference(
        gpt2, encode(tokenizer, "Hello World"), gpt2.transformer.h[-1], edit=torch.zeros_like
    )
    assert got.keys() == expected.keys()
    for name in expected:
        assert_close(got[name], expected[name], atol=PARAM_ATOL)
