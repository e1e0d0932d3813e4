"""What a pipeline job does when the ranks' bodies differ or a rank fails: the cases of
``pp_job.py`` in which a rank-dependent request, a slow stage, a dead rank or a body's error
must end the step on every rank (each raises, none hangs), run in the same job and group.
``ctx`` is pp_job's: rank, world, microbatches and the shared batch and model sizes."""
from __future__ import annotations

from torch import nn

import distgrad
# tests/dist is the job script's folder
from cases import close, expect_error, expect_failure_of_rank1  # noqa: E402
from distgrad.demo.models import build_mlp


def case_rank_dependent(model, net, ctx):
    """Each stage reads only its own layer (`if rank == 0`): each owner sends its value to the
    other rank, whose body never asks for it. Every rank raises at the end of the step instead of
    waiting for its sends to be received."""
    x, y = ctx["batch"]()

    def run():
        with model.trace(x, target=y) as tr:
            model.layers[1 if ctx["rank"] == 0 else 3].output
            with tr.loss.backward():
                pass

    expect_error(run, distgrad.TraceStateError, "different values on different ranks")


def case_rank_dependent_far(model, net, ctx):
    """Four stages: only rank 2 asks for stage 0's layers[0] output. Stage 0 is not its
    neighbour, so that bundle would come on a message of its own, not on the schedule's; stage 0
    never sends it and goes on to wait in the schedule. Rank 2 asks where stage 0 is (stage 0's
    failure watcher answers), learns the bundle went without the value, and raises; the others
    hear of it instead of waiting for gloo's timeout."""
    x, y = ctx["batch"]()

    def run():
        with model.trace(x, target=y) as tr:
            if ctx["rank"] == 2:
                model.layers[0].output
            with tr.loss.backward():
                pass

    expect_error(run, distgrad.TraceStateError, "did not send")


def slow_last_backward(net, ctx, seconds: float):
    """On rank 0, the last microbatch's backward through layers[0] takes ``seconds`` longer (a
    tensor hook on its weight): stage 0 ends its step that much after the last stage, which
    has nothing left to do but wait for it. Returns the undo."""
    if ctx["rank"] != 0:
        return lambda: None
    import time
    calls = []

    def slow(grad):
        calls.append(True)
        if len(calls) == ctx["m"]:
            time.sleep(seconds)
    return net.layers[0][0].weight.register_hook(slow).remove


def slow_last_body(ctx, seconds: float):
    """A function for the body to call once per microbatch: on rank 0 the last microbatch's call
    sleeps ``seconds``. Called after the body's last request, it holds back the values stage 0
    sends the other ranks when its bodies are done (the "end" bundles)."""
    import time
    calls = []

    def pause():
        if ctx["rank"] == 0:
            calls.append(True)
            if len(calls) == ctx["m"]:
                time.sleep(seconds)
    return pause


def case_slow_owner(model, net, ctx):
    """The last stage waits for stage 0's gradient (sent when stage 0's bodies are done) for
    longer than the failure timeout, because stage 0's last body is slow: the wait goes on and
    the values are right (a timed receive would have closed the group's connections: gloo does
    so when one expires)."""
    x, y = ctx["batch"]()
    m = ctx["m"]
    import time
    pause = slow_last_body(ctx, 1.5 * distgrad.config.failure_timeout)
    start = time.monotonic()
    with model.trace(x, target=y) as tr:
        h = model.layers[1].output
        with tr.loss.backward():
            g = h.grad.save()
            pause()
    if time.monotonic() - start < distgrad.config.failure_timeout:  # what this case is about
        raise AssertionError("the trace did not wait for the slow stage 0")
    ref = build_mlp(ctx["width"], ctx["blocks"])  # the same weights, unsplit, with plain autograd
    h1 = ref.layers[1](ref.layers[0](x))
    h1.retain_grad()
    nn.MSELoss()(ref.layers[3](ref.layers[2](h1)), y).backward()
    close(g, h1.grad * m, "layers[1] gradient, after a slow stage 0")
    net.zero_grad(set_to_none=True)
    # the thread that waited is kept for the next long wait, not started again each step
    import threading
    threads = [t.name for t in threading.enumerate()]
    for _ in range(3):
        with model.trace(x, target=y) as tr:
            h = model.layers[1].output
            with tr.loss.backward():
                g = h.grad.save()
        net.zero_grad(set_to_none=True)
    now = [t.name for t in threading.enumerate()]
    if len(now) != len(threads):
        raise AssertionError(f"threads before 3 traces: {sorted(threads)}; after: {sorted(now)}")


def case_rank_dependent_grad(model, net, ctx):
    """Only the last stage asks for stage 0's gradient: it waits for a bundle stage 0 never
    sends; it raises once stage 0 has ended its step and said what it sent, and stage 0 hears.
    Stage 0 is slow, so the last stage waits longer than the failure timeout before stage 0
    has said anything."""
    x, y = ctx["batch"]()

    def run():
        with model.trace(x, target=y) as tr:
            h = model.layers[1].output
            with tr.loss.backward():
                if ctx["rank"] == ctx["world"] - 1:
                    h.grad

    undo = slow_last_backward(net, ctx, 1.5 * distgrad.config.failure_timeout)
    try:
        expect_error(run, distgrad.TraceStateError, "did not send")
    finally:
        undo()


def case_killed(model, net, ctx):
    """The last stage dies (SIGKILL) in its body during the step: the first stage, waiting in
    the schedule or for a value, reports a lost rank within the failure timeout and exits
    normally."""
    import os
    import signal
    x, y = ctx["batch"]()

    def run():
        with model.trace(x, target=y) as tr:
            h1 = model.layers[1].output
            h3 = model.layers[3].output
            if ctx["rank"] == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            with tr.loss.backward():
                h3.grad
                h1.grad

    expect_error(run, distgrad.RankFailedError, "stopped answering", heard=False)


def case_failure(model, net, ctx):
    rank = ctx["rank"]
    x, y = ctx["batch"]()

    def run():
        with model.trace(x, target=y) as tr:
            h = model.layers[0].output
            if rank == 1:
                1 / 0
            with tr.loss.backward():
                h.grad

    expect_failure_of_rank1(rank, run)
