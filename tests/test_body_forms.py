"""Trace bodies in the forms users write them: loops and comprehensions of reads, augmented
and slice assignments to ``.grad``, reads inside helper functions and objects, ``global`` and
``del``, names bound before an error, a debugger's trace function, a library's own tensor hooks.

Each test compares the numbers with plain autograd (retain_grad / tensor hooks) on the same
model and input, fp32, atol 1e-6 for values handed over unchanged, 1e-5 for parameter
gradients; the ``backward_mode`` tests run with the backward in a greenlet and in a worker
thread (the CUDA path).
"""

import sys

import pytest
import torch
from conftest import ATOL, PARAM_ATOL, assert_param_grads, hook_count, param_grads

import distgrad
from distgrad.interleave.session import BODIES


def _oracle(mlp, x, layers, scale=2.0):
    """Plain autograd: the gradient into each of ``layers``' outputs (read last to first, each
    scaled by ``scale`` before it flows on) and the parameter gradients that result."""
    seen = {}
    handles = []
    for i in layers:

        def on_output(module, args, out, i=i):
            def on_grad(g):
                seen[i] = g.clone()
                return g * scale

            out.register_hook(on_grad)

        handles.append(mlp[i].register_forward_hook(on_output))
    try:
        mlp(x).sum().backward()
    finally:
        for h in handles:
            h.remove()
    grads = param_grads(mlp)
    mlp.zero_grad(set_to_none=True)
    return seen, grads


def test_a_loop_of_reads_and_edits_matches_autograd(mlp, backward_mode):
    """marginal.py's body: a comprehension of reads (run as a loop) and edits in reverse."""
    model = distgrad.wrap(mlp)
    x = torch.randn(3, 8)
    expected, expected_params = _oracle(mlp, x, [0, 2, 4])
    i = "kept"  # the comprehension's own i must not leak into this name
    gs = []
    with model.trace(x) as tr:
        acts = [model[i].output for i in (0, 2, 4)]
        loss = model.output.sum()
        with loss.backward():
            for a in reversed(acts):
                gs.append(a.grad.save())
                a.grad = a.grad * 2
    assert tr.mode == "in place"
    assert i == "kept"
    for layer, g in zip((0, 2, 4), gs[::-1]):
        torch.testing.assert_close(g, expected[layer], atol=ATOL, rtol=0)
    assert_param_grads(mlp, expected_params, atol=PARAM_ATOL)
    assert hook_count(mlp) == 0 and not BODIES


def test_in_place_augmented_and_input_edits(mlp, backward_mode):
    """``t.grad[:] = ...``, ``t.grad *= ...`` and ``m.input = ...``: each store first waits for
    the run to reach its value."""
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    with model.trace(x) as tr:
        model[2].input = model[2].input * 0.5
        h2 = model[2].output
        h4 = model[4].output
        with model.output.sum().backward():
            h4.grad *= 3
            h2.grad[:] = 1.0
    assert tr.mode == "in place"
    got = param_grads(mlp)
    mlp.zero_grad(set_to_none=True)

    def halve(module, args):
        return (args[0] * 0.5,)

    handle = mlp[2].register_forward_pre_hook(halve)
    try:
        h = mlp[:3](x)
        h.register_hook(lambda g: torch.ones_like(g))
        out = mlp[3:](h)
        out.register_hook(lambda g: g * 3)
        out.sum().backward()
    finally:
        handle.remove()
    for name, g in param_grads(mlp).items():
        torch.testing.assert_close(got[name], g, atol=PARAM_ATOL, rtol=0, msg=name)


def _read_output(envoy):
    return envoy.output


def test_a_body_that_calls_a_helper(mlp):
    """A user function may read values itself."""
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    with model.trace(x) as tr:
        h = _read_output(model[2])
        with model.output.sum().backward():
            g = h.grad.save()
    assert tr.mode == "in place"
    expected, _ = _oracle(mlp, x, [2], scale=1.0)
    torch.testing.assert_close(g, expected[2], atol=ATOL, rtol=0)


class _Looks:
    """An object whose method has a tensor method's name but reads a value itself."""

    def __init__(self, envoy):
        self.envoy = envoy

    def sum(self):
        return self.envoy.output * 1


def test_a_read_inside_an_object_of_the_users(mlp):
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    looks = _Looks(model[4])
    with model.trace(x) as tr:
        h = model[2].output
        total = looks.sum().save()
    assert tr.mode == "in place"
    torch.testing.assert_close(total, mlp(x), atol=ATOL, rtol=0)
    torch.testing.assert_close(h, mlp[:3](x), atol=ATOL, rtol=0)
    assert hook_count(mlp) == 0 and not BODIES


