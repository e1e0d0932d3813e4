"""What an invoke body's names are, and ``retain_grad()`` with a plain ``.backward()`` there.

An invoke body runs later than it is written. A name it only reads has the value it had when
the body's ``tracer.invoke(...)`` was entered (a loop variable: that step's); a name some body
binds is one value for all bodies, and the last binding reaches the caller. Values are checked
against the plain MLP on the same weights, fp32, atol 1e-6 (1e-5 for parameter gradients).
"""

import gc
import runpy
import weakref

import pytest
import torch
from conftest import ATOL, PARAM_ATOL, param_grads, reference

import distgrad

pytestmark = pytest.mark.usefixtures("backward_mode")


def _xs(n=3, rows=2):
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(rows, 8, generator=gen) for _ in range(n)]


def test_loop_variables_have_their_step_value(mlp):
    model = distgrad.wrap(mlp)
    xs = _xs()
    got, seen = [], []
    with model.trace() as tr:
        for i, x in enumerate(xs):
            scale = float(i + 1)
            with tr.invoke(x):
                seen.append((i, x.shape[0]))
                got.append((model[0].output * scale).save())
    assert seen == [(0, 2), (1, 2), (2, 2)]
    for i, x in enumerate(xs):
        torch.testing.assert_close(got[i], mlp[0](x) * (i + 1), atol=ATOL, rtol=0)
    assert i == 2 and x is xs[2] and scale == 3.0  # only read by the bodies: as the loop left them


def test_names_bound_by_bodies_are_shared(mlp):
    """Body 0 saves its first layer's output; body 1 (a later loop step) puts it in its own
    rows. Body 1 reads ``h`` after asking for the value, when body 0 has been served there."""
    model = distgrad.wrap(mlp)
    xs = _xs(2)
    outs = []
    with model.trace() as tr:
        for i, x in enumerate(xs):
            with tr.invoke(x):
                if i == 0:
                    h = model[0].output.save()
                else:
                    mine = model[0].output.save()
                    model[0].output = h
                outs.append(model.output.save())
    torch.testing.assert_close(h, mlp[0](xs[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(mine, mlp[0](xs[1]), atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[0], mlp(xs[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[1], mlp[1:](mlp[0](xs[0])), atol=ATOL, rtol=0)


def test_last_binding_reaches_the_caller(mlp):
    model = distgrad.wrap(mlp)
    xs = _xs(2)
    last = "before"
    with model.trace() as tr:
        for x in xs:
            with tr.invoke(x):
                last = model[0].output.save()
                unsaved = model[2].output
    torch.testing.assert_close(last, mlp[0](xs[1]), atol=ATOL, rtol=0)
    with pytest.raises(distgrad.NotSavedError):
        unsaved.sum()


def test_loop_at_module_scope(mlp, tmp_path):
    """A notebook's or script's loop: the frame's names are its module globals."""
    script = tmp_path / "loop_script.py"
    script.write_text(
        "got = []\n"
        "with model.trace() as tr:\n"
        "    for i, x in enumerate(xs):\n"
        "        with tr.invoke(x):\n"
        "            got.append((model[0].output * (i + 1)).save())\n"
        "            first = model[0].output.save()\n"
    )
    xs = _xs()
    names = runpy.run_path(str(script), {"model": distgrad.wrap(mlp), "xs": xs})
    for i, x in enumerate(xs):
        torch.testing.assert_close(names["got"][i], mlp[0](x) * (i + 1), atol=ATOL, rtol=0)
    torch.testing.assert_close(names["first"], mlp[0](xs[2]), atol=ATOL, rtol=0)
    assert names["i"] == 2


@pytest.mark.parametrize("fails", [False, True])
def test_names_at_enter_are_not_kept(mlp, fails):
    """The copy of the caller's names each invoke takes keeps nothing alive after the trace,
    also when the block fails between invokes and the tracer outlives it."""
    model = distgrad.wrap(mlp)
    xs = _xs(2)
    big = torch.randn(1000)
    kept = weakref.ref(big)
    gc.disable()
    try:
        try:
            with model.trace() as tr:
                with tr.invoke(xs[0]):
                    model[0].output.save()
                if fails:
                    raise KeyError("the user's own error")
                with tr.invoke(xs[1]):
                    model[0].output.save()
        except KeyError:
            pass
        del big
        assert kept() is None
        assert tr is not None
    finally:
        gc.enable()


def _fc_grads(mlp, x):
    """Plain autograd: the gradient reaching the first layer's output for ``mlp(x).sum()``,
    and the parameter gradients."""
    return reference(mlp, x, mlp[0])[1:]


def _same_grads(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=PARAM_ATOL, rtol=0, msg=name)


def test_retain_grad_with_plain_backward_in_each_invoke(mlp):
    model = distgrad.wrap(mlp)
    xs = _xs(2, rows=3)
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h0 = model[0].output.save()
            h0.retain_grad()
            model.output.sum().backward(retain_graph=True)
            after_first = distgrad.save(param_grads(mlp))
        with tr.invoke(xs[1]):
            h1 = model[0].output.save()
            h1.retain_grad()
            model.output.sum().backward()
    got = param_grads(mlp)
    ref0, params0 = _fc_grads(mlp, xs[0])
    ref1, params1 = _fc_grads(mlp, xs[1])
    torch.testing.assert_close(h0.grad, ref0, atol=ATOL, rtol=0)
    torch.testing.assert_close(h1.grad, ref1, atol=ATOL, rtol=0)
    _same_grads(after_first, params0)
    _same_grads(got, {n: params0[n] + params1[n] for n in params0})


def test_retain_grad_with_plain_backward_beside_a_backward_block(mlp):
    """One body runs PyTorch's backward at once, another opens a block: the batch's backward
    runs after the forward, over the graph the first one kept."""
    model = distgrad.wrap(mlp)
    xs = _xs(2, rows=3)
    with model.trace() as tr:
        with tr.invoke(xs[0]):
            h0 = model[0].output
            with model.output.sum().backward():
                g0 = h0.grad.save()
        with tr.invoke(xs[1]):
            h1 = model[0].output.save()
            h1.retain_grad()
            model.output.sum().backward(retain_graph=True)
    got = param_grads(mlp)
    ref0, params0 = _fc_grads(mlp, xs[0])
    ref1, params1 = _fc_grads(mlp, xs[1])
    torch.testing.assert_close(g0, ref0, atol=ATOL, rtol=0)
    torch.testing.assert_close(h1.grad, ref1, atol=ATOL, rtol=0)
    _same_grads(got, {n: params0[n] + params1[n] for n in params0})


def test_bodies_written_in_different_functions_share_no_names(mlp):
    """A name bound in an invoke body opened by one helper is that helper's local: another
    helper's body reads its own scope (here the module's global ``_LABEL``), as plain Python
    would, and the caller's frame gets neither helper's names."""
    model = distgrad.wrap(mlp)
    xs = _xs(2)
    seen = {}

    def binds(tr):
        with tr.invoke(xs[0]):
            _LABEL = model[0].output.sum()  # noqa: F841 (a local of binds)

    def reads(tr):
        with tr.invoke(xs[1]):
            seen["h"] = model[2].output.save()  # after the other body has bound its name
            seen["label"] = _LABEL

    with model.trace() as tr:
        binds(tr)
        reads(tr)
    assert seen["label"] == "module global"
    assert "_LABEL" not in locals()
    with torch.no_grad():
        torch.testing.assert_close(seen["h"], mlp[:3](xs[1]), atol=ATOL, rtol=0)


_LABEL = "module global"
