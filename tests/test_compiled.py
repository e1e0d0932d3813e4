"""Models inside ``torch.compile`` (both spellings, and around DDP).

Oracle: the same step done with plain PyTorch hooks on an eager copy of the model with the same
weights (tests/wrapped_steps.py). A trace of a compiled model runs its eager code
(distgrad/wrappers.py), so values agree to the same tolerances as elsewhere (atol 1e-6 for
values, 1e-5 for parameter gradients); steps outside traces run the compiled graph and agree to
rounding (1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PARAM_ATOL, hook_count, param_grads
from wrapped_steps import IDS, assert_close, assert_grads, plain_step, traced_step

import distgrad
from distgrad.demo.models import build_gpt2


class CountingBackend:
    """A torch.compile backend that runs dynamo's graph eagerly and counts the graph's runs, so
    a test can tell a compiled step from an eager one, and the graphs it was given (one per
    compile or recompile)."""

    def __init__(self):
        self.runs = 0
        self.compiles = 0

    def __call__(self, graph, example_inputs):
        self.compiles += 1

        def run(*args):
            self.runs += 1
            return graph(*args)

        return run


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles its own model with its own backend; dynamo's caches (and its limit of
    eight recompiles of one function, which GPT-2's shared forward code reaches across tests)
    start empty, so a test that counts compiled runs sees its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(how: str, backend):
    """(what to wrap, the eager module inside) for ``torch.compile(net)`` or ``net.compile()``."""
    net = build_gpt2()
    if how == "torch.compile(net)":
        return torch.compile(net, backend=backend), net
    net.compile(backend=backend)
    return net, net


@pytest.fixture(
    scope="module", params=["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
def compile_backend(request):
    """eager and aot_eager run dynamo and AOTAutograd without code generation; inductor
    generates C++ (a compiler is needed; minutes on a small machine)."""
    return request.param


@pytest.mark.parametrize("how", ["torch.compile(net)", "net.compile()"])
def test_compiled_model_traced_steps_match_plain_autograd(how, compile_backend, backward_mode):
    """Traced steps before and after compiled steps give plain autograd's numbers (forward read
    and edit, gradient read and edit, parameter gradients), and the compiled steps between
    them give the compiled model's own numbers."""
    compiled, net = _compiled(how, compile_backend)
    eager = copy.deepcopy(net)
    eager._compiled_call_impl = None  # the oracle runs eager
    model = distgrad.wrap(compiled)
    out, grad, logits, grads = plain_step(eager, eager.transformer.h[0])
    plain_logits = eager(IDS).logits.detach()
    for step in range(3):
        # a compiled step outside a trace (the first compiles), then a traced one
        compiled_logits = compiled(IDS).logits
        compiled_logits.sum().backward()
        net.zero_grad(set_to_none=True)
        assert_close(compiled_logits.detach(), plain_logits, atol=PARAM_ATOL)
        got_out, got_grad, got_logits = traced_step(model, model.transformer.h[0])
        assert_close(got_out, out)
        assert_close(got_grad, grad)
        assert_close(got_logits, logits)
        assert_grads(param_grads(net), grads)
        net.zero_grad(set_to_none=True)
        assert hook_count(net) == 0, step


def test_compiled_model_full_path_and_first_traced_step():
    """The first call of a compiled model inside a trace (nothing compiled yet), by the full
    path ``model._orig_mod...``."""
    compiled, net = _compiled("torch.compile(net)", "aot_eager")
    eager = copy.deepcopy(net)
    out, grad, logits, grads = plain_step(eager, eager.transformer.h[1])
    model = distgrad.wrap(compiled)
    got_out, got_grad, got_logits = traced_step(model, model._orig_mod.transformer.h[1])
    assert_close(got_out, out)
    assert_close(got_grad, grad)
    assert_close(got_logits, logits)
    assert_grads(param_grads(net), grads)


@pytest.mark.parametrize("how", ["torch.compile(net)", "net.compile()"])
def test_traces_run_eager_and_steps_outside_stay_compiled(how, backward_mode):
    counting = CountingBackend()
    compiled, net = _compiled(how, counting)
    model = distgrad.wrap(compiled)
    compiled(IDS)
    runs = counting.runs
    assert runs >= 1
    with model.trace(IDS):
        h = model.transformer.h[0].output.save()
        logits = model.output.logits
    assert counting.runs == runs  # the trace ran eager
    compiled(IDS)
    assert counting.runs > runs  # and the compiled graph is back outside it
    runs = counting.runs
    with pytest.raises(ZeroDivisionError):
        with model.trace(IDS):
            h = model.transformer.h[0].output
            1 / 0
    compiled(IDS)
    assert counting.runs > runs  # an error in the body leaves nothing forced either
    assert hook_count(net) == 0


@pytest.mark.parametrize("hook_guards", [False, True])
def test_traced_steps_compile_nothing(hook_guards):
    """A traced step (forward edit, gradient read and edit) makes dynamo compile nothing, and
    neither does the compiled step after it. With ``skip_nnmodule_hook_guards`` off, dynamo
    guards on module hooks, so a trace whose hooks reached the compiled code would recompile."""
    counting = CountingBackend()
    compiled, net = _compiled("torch.compile(net)", counting)
    model = distgrad.wrap(compiled)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not hook_guards):
        compiled(IDS).logits.sum().backward()
        compiles, runs = counting.compiles, counting.runs
        assert compiles >= 1 and runs >= 1
        for step in range(2):
            traced_step(model, model.transformer.h[0])
            assert (counting.compiles, counting.runs) == (compiles, runs), step
            compiled(IDS).logits.sum().backward()
            assert counting.compiles == compiles, step  # no recompile after a trace
            assert counting.runs > runs, step
            runs = counting.runs
    assert hook_count(net) == 0


def test_compiled_ddp_is_driven_by_the_ddp_engine(tmp_path):
    """``torch.compile(DDP(net))``: the engine is DDP's (saves gathered, reduced gradients),
    not the one-process engine a compiled module would otherwise get. One rank of gloo: the
    engine choice and the step's numbers, not the communication (tests/dist covers that)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distgrad.engines.ddp import DDPEngine

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        net = build_gpt2()
        eager = copy.deepcopy(net)
        out, grad, logits, grads = plain_step(eager, eager.transformer.h[0])
        compiled = torch.compile(DistributedDataParallel(net), backend="aot_eager")
        model = distgrad.wrap(compiled)
        assert isinstance(model._engine, DDPEngine)
        compiled(IDS).logits.sum().backward()  # a compiled step first
        net.zero_grad(set_to_none=True)
        got_out, got_grad, got_logits = traced_step(model, model.transformer.h[0])
        assert_close(got_out, out)
        assert_close(got_grad, grad)
        assert_close(got_logits, logits)
        assert_grads(param_grads(net), grads)
    finally:
        dist.destroy_process_group()
