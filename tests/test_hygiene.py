"""Nothing is left behind: hooks, the .grad property, threads, greenlets - after success, after
errors, and over many traces; and traces work inside functions, loops and classes."""

import gc
import threading
import traceback

import pytest
import torch
from conftest import ATOL, PARAM_ATOL, TEXT, assert_param_grads, hook_count, reference

import distgrad
from distgrad import patches
from distgrad.interleave.session import BODIES


def _clean(net):
    assert hook_count(net) == 0
    assert patches.installed("grad")  # the one class attribute, added at import
    assert not BODIES


def _step(model, x, edit=True):
    with model.trace(x):
        model[2].input  # a pre-hook point (with kwargs) too
        h = model[2].output
        out = model.output
        with out.sum().backward():
            g = h.grad.save()
            if edit:
                h.grad = h.grad * 2
    assert not h._backward_hooks  # the gradient point's tensor-hook entry is gone
    return g


def _plain_step(net, x):
    """_step with plain autograd: the gradient reaching net[2]'s output, the parameter
    gradients when it is doubled (_step's edit), and those of a plain backward (no edit)."""
    _, grad, plain = reference(net, x, net[2])
    _, _, doubled = reference(net, x, net[2], edit=lambda g: g * 2)
    return grad, doubled, plain


def _assert_step_matches(net, g, expected_grad, expected_params):
    """fp32: atol 1e-6 for the gradient handed over unchanged, 1e-5 for parameter gradients."""
    torch.testing.assert_close(g, expected_grad, atol=ATOL, rtol=0)
    assert_param_grads(net, expected_params, atol=PARAM_ATOL)
    net.zero_grad(set_to_none=True)


@pytest.mark.usefixtures("backward_mode")
def test_thousand_traces_leave_no_hooks_or_threads(mlp):
    model = distgrad.wrap(mlp)
    x = torch.randn(4, 8)
    expected_grad, expected_params, plain = _plain_step(mlp, x)
    _assert_step_matches(mlp, _step(model, x), expected_grad, expected_params)
    gc.collect()
    threads = threading.active_count()
    for _ in range(999):
        _step(model, x)
    mlp.zero_grad(set_to_none=True)
    # the thousandth gives the numbers of the first
    _assert_step_matches(mlp, _step(model, x), expected_grad, expected_params)
    gc.collect()
    _clean(mlp)
    assert threading.active_count() == threads
    # a hook left behind would fire again in a later plain backward: it gives plain numbers
    out = mlp(x).sum()
    out.backward()
    assert_param_grads(mlp, plain, atol=PARAM_ATOL)


def test_thread_mode_reuses_one_worker(mlp, monkeypatch):
    """A backward block in thread mode runs on a kept worker thread, not a new thread each time
    (a fresh thread's first backward cost ~8 ms here)."""
    monkeypatch.setattr(distgrad.config, "backward_mode", "thread")
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    seen = set()  # Thread objects (kept alive here, so a new thread cannot pass as an old one)
    for _ in range(20):
        with model.trace(x):
            h = model[2].output
            with model.output.sum().backward():
                h.grad = h.grad * 2
                seen.add(_worker_thread())
    assert len(seen) == 1 and threading.current_thread() not in seen
    assert next(iter(seen)).is_alive()  # idle, waiting for the next block


def _worker_thread():
    from distgrad.interleave.session import current_body

    return current_body().block.session.transport.worker.thread


@pytest.mark.usefixtures("backward_mode")
@pytest.mark.parametrize("where", ["forward", "backward", "model"])
def test_errors_leave_nothing_behind(mlp, where):
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    expected_grad, expected_params, _ = _plain_step(mlp, x)
    _step(model, x)  # thread mode keeps one idle worker for reuse: count it in the baseline
    mlp.zero_grad(set_to_none=True)
    threads = threading.active_count()

    class Boom(Exception):
        pass

    def bad_forward(module, args, out):
        raise Boom("from the model")

    handle = mlp[4].register_forward_hook(bad_forward) if where == "model" else None
    try:
        with pytest.raises(Boom) as info:
            with model.trace(x):
                h = model[2].output
                if where == "forward":
                    raise Boom("in the body")  # the user's line
                out = model.output
                with out.sum().backward():
                    h.grad
                    raise Boom("in the block")
    finally:
        if handle is not None:
            handle.remove()
    if where != "model":
        assert any("raise Boom" in str(entry.statement) for entry in info.traceback)
    _clean(mlp)
    assert threading.active_count() == threads
    # and the model still works normally: the numbers of plain autograd
    mlp.zero_grad(set_to_none=True)  # (the failed backward may have accumulated some)
    g = _step(model, x)
    assert g.shape == (2, 16)
    _assert_step_matches(mlp, g, expected_grad, expected_params)
    _clean(mlp)


