"""Invokes: one batch, each body sees and edits only its own rows, forward and backward."""

import pytest
import torch
from conftest import ATOL, prompts

import distgrad

# every body mode (conftest.backward_mode), also for the tests that read or edit forward only
pytestmark = pytest.mark.usefixtures("backward_mode")

TEXTS = ["Hello world", "Paris is", "Rome isnt"]


def _batch_reference(net, tokenizer, edit_rows=None, grad_edit_rows=None):
    enc = prompts(tokenizer, TEXTS)
    seen = {}

    def on_output(mod, args, out):
        if edit_rows is not None:
            out = out.clone()
            out[edit_rows] = 0
        seen["out"] = out

        def on_grad(g):
            seen["grad"] = g.clone()
            if grad_edit_rows is not None:
                g = g.clone()
                g[grad_edit_rows] *= 10
                return g
            return None

        out.register_hook(on_grad)
        return out

    net.zero_grad(set_to_none=True)
    h = net.transformer.h[0].register_forward_hook(on_output)
    out = net(**enc)
    h.remove()
    out.logits.sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return seen["out"].detach(), out.logits.detach(), seen["grad"], grads


def test_each_invoke_sees_its_rows_and_edits_only_them(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[0].output.save()
            model.transformer.h[0].output[:] = 0
            la = model.output.logits.save()
        with tr.invoke(TEXTS[1:]):
            b = model.transformer.h[0].output.save()
            lb = model.output.logits.save()
    _, ref_plain, _, _ = _batch_reference(gpt2, tokenizer)
    ref_out, ref_edit, _, _ = _batch_reference(gpt2, tokenizer, edit_rows=slice(0, 1))
    assert a.shape[0] == 1 and b.shape[0] == 2
    torch.testing.assert_close(b, ref_out[1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(la, ref_edit[:1], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_plain[1:], atol=ATOL, rtol=0)  # untouched by invoke 0


def test_invoke_backward_rows_and_edit(gpt2, tokenizer, backward_mode):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                ga = a.grad.save()
                a.grad = a.grad * 10
        with tr.invoke(TEXTS[1:]):
            b = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                gb = b.grad.save()
    got = {n: p.grad.clone() for n, p in gpt2.named_parameters()}
    _, _, ref_grad, ref = _batch_reference(gpt2, tokenizer, grad_edit_rows=slice(0, 1))
    torch.testing.assert_close(ga, ref_grad[:1], atol=ATOL, rtol=0)
    torch.testing.assert_close(gb, ref_grad[1:], atol=ATOL, rtol=0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0)


def test_unsaved_invoke_names_explain_themselves(mlp):
    x = torch.randn(2, 8)

    def traced():
        with distgrad.wrap(mlp).trace() as tr:
            with tr.invoke(x):
                kept = mlp_out = distgrad.save(tr.model[2].output)
                dropped = tr.model[4].output
        return kept, dropped, mlp_out

    kept, dropped, alias = traced()
    assert kept.shape == (2, 16) and alias is kept
    with torch.no_grad():  # the saved value is the plain one (handed over unchanged)
        torch.testing.assert_close(kept, mlp[:3](x), atol=ATOL, rtol=0)
    with pytest.raises(distgrad.NotSavedError, match="'dropped' was bound inside"):
        print(dropped)
    with pytest.raises(NameError):
        dropped + 1


def test_invoke_tensor_inputs_match_separate_runs(mlp):
    x1, x2 = torch.randn(2, 8), torch.randn(3, 8)
    model = distgrad.wrap(mlp)
    with model.trace() as tr:
        with tr.invoke(x1):
            o1 = model.output.save()
        with tr.invoke(x2):
            o2 = model.output.save()
    with torch.no_grad():
        torch.testing.assert_close(o1, mlp(x1), atol=ATOL, rtol=0)
        torch.testing.assert_close(o2, mlp(x2), atol=ATOL, rtol=0)


def test_invoke_misuse(mlp):
    model = distgrad.wrap(mlp)
    with pytest.raises(distgrad.TraceStateError, match="inside the `with tracer.invoke"):
        with model.trace() as tr:
            with tr.invoke(torch.randn(2, 8)):
                pass
            model.output
    with pytest.raises(ValueError, match="pad them"):
        with model.trace() as tr:
            with tr.invoke(torch.randn(2, 8)):
                pass
            with tr.invoke(torch.randn(2, 5)):
                pass


def test_error_in_an_invoke_body_points_at_the_users_line(mlp):
    model = distgrad.wrap(mlp)
    with pytest.raises(ZeroDivisionError) as info:
        with model.trace() as tr:
            with tr.invoke(torch.randn(2, 8)):
                model[0].output
                1 / 0  # the line the traceback must show
    assert any(
        entry.statement.lines and "1 / 0" in str(entry.statement) for entry in info.traceback
    )


def test_a_debuggers_trace_function_keeps_running_after_an_invoke(mlp):
    # Invoke bodies are skipped in place by raising from a line trace, and CPython switches a
    # thread's tracing off when a trace function raises: pdb's breakpoints and coverage would
    # stop at the first invoke. The trace function installed before must be back, and see lines.
    import sys

    model = distgrad.wrap(mlp)
    here = sys._getframe().f_code
    lines = []

    def local(frame, event, arg):
        if event == "line":
            lines.append(frame.f_lineno)
        return local

    def debugger(frame, event, arg):
        return local if frame.f_code is here else None

    before = sys.gettrace()
    sys.settrace(debugger)
    sys._getframe().f_trace = local  # as pdb's set_trace does for the frames already running
    try:
        x = torch.randn(2, 8)
        with model.trace() as tr:
            with tr.invoke(x):
                out = model.output.save()
        still_on = sys.gettrace()
        marker = sys._getframe().f_lineno  # a line the debugger must see
    finally:
        sys.settrace(before)
    assert still_on is debugger
    assert marker in lines
    with torch.no_grad():
        torch.testing.assert_close(out, mlp(x), atol=ATOL, rtol=0)


def _retained_reference(net, tokenizer):
    """Plain autograd: retain_grad() on the whole batch's h[-1] output, logits.sum() backward."""
    enc = prompts(tokenizer, TEXTS)
    seen = {}

    def on_output(mod, args, out):
        out.retain_grad()
        seen["out"] = out

    net.zero_grad(set_to_none=True)
    handle = net.transformer.h[-1].register_forward_hook(on_output)
    try:
        net(**enc).logits.sum().backward()
    finally:
        handle.remove()
    net.zero_grad(set_to_none=True)
    return seen["out"].grad


def test_retain_grad_in_an_invoke_gives_its_rows(gpt2, tokenizer, backward_mode):
    # The body's value is a slice of the batch's tensor, off the path the gradient takes: its
    # retained .grad must still be its rows of the batch's gradient.
    expected = _retained_reference(gpt2, tokenizer)
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[-1].output
            a.retain_grad()
            a = a.save()
            with model.output.logits.sum().backward():
                pass
        with tr.invoke(TEXTS[1:]):
            b = model.transformer.h[-1].output
            b.retain_grad()
            b = b.save()
            with (model.output.logits.sum() + b.sum()).backward():  # b itself on the path too
                pass
    torch.testing.assert_close(a.grad, expected[:1], atol=ATOL, rtol=0)
    torch.testing.assert_close(b.grad, expected[1:] + 1, atol=ATOL, rtol=0)


def test_retain_grad_in_an_invoke_then_backward_after_the_trace(gpt2, tokenizer):
    expected = _retained_reference(gpt2, tokenizer)
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[-1].output
            a.retain_grad()
            a, la = a.save(), model.output.logits.sum().save()
        with tr.invoke(TEXTS[1:]):
            lb = model.output.logits.sum().save()
    (la + lb).backward(retain_graph=True)
    torch.testing.assert_close(a.grad, expected[:1], atol=ATOL, rtol=0)
    (la + lb).backward()  # accumulates, as retain_grad() does
    torch.testing.assert_close(a.grad, 2 * expected[:1], atol=ATOL, rtol=0)


def test_retain_graph_on_some_blocks_only(gpt2, tokenizer):
    """retain_graph=True on every block but the last (how nnsight's users write it): one
    backward over the batch, the graph kept, each body its rows of the batch's gradient."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[0].output
            with model.output.logits.sum().backward(retain_graph=True):
                ga = a.grad.save()
        with tr.invoke(TEXTS[1:]):
            b = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                gb = b.grad.save()
    _, _, ref_grad, _ = _batch_reference(gpt2, tokenizer)
    torch.testing.assert_close(ga, ref_grad[:1], atol=ATOL, rtol=0)
    torch.testing.assert_close(gb, ref_grad[1:], atol=ATOL, rtol=0)
    # other arguments still have to agree
    with pytest.raises(distgrad.TraceStateError, match="different keyword arguments"):
        with model.trace() as tr:
            with tr.invoke(TEXTS[0]):
                with model.output.logits.sum().backward(inputs=[gpt2.lm_head.weight]):
                    pass
            with tr.invoke(TEXTS[1:]):
                with model.output.logits.sum().backward():
                    pass


def _rounds_reference(net, tokenizer):
    """Plain autograd over the batch's one graph: invoke 0's two losses and invoke 1's one,
    each its own backward (retain_graph=True), invoke 0's first gradient at h[0] times 10."""
    enc = prompts(tokenizer, TEXTS)
    seen = {}
    handles = [
        net.transformer.h[i].register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, out)
        )
        for i in (0, 1)
    ]
    net.zero_grad(set_to_none=True)
    try:
        logits = net(**enc).logits
    finally:
        for handle in handles:
            handle.remove()
    h0, h1 = seen[0], seen[1]
    grads = {}

    def backward(loss, name, hooked, edit=None):
        def on_grad(g, key):
            grads[key] = g.clone()
            return edit(g) if edit is not None and key == (name, 0) else None

        handles = [t.register_hook(lambda g, k=(name, i): on_grad(g, k)) for i, t in hooked]
        loss.backward(retain_graph=True)
        for handle in handles:
            handle.remove()

    backward(logits[:1].sum(), "a1", [(0, h0)], edit=lambda g: g * 10)
    backward(logits[1:].sum(), "b1", [(0, h0)])
    backward(logits[:1, -1].pow(2).mean(), "a2", [(1, h1), (0, h0)])
    params = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return grads, params


def test_two_backward_blocks_in_an_invoke(gpt2, tokenizer):
    # Invoke 0 opens two blocks, invoke 1 one (without retain_graph): the first round of blocks
    # runs one backward over both losses, the second a backward over invoke 0's second loss.
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[0].output
            c = model.transformer.h[1].output
            logits = model.output.logits
            with logits.sum().backward(retain_graph=True):
                ga1 = a.grad.save()
                a.grad = a.grad * 10  # reaches the parameters in the first backward only
            with logits[:, -1].pow(2).mean().backward():
                gc2 = c.grad.save()
                ga2 = a.grad.save()
        with tr.invoke(TEXTS[1:]):
            b = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                gb1 = b.grad.save()
    got = {n: p.grad.clone() for n, p in gpt2.named_parameters()}
    ref, ref_params = _rounds_reference(gpt2, tokenizer)
    torch.testing.assert_close(ga1, ref["a1", 0][:1], atol=ATOL, rtol=0)
    torch.testing.assert_close(gb1, ref["b1", 0][1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(gc2, ref["a2", 1][:1], atol=ATOL, rtol=0)
    torch.testing.assert_close(ga2, ref["a2", 0][:1], atol=ATOL, rtol=0)
    # rtol 1e-6: the oracle accumulates invoke 1's loss in a backward of its own, so the tied
    # embedding's gradient (entries near 500) sums in another order and differs in the last bit
    for n in ref_params:
        torch.testing.assert_close(got[n], ref_params[n], atol=1e-5, rtol=1e-6, msg=n)


def test_second_block_without_retained_graph_raises_torchs_error(mlp):
    # As in a trace without invokes: the first backward freed the graph the second needs.
    model = distgrad.wrap(mlp)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        with model.trace() as tr:
            with tr.invoke(torch.randn(2, 8)):
                out = model.output
                with out.sum().backward():
                    pass
                with out.sum().backward():
                    pass


def test_blocks_of_one_round_must_agree_on_arguments(mlp):
    model = distgrad.wrap(mlp)
    with pytest.raises(distgrad.TraceStateError, match="invoke 0 and invoke 1 pass different"):
        with model.trace() as tr:
            with tr.invoke(torch.randn(2, 8)):
                with model.output.sum().backward():
                    pass
            with tr.invoke(torch.randn(2, 8)):
                with model.output.sum().backward(create_graph=True):
                    pass


def test_invokes_blocks_with_gradient_arguments(mlp, backward_mode):
    """Blocks given ``gradient=`` (positionally or by keyword), several in one round, and a
    second round of one: each body's gradient at the hidden layer and the parameter gradients
    are plain autograd's, the backward running through the engine's as every block's does."""
    x1, x2 = (
        torch.randn(2, 8, generator=torch.Generator().manual_seed(0)),
        torch.randn(3, 8, generator=torch.Generator().manual_seed(1)),
    )
    g1, g2, g3 = torch.randn(2, 4), torch.randn(3, 4), torch.randn(2, 4)
    model = distgrad.wrap(mlp)
    with model.trace() as tr:
        with tr.invoke(x1):
            h = model[1].output
            out = model.output
            with out.backward(g1, retain_graph=True):
                a1 = h.grad.save()
            with out.backward(gradient=g3):
                a2 = h.grad.save()
        with tr.invoke(x2):
            k = model[1].output
            with model.output.backward(gradient=g2):
                b1 = k.grad.save()
    got = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad(set_to_none=True)
    hidden = mlp[1](mlp[0](torch.cat([x1, x2])))
    out = mlp[4](mlp[3](mlp[2](hidden)))
    first = torch.autograd.grad(out, hidden, torch.cat([g1, g2]), retain_graph=True)[0]
    second = torch.autograd.grad(out[:2], hidden, g3, retain_graph=True)[0]
    torch.testing.assert_close(a1, first[:2], atol=ATOL, rtol=0)
    torch.testing.assert_close(b1, first[2:], atol=ATOL, rtol=0)
    torch.testing.assert_close(a2, second[:2], atol=ATOL, rtol=0)
    torch.autograd.backward([out, out[:2]], [torch.cat([g1, g2]), g3])
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=0, msg=name)
