"""A trace leaves nothing for the cycle collector, and nothing of it outlives the user's names.

With the cycle collector off, whatever a trace links into a reference cycle stays in memory
until ``gc.collect()`` runs: step after step, on a GPU, the activations of every step. So each
test turns the collector off, runs traces, and counts what only the collector could free
(``gc.DEBUG_SAVEALL`` keeps it in ``gc.garbage``): it must be nothing. The README program runs
in every body mode, after errors in the body, and with invokes; ``tests/dist/job.py``
(``case_no_cycles``) checks the same under DDP.
"""

import contextlib
import gc
import threading
import weakref

import pytest
import torch
from conftest import TEXT
from dist.dp_leaks import cyclic_garbage, describe, kinds  # tests/dist: shared with the jobs

import distgrad


def readme_step(model):
    with model.trace(TEXT):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum()
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    return g


@pytest.mark.usefixtures("backward_mode")
def test_readme_program_leaves_no_cycles(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    found = cyclic_garbage(lambda: readme_step(model))
    assert not found, describe(kinds(found))


@pytest.mark.usefixtures("backward_mode")
@pytest.mark.parametrize("where", ["forward", "backward", "order"])
def test_errors_in_the_body_leave_no_cycles(gpt2, tokenizer, where):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)

    def failing_step():
        try:
            with model.trace(TEXT):
                a0 = model.transformer.h[0].output
                a1 = model.transformer.h[1].output
                if where == "forward":
                    raise KeyError("the user's own error")
                loss = model.output.logits.sum()
                with loss.backward():
                    if where == "order":
                        a0.grad  # before a1.grad: out of order
                    a1.grad = a1.grad * 2
                    raise KeyError("the user's own error")
        except (KeyError, distgrad.OutOfOrderError):
            pass
        else:
            raise AssertionError("the body's error was not raised")

    found = cyclic_garbage(failing_step)
    assert not found, describe(kinds(found))
    readme_step(model)  # and the next trace works


def test_invokes_leave_no_cycles(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)

    def step():
        with model.trace() as tracer:
            with tracer.invoke(TEXT):
                h = model.transformer.h[0].output.save()
                h1 = model.transformer.h[1].output
                loss = model.output.logits.sum()
                with loss.backward():
                    g = h1.grad.save()
            with tracer.invoke("Paris is"):
                h2 = model.transformer.h[0].output.save()
        return h, g, h2

    found = cyclic_garbage(step)
    assert not found, describe(kinds(found))


@pytest.mark.usefixtures("backward_mode")
def test_saved_values_die_with_the_users_names(gpt2, tokenizer):
    """Nothing of the trace - a runner greenlet idle in its pool, a kept worker thread, the
    trace object the user still holds - keeps a saved value alive once the user drops it.
    No gc.collect(): reference counting alone must free it."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXT) as tracer:
        h1 = model.transformer.h[1].output
        logits = model.output.logits.save()
        loss = logits.sum()
        with loss.backward():
            g = h1.grad.save()
    expected = logits.detach().clone()
    logits_ref, grad_ref = weakref.ref(logits), weakref.ref(g)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        torch.testing.assert_close(
            gpt2(**tokenizer(TEXT, return_tensors="pt")).logits.detach(), expected
        )
        del logits, loss, g, h1
        assert logits_ref() is None, "the saved logits outlived the user's names"
        assert grad_ref() is None, "the saved gradient outlived the user's names"
        assert tracer is not None  # the trace object itself may stay: it holds no values
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.usefixtures("backward_mode")
@pytest.mark.parametrize("where", ["nowhere", "forward", "backward"])
def test_the_model_dies_with_the_users_names(where):
    """After a trace (ending well or with an error in the body), nothing of distgrad keeps the
    model or its inputs: the runs' greenlets and threads, pooled for the next trace, hold none
    of them. In a thread of its own, so that its pool of runners is new and checked while it
    lives."""
    alive = []

    def user():
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        model = distgrad.wrap(net)
        x = torch.randn(2, 4)
        h = loss = g = None
        try:
            with model.trace(x):
                h = model[0].output
                if where == "forward":
                    raise ValueError
                loss = model.output.sum()
                with loss.backward():
                    g = h.grad.save()
                    if where == "backward":
                        raise ValueError
        except ValueError:
            pass
        net_ref, x_ref = weakref.ref(net), weakref.ref(x)
        del model, net, x, h, loss, g
        gc.collect()
        alive.extend(name for name, ref in [("model", net_ref), ("inputs", x_ref)] if ref())

    thread = threading.Thread(target=user)
    thread.start()
    thread.join()
    assert alive == []


@pytest.mark.usefixtures("backward_mode")
@pytest.mark.parametrize("where", ["trace", "invokes", "error"])
def test_a_weak_reference_to_the_model_dies_with_it(where):
    """``weakref.ref(model)`` works on the wrapped model (caches keyed by model use it), and
    after a trace nothing of distgrad keeps the model: the reference dies with the user's
    names. A thread of its own, as above, so that the runners it checks are its own."""
    alive = []

    def user():
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        model = distgrad.wrap(net)
        model_ref = weakref.ref(model)
        assert model_ref() is model
        try:
            with model.trace(*([] if where == "invokes" else [torch.randn(2, 4)])) as tracer:
                if where == "invokes":
                    with tracer.invoke(torch.randn(2, 4)):
                        with model.output.sum().backward():
                            distgrad.save(model[0].weight.grad)
                else:
                    h = model[0].output
                    with model.output.sum().backward():
                        h.grad.save()
                        if where == "error":
                            raise KeyError("the user's own error")
        except KeyError:
            pass
        del model, net, tracer
        h = None
        gc.collect()  # an envoy and its children link to each other: a cycle, freed here
        if model_ref() is not None:
            alive.append("model")

    thread = threading.Thread(target=user)
    thread.start()
    thread.join()
    assert alive == []


@pytest.mark.parametrize("ending", ["bounded", "outrun", "error"])
def test_loops_over_steps_leave_no_cycles(gpt2, ending):
    """``tracer.iter`` loops in generate: ended by their bound, by generation ending (the body
    cut short with a warning), and by an error in the loop's body."""
    model = distgrad.wrap(gpt2)
    ids = torch.tensor([[40, 72, 101]])

    def step():
        try:
            with model.generate(ids, max_new_tokens=2, do_sample=False) as tracer:
                heads = distgrad.save([])
                for i in tracer.iter[:2] if ending == "bounded" else tracer.all():
                    heads.append(model.lm_head.output)
                    if ending == "error" and i == 1:
                        raise KeyError("the user's own error")
        except KeyError:
            pass

    with pytest.warns(UserWarning) if ending == "outrun" else contextlib.nullcontext():
        found = cyclic_garbage(step)
    assert not found, describe(kinds(found))


def test_saves_of_containers_leave_no_cycles(gpt2, tokenizer):
    """``.save()`` on the tuples and ``ModelOutput`` envoys hand a body (``saveable.py``), in a
    trace and in invokes."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)

    def step():
        with model.trace(TEXT):
            model.transformer.h[1].inputs.save()
            model.output.save()
        with model.trace() as tracer:
            with tracer.invoke(TEXT):
                model.output.save()
            with tracer.invoke("Hi"):
                model.transformer.h[0].inputs.save()

    found = cyclic_garbage(step)
    assert not found, describe(kinds(found))