def test_names_come_back_and_errors_show_the_users_line(mlp):
    """Every name the body binds is there afterwards (saved or not), also after an error in a
    hook, and the error's traceback holds the body's own line."""
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    count = 0
    with model.trace(x) as tr:
        h = model[2].output
        count += 1
        with model.output.sum().backward():
            g = h.grad
    assert tr.mode == "in place"
    assert count == 1 and g.shape == (2, 16) and h.shape == (2, 16)
    with pytest.raises(ZeroDivisionError) as info:
        with model.trace(x):
            before = model[0].output
            after = model[2].output
            1 / 0  # the line the traceback must show
    assert before.shape == (2, 16) and after.shape == (2, 16)
    assert any("1 / 0" in str(entry.statement) for entry in info.traceback)
    assert hook_count(mlp) == 0 and not BODIES


def test_a_debugger_keeps_tracing_across_a_trace(mlp):
    """A debugger's or coverage's trace function sees the lines after the trace."""
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    lines = []

    def tracer(frame, event, arg):
        if frame.f_code is test_a_debugger_keeps_tracing_across_a_trace.__code__:
            lines.append(frame.f_lineno)
        return tracer

    sys.settrace(tracer)
    sys._getframe().f_trace = tracer  # as pdb does for the frame it stops in
    try:
        with model.trace(x) as tr:
            h = model[2].output.save()
        after = sys._getframe().f_lineno + 1
        marker = True  # noqa: F841 (a line the tracer must see)
    finally:
        sys.settrace(None)
    assert tr.mode == "in place"
    assert after in lines


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_library_tensor_hooks_see_plain_grad(mlp, backward_mode):
    """A library's tensor hook on the very tensor the body edits, firing in the same backward,
    gets PyTorch's own ``.grad`` (None for a non-leaf), not the body's view: while the run is
    on the stack the body is not registered. The gradient it is handed and the parameter
    gradients are those of plain autograd with the same two hooks (the library's registered
    first, then the edit)."""
    x = torch.randn(2, 8)
    seen, handed = [], []

    def library_forward_hook(module, args, out):
        def library_tensor_hook(grad):
            seen.append(out.grad)
            handed.append(grad.clone())

        out.register_hook(library_tensor_hook)

    handle = mlp[2].register_forward_hook(library_forward_hook)
    try:
        h = mlp[:3](x)
        h.register_hook(lambda g: g * 2)
        mlp[3:](h).sum().backward()
        expected_params = param_grads(mlp)
        mlp.zero_grad(set_to_none=True)
        expected_handed, seen[:], handed[:] = handed[0], [], []
        model = distgrad.wrap(mlp)
        with model.trace(x) as tr:
            h = model[2].output
            with model.output.sum().backward():
                h.grad = h.grad * 2
    finally:
        handle.remove()
    assert tr.mode == "in place"
    assert seen == [None]
    torch.testing.assert_close(handed[0], expected_handed, atol=ATOL, rtol=0)
    assert_param_grads(mlp, expected_params, atol=PARAM_ATOL)


def test_a_gradient_waited_for_in_vain_leaves_no_hook(mlp):
    """A gradient asked for after it passed (forward order) never fires its hook: the
    OutOfOrderError reaches the body, the body goes on, and no hook is left behind."""
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    expected, _ = _oracle(mlp, x, [1], scale=1.0)
    with model.trace(x) as tr:
        a = model[1].output
        b = model[3].output
        with model.output.sum().backward():
            ga = a.grad.save()  # b's gradient flows past meanwhile
            try:
                b.grad
                late = "no error"
            except distgrad.OutOfOrderError as exc:
                late = str(exc)
    assert tr.mode == "in place"
    assert "model[3].output" in late, late
    torch.testing.assert_close(ga, expected[1], atol=ATOL, rtol=0)
    assert not a._backward_hooks and not b._backward_hooks
    assert hook_count(mlp) == 0 and not BODIES


_COUNTER = 0


def test_global_and_del_in_a_body(mlp):
    """A name the function declares global, and `del`: both mean what they mean in place."""
    global _COUNTER
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    with model.trace(x) as tr:
        h = model[2].output
        _COUNTER = _COUNTER + 1
    assert tr.mode == "in place" and _COUNTER == 1
    scratch = 1
    with model.trace(x) as tr:
        h = model[2].output
        del scratch
    assert tr.mode == "in place" and "scratch" not in locals()
