"""Edits a pipeline body reads back, on every rank: the cases of ``pp_job.py`` for in-place
edits of a value (on its own stage and on the ranks that receive a copy), a replaced output read
again after the assignment, and ``.input``, each compared with the unsplit model on one process
(plain forward hooks doing the same edits, the whole batch at once; fp32, atol 1e-5 as the rest
of the job). ``ctx`` carries the job's ``batch()``, ``width`` and ``blocks``."""
from __future__ import annotations

from torch import nn

import distgrad
from cases import close, expect_error  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_mlp


def oracle(ctx) -> dict:
    """One process, hooks: ``layers[1][0]``'s output doubled, ``layers[2]``'s input kept and its
    output halved, and the gradients reaching ``layers[2]``'s (halved) and ``layers[3]``'s
    outputs."""
    x, y = ctx["batch"]()
    m = ctx["m"]
    net = build_mlp(ctx["width"], ctx["blocks"])
    seen = {}

    def keep(name, out):
        seen[name] = out.detach().clone()
        out.register_hook(lambda g: seen.__setitem__("g" + name, g.detach().clone()))
        return out

    net.layers[1][0].register_forward_hook(lambda mod, args, out: keep("a1", out * 2))
    net.layers[2].register_forward_pre_hook(
        lambda mod, args: seen.__setitem__("i2", args[0].detach().clone()))
    net.layers[2].register_forward_hook(lambda mod, args, out: keep("h2", out * 0.5))
    net.layers[3].register_forward_hook(lambda mod, args, out: keep("h3", out))
    nn.MSELoss()(net(x), y).backward()
    seen["params"] = {n: p.grad.clone() for n, p in net.named_parameters()}
    seen["m"] = m
    return seen


def case_edits_read_back(model, net, ctx):
    """On every rank, whichever stage runs the layer:
    - ``layers[1][0].output`` doubled in place: its owner edits the real value, every other rank
      its copy, so the copy must leave the owner as it was read (packed any later, the receivers
      would double it twice); read again, it is the same tensor, as on one process;
    - ``layers[2].input``: the first positional argument, sent as a tensor;
    - ``layers[2].output`` replaced, then read back: the edited value (the owner sends what its
      read returns), the same tensor on a second read, and its gradient is the one reaching the
      edit;
    - parameter gradients of this rank's stages as one process's."""
    x, y = ctx["batch"]()
    with model.trace(x, target=y) as tr:
        a1 = model.layers[1][0].output
        a1 *= 2
        assert model.layers[1][0].output is a1, "a second read is another tensor"
        a1 = a1.save()
        i2 = model.layers[2].input.save()
        model.layers[2].output = model.layers[2].output * 0.5
        h2 = model.layers[2].output.save()
        assert model.layers[2].output is h2, "a second read-back is another tensor"
        h3 = model.layers[3].output.save()
        with tr.loss.backward():
            g3 = h3.grad.save()
            g2 = h2.grad.save()
    ref = oracle(ctx)
    m = ref["m"]
    close(a1, ref["a1"], "layers[1][0] output doubled in place")
    close(i2, ref["i2"], "layers[2] input (after the in-place edit upstream)")
    close(h2, ref["h2"], "layers[2] output read back after its edit")
    close(h3, ref["h3"], "layers[3] output after both edits")
    close(g3, ref["gh3"] * m, "layers[3] gradient (each microbatch's own loss)")
    close(g2, ref["gh2"] * m, "gradient reaching the edited layers[2] output")
    for name, param in net.named_parameters():
        if param.grad is not None:  # this rank's stages' parameters
            close(param.grad, ref["params"][name], f"gradient of {name}")
    net.zero_grad(set_to_none=True)


def case_edits_read_back_thread(model, net, ctx):
    """The same with the step in a worker thread and the scheduler running the bodies."""
    distgrad.config.backward_mode = "thread"
    try:
        case_edits_read_back(model, net, ctx)
    finally:
        distgrad.config.backward_mode = "auto"


def case_inputs_refused(model, net, ctx):
    """``.inputs`` (args and kwargs) cannot cross stages: every rank raises, before any value is
    sent, with a message that points to ``.input``."""
    x, y = ctx["batch"]()

    def run():
        with model.trace(x, target=y) as tr:
            model.layers[2].inputs
            with tr.loss.backward():
                pass

    expect_error(run, TypeError, "Use model.layers[2].input", heard=False)
