"""A model from ``accelerator.prepare`` on one process: with ``accelerator=`` and without.

accelerate's own loop (``accelerator.accumulate`` + ``accelerator.backward``) is the oracle:
after two optimizer steps the parameters must agree (fp32, atol 1e-5), or distgrad must raise.
Each test makes its own model (prepare marks it) and resets accelerate's process-wide state
before and after, so that no other test in the worker sees an Accelerator.
"""

import accelerate  # noqa: F401 (a test dependency: missing, it fails here, not skips)
import pytest
import torch
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from conftest import PARAM_ATOL  # noqa: E402

import distgrad  # noqa: E402
from distgrad.demo.models import build_gpt2  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


BATCHES = [
    torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)
]


def _accelerate_loop(steps: int) -> dict:
    """Plain accelerate: two micro-batches per optimizer step when ``steps`` is 2."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=steps)
    net = build_gpt2()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = accelerator.prepare(net, opt)
    for ids in BATCHES:
        with accelerator.accumulate(net):
            accelerator.backward(net(ids).logits.sum() * 1e-3)
            opt.step()
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return params


def _distgrad_loop(steps: int, pass_accelerator: bool) -> dict:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=steps)
    net = build_gpt2()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = accelerator.prepare(net, opt)
    model = distgrad.wrap(net, accelerator=accelerator if pass_accelerator else None)
    for ids in BATCHES:
        with accelerator.accumulate(net):
            with model.trace(ids):
                loss = model.output.logits.sum() * 1e-3
                with loss.backward():
                    pass
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _assert_same(got: dict, ref: dict) -> None:
    moved = max((ref[n] - build_gpt2().state_dict()[n]).abs().max().item() for n in ref)
    assert moved > 1e-4, "the oracle's steps changed nothing: the comparison would prove nothing"
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=PARAM_ATOL, rtol=0, msg=name)


def test_prepared_model_with_accelerator_and_accumulation_matches_accelerate():
    ref = _accelerate_loop(steps=2)
    _assert_same(_distgrad_loop(steps=2, pass_accelerator=True), ref)


def test_prepared_model_without_accelerator_matches_accelerate_without_accumulation():
    """accelerator.backward(loss) is loss.backward() here: distgrad finds that out itself."""
    ref = _accelerate_loop(steps=1)
    _assert_same(_distgrad_loop(steps=1, pass_accelerator=False), ref)


def test_prepared_model_without_accelerator_refuses_accumulation():
    """accelerate divides the loss by the steps; distgrad, without the accelerator, would not:
    wrap raises instead of training with twice the gradient."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = accelerator.prepare(build_gpt2())
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2") as info:
        distgrad.wrap(net)
    assert "distgrad.wrap(model, accelerator=accelerator)" in str(info.value)


def test_accumulation_turned_on_after_wrap_raises_at_the_backward():
    """The steps can be changed on the Accelerator later: every backward checks, and the
    refusal leaves no hook, no gradient and no open trace behind."""
    accelerator = Accelerator(cpu=True)
    net = accelerator.prepare(build_gpt2())
    model = distgrad.wrap(net)
    accelerator.gradient_accumulation_steps = 2
    ids = BATCHES[0]
    with pytest.raises(ValueError, match="accelerator=accelerator"):
        with model.trace(ids):
            a = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                a.grad.save()
    assert all(p.grad is None for p in net.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
    accelerator.gradient_accumulation_steps = 1
    with model.trace(ids):  # the model traces again at once
        logits = model.output.logits.save()
    torch.testing.assert_close(logits, net(ids).logits, atol=1e-6, rtol=0)


def test_a_loss_scaler_is_refused_where_accelerate_runs_the_backward():
    """``accelerator.backward`` scales the loss with accelerate's own scaler (and divides it for
    accumulation): a ``scaler=`` on top would scale it twice, so it raises. Without
    ``accelerator=`` the backward is plain and ``scaler=`` shows the plain gradient."""
    ids = BATCHES[0]
    plain_net = build_gpt2()
    seen = {}
    plain_net.transformer.h[0].register_forward_hook(
        lambda mod, args, out: seen.setdefault("h0", out)
    )
    seen_grad = torch.autograd.grad(plain_net(ids).logits.sum() * 1e-3, seen["h0"])[0]

    accelerator = Accelerator(cpu=True)
    net = accelerator.prepare(build_gpt2())
    scaler = torch.amp.GradScaler("cpu")
    with_accelerator = distgrad.wrap(net, accelerator=accelerator)
    with pytest.raises(NotImplementedError, match="accelerate engine runs the backward"):
        with with_accelerator.trace(ids):
            with (with_accelerator.output.logits.sum() * 1e-3).backward(scaler=scaler):
                pass
    model = distgrad.wrap(net)
    with model.trace(ids):
        h0 = model.transformer.h[0].output
        with (model.output.logits.sum() * 1e-3).backward(scaler=scaler):
            g = h0.grad.save()
    torch.testing.assert_close(g, seen_grad, atol=1e-6, rtol=0)