class Probe:
    """distgrad used from a class, in a loop, with the body in a method."""

    def __init__(self, net):
        self.model = distgrad.wrap(net)

    def grads(self, xs):
        found = []
        for x in xs:
            with self.model.trace(x):
                h = self.model[0].output
                with self.model.output.sum().backward():
                    found.append(h.grad.save())
        return found


def test_functions_loops_and_classes(mlp):
    xs = [torch.randn(2, 8) for _ in range(3)]
    got = Probe(mlp).grads(xs)
    for x, g in zip(xs, got):
        h = mlp[0](x)
        (ref,) = torch.autograd.grad(mlp[1:](h).sum(), h)
        torch.testing.assert_close(g, ref, atol=ATOL, rtol=0)


def test_untouched_trace_adds_no_hooks(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    seen = []
    with model.trace(TEXT):
        seen.append(hook_count(gpt2))
    assert seen == [0]
    with model.trace(TEXT):
        model.transformer.h[0].output
        # the requested module plus the modules enclosing it (see ForwardRequests._new_point)
        seen.append(hook_count(gpt2))
    assert seen[1] == 3
    _clean(gpt2)


def test_grad_outside_bodies_is_plain_pytorch():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    with pytest.warns(UserWarning, match="not a leaf"):
        assert y.grad is None
    x.grad = torch.zeros(3)
    assert torch.equal(x.grad, torch.zeros(3))
    del x.grad
    assert x.grad is None
    with pytest.raises(RuntimeError):
        x.grad = torch.zeros(4)  # PyTorch's own check, unchanged


def _greenlets() -> int:
    import greenlet

    gc.collect()
    return sum(type(o) is greenlet.greenlet for o in gc.get_objects())  # (isinstance would
    # touch deprecated module attributes among the objects and warn)


def test_invoke_bodies_reuse_runner_greenlets(mlp):
    """Invoke bodies run on the thread's pooled runner greenlets: over many traces, and when one
    invoke raises while another waits mid-body, none is leaked and the pool does not grow."""
    import greenlet

    from distgrad.interleave import transports

    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    seen = set()  # greenlets that ran a body (kept alive, so an id cannot be reused)

    def step(fail: bool):
        with model.trace() as tr:
            with tr.invoke(x):
                seen.add(greenlet.getcurrent())
                a = model[2].output.save()
            with tr.invoke(x):
                model[0].output
                if fail:
                    raise KeyError("in the second invoke")
                b = model[2].output.save()
        return a, b

    step(False)
    pool, greenlets = len(transports._idle.runners), _greenlets()
    for i in range(200):
        if i % 2:
            with pytest.raises(KeyError, match="in the second invoke"):
                step(True)
        else:
            a, b = step(False)
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert len(seen) <= 2  # a new greenlet per body would make 201
    assert len(transports._idle.runners) == pool
    seen.clear()
    assert _greenlets() == greenlets
    _clean(mlp)


def _users_body(model, x, where, tr_out):
    """A body that raises ValueError in the forward or in a backward block."""
    with model.trace(x) as tr:
        tr_out.append(tr)
        h = model[2].output
        if where == "forward":
            raise ValueError("the user's own")
        with model.output.sum().backward():
            h.grad
            raise ValueError("the user's own")


def _assert_shown_as_raised(exc, context_type):
    """What Python shows is the user's exception with the user's own context (or none): the
    exception distgrad raises to skip a body (SkipBody) is no part of it."""
    assert type(exc.__context__) is context_type, repr(exc.__context__)
    if context_type is not type(None):
        assert exc.__context__.__context__ is None, repr(exc.__context__.__context__)
    shown = "".join(traceback.format_exception(exc))
    assert "SkipBody" not in shown, shown
    if context_type is type(None):
        assert "During handling" not in shown, shown


@pytest.mark.usefixtures("backward_mode")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_the_users_error_keeps_the_users_context(mlp, backward_mode, where):
    model = distgrad.wrap(mlp)
    x = torch.randn(2, 8)
    traces = []
    with pytest.raises(ValueError, match="the user's own") as info:
        _users_body(model, x, where, traces)
    assert traces[0].mode == "in place"
    _assert_shown_as_raised(info.value, type(None))

    # raised while the user handles an exception of their own, outside the trace: that one is
    # the context, as in plain Python
    traces.clear()
    with pytest.raises(ValueError, match="the user's own") as info:
        try:
            raise KeyError("the user's first")
        except KeyError:
            _users_body(model, x, where, traces)
    assert traces[0].mode == "in place"
    _assert_shown_as_raised(info.value, KeyError)
    _clean(mlp)
