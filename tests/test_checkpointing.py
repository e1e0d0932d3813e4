"""Gradient checkpointing: the backward runs a checkpointed block's forward again.

Oracle: the same program without checkpointing, and raw forward/tensor hooks (which fire again
in the recompute) with it. With ``use_reentrant=False`` every read and edit gives those numbers;
with ``use_reentrant=True`` (the block's forward runs without gradients) an edit inside the
block and ``.grad`` of a value read there raise errors that name checkpointing.
"""

import gc
import warnings

import pytest
import torch
from conftest import ATOL, PARAM_ATOL, assert_param_grads, hook_count, param_grads
from torch.utils.checkpoint import checkpoint
from transformers import GPT2Config, GPT2LMHeadModel

import distgrad

IDS = torch.tensor([[84, 107, 104, 33, 69, 105, 102, 101]])


def _net(reentrant=None):
    """A tiny GPT-2 in train mode with dropout off; ``reentrant``: checkpoint each block."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=384,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    net = GPT2LMHeadModel(cfg).train()
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
    return net


def _fc(net):
    return net.transformer.h[0].mlp.c_fc


def _hooked(net, module, hook, pre=False):
    """Plain autograd: one forward with ``hook`` on ``module``, loss = logits.sum()."""
    handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
    try:
        net(IDS).logits.sum().backward()
    finally:
        handle.remove()
    grads = param_grads(net)
    net.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("where", ["block", "after"])
def test_forward_edit_inside_a_checkpointed_block(backward_mode, where):
    plain = _net()
    expected = _hooked(plain, _fc(plain), lambda m, a, out: out * 0.5)
    net = _net(reentrant=False)
    raw = _hooked(net, _fc(net), lambda m, a, out: out * 0.5)  # raw hooks under checkpointing
    for name in expected:
        torch.testing.assert_close(raw[name], expected[name], atol=PARAM_ATOL, rtol=0)
    model = distgrad.wrap(net)
    before = hook_count(net)
    with model.trace(IDS):
        model.transformer.h[0].mlp.c_fc.output = model.transformer.h[0].mlp.c_fc.output * 0.5
        logits = model.output.logits.save()
        loss = logits.sum()
        if where == "block":
            with loss.backward():
                pass
    if where == "after":
        loss.backward()
    with torch.no_grad():
        fc = _fc(plain)
        handle = fc.register_forward_hook(lambda m, a, out: out * 0.5)
        torch.testing.assert_close(logits, plain(IDS).logits, atol=ATOL, rtol=0)
        handle.remove()
    assert_param_grads(net, expected, atol=PARAM_ATOL)
    del loss, logits
    gc.collect()
    assert hook_count(net) == before  # the recompute's hook leaves with the graph


def test_input_edit_inside_a_checkpointed_block(backward_mode):
    def twice(m, args):
        return (args[0] * 2,)

    plain = _net()
    expected = _hooked(plain, plain.transformer.h[1].mlp, twice, pre=True)
    model = distgrad.wrap(_net(reentrant=False))
    with model.trace(IDS):
        model.transformer.h[1].mlp.input = model.transformer.h[1].mlp.input * 2
        with model.output.logits.sum().backward():
            pass
    assert_param_grads(model.module, expected)


def test_forward_read_used_in_the_loss(backward_mode):
    # The body's own `a * a` saves tensors while the block's forward runs: the recompute must
    # still find the block's saved tensors where it left them.
    def run(net):
        seen = {}

        def on_output(m, args, out):  # computed where the body computes it, in the forward
            seen["a"], seen["square"] = out, (out * out).mean()

        handle = _fc(net).register_forward_hook(on_output)
        out = net(IDS).logits
        handle.remove()
        (out.sum() + seen["square"]).backward()
        grads = param_grads(net)
        net.zero_grad(set_to_none=True)
        return seen["a"].detach(), grads

    ref_a, expected = run(_net())  # (raw hooks under checkpointing cannot do this: torch's
    # CheckpointError, as the recompute runs the hook's `out * out` again)
    model = distgrad.wrap(_net(reentrant=False))
    with model.trace(IDS):
        a = model.transformer.h[0].mlp.c_fc.output
        square = (a * a).mean()
        with (model.output.logits.sum() + square).backward():
            pass
    torch.testing.assert_close(a.detach(), ref_a, atol=ATOL, rtol=0)
    assert_param_grads(model.module, expected)


def test_grad_read_and_edit_inside_a_checkpointed_block(backward_mode):
    def run(net):
        seen = {}

        def on_output(m, a, out):
            def on_grad(g):
                seen.setdefault("g", g.clone())
                return g * 3

            out.register_hook(on_grad)

        expected = _hooked(net, _fc(net), on_output)
        return seen["g"], expected

    ref_g, expected = run(_net())
    raw_g, raw = run(_net(reentrant=False))
    torch.testing.assert_close(raw_g, ref_g, atol=ATOL, rtol=0)
    model = distgrad.wrap(_net(reentrant=False))
    with model.trace(IDS):
        a = model.transformer.h[0].mlp.c_fc.output
        with model.output.logits.sum().backward():
            g = a.grad.save()
            a.grad = a.grad * 3
    torch.testing.assert_close(g, ref_g, atol=ATOL, rtol=0)
    assert_param_grads(model.module, expected)


def test_reentrant_read_gives_the_forward_values(backward_mode):
    plain = _net()
    seen = {}
    expected = _hooked(plain, _fc(plain), lambda m, a, out: seen.update(a=out.detach()))
    model = distgrad.wrap(_net(reentrant=True))
    with model.trace(IDS):
        a = model.transformer.h[0].mlp.c_fc.output.save()
        with model.output.logits.sum().backward():
            pass
    torch.testing.assert_close(a, seen["a"], atol=ATOL, rtol=0)
    assert_param_grads(model.module, expected)


def test_reentrant_edit_raises_naming_checkpointing(backward_mode):
    net = _net(reentrant=True)
    model = distgrad.wrap(net)
    before = hook_count(net)
    with pytest.raises(
        NotImplementedError,
        match=r"h\[0\]\.mlp\.c_fc\.output was edited inside "
        r"a block under gradient checkpointing with use_reentrant=True.*"
        r"'use_reentrant': False",
    ):
        with model.trace(IDS):
            model.transformer.h[0].mlp.c_fc.output = model.transformer.h[0].mlp.c_fc.output * 0.5
            with model.output.logits.sum().backward():
                pass
    assert hook_count(net) == before
    assert all(p.grad is None for p in net.parameters())


def test_reentrant_grad_raises_naming_checkpointing(backward_mode):
    model = distgrad.wrap(_net(reentrant=True))
    with pytest.raises(
        ValueError,
        match=r"c_fc\.output\.grad: no gradient flows into it, because "
        r"it was computed inside a block under gradient checkpointing with "
        r"use_reentrant=True.*'use_reentrant': False",
    ):
        with model.trace(IDS):
            a = model.transformer.h[0].mlp.c_fc.output
            with model.output.logits.sum().backward():
                a.grad.save()


class _Block(torch.nn.Module):
    """One checkpointed block that calls ``shared`` twice; ``between``: a saving op between."""

    def __init__(self, between: bool, checkpointed: bool = True):
        super().__init__()
        self.checkpointed = checkpointed
        torch.manual_seed(3)
        self.inner = torch.nn.Linear(4, 4)
        self.shared = torch.nn.Linear(4, 4) if between else _Half()
        self.between = between
        self.head = torch.nn.Linear(4, 1)

    def body(self, x):
        x = self.shared(self.inner(x))
        if self.between:
            x = torch.tanh(x)
        return torch.tanh(self.shared(x))  # (tanh saves its output: the recompute gets here)

    def forward(self, x):
        if not self.checkpointed:
            return self.head(self.body(x))
        return self.head(checkpoint(self.body, x, use_reentrant=False))


class _Half(torch.nn.Module):
    def forward(self, x):
        return x * 0.5  # saves nothing for the backward


def test_second_call_of_a_module_in_a_block(backward_mode):
    x = torch.randn(3, 4)
    plain, calls = _Block(between=True, checkpointed=False), []

    def edit_second(m, a, out):
        calls.append(1)
        return out * 2 if len(calls) == 2 else None

    plain.shared.register_forward_hook(edit_second)
    plain(x).sum().backward()
    expected = param_grads(plain)
    net = _Block(between=True)
    model = distgrad.wrap(net)
    with model.trace(x):
        first = model.shared.call(0).output
        model.shared.call(1).output = model.shared.call(1).output * 2
        with model.output.sum().backward():
            pass
    assert first is not None
    assert_param_grads(net, expected)


def test_module_called_twice_at_one_place_raises(backward_mode):
    net = _Block(between=False)
    model = distgrad.wrap(net)
    with pytest.raises(
        NotImplementedError,
        match=r"model\.shared\.output was edited inside a "
        r"block under gradient checkpointing.*more than once",
    ):
        with model.trace(torch.randn(3, 4)):
            model.shared.call(0).output
            model.shared.call(1).output = model.shared.call(1).output * 2
            with model.output.sum().backward():
                pass
