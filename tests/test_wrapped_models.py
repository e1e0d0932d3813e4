"""Models inside wrappers: PEFT's ``PeftModel`` and ``torch.compile`` (both spellings).

Oracle: the same step done with plain PyTorch hooks on an eager copy of the model with the same
weights. A trace of a compiled model runs its eager code (distgrad/wrappers.py), so values agree
to the same tolerances as elsewhere (conftest.py: atol 1e-6 for values, 1e-5 for parameter
gradients); steps outside traces run the compiled graph and agree to rounding (1e-5).
"""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import distgrad
from distgrad.demo.models import build_gpt2
from conftest import ATOL, PARAM_ATOL, hook_count, param_grads

IDS = torch.tensor([[84, 107, 104, 32, 69, 105, 102], [70, 101, 108, 32, 84, 111, 119]])


@pytest.fixture(scope="module")
def _lora():
    torch.manual_seed(3)
    # init_lora_weights=False: B is random too, so the adapter changes the forward and both
    # A and B get gradients
    config = LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False)
    return get_peft_model(build_gpt2(), config)


@pytest.fixture
def lora(_lora):
    _lora.zero_grad(set_to_none=True)
    return _lora


def plain_step(net, block, scale=0.5, grad_scale=2.0):
    """Plain autograd: ``block``'s output scaled by ``scale`` (a forward edit), its gradient
    read and then scaled by ``grad_scale``. Returns (edited output, gradient read, logits,
    parameter gradients)."""
    net.zero_grad(set_to_none=True)
    seen = {}

    def on_output(mod, args, out):
        out = out * scale
        seen["out"] = out

        def on_grad(grad):
            seen["grad"] = grad.detach().clone()
            return grad * grad_scale

        out.register_hook(on_grad)
        return out

    handle = block.register_forward_hook(on_output)
    try:
        logits = net(IDS).logits
    finally:
        handle.remove()
    logits.sum().backward()
    grads = param_grads(net)
    net.zero_grad(set_to_none=True)
    return seen["out"].detach(), seen["grad"], logits.detach(), grads


def traced_step(model, block, scale=0.5, grad_scale=2.0):
    """The same step as ``plain_step`` through distgrad, ``block`` an envoy."""
    with model.trace(IDS):
        block.output = block.output * scale
        h = block.output
        logits = model.output.logits
        with logits.sum().backward():
            g = h.grad.save()
            h.grad = h.grad * grad_scale
    return h.detach(), g, logits.detach()


def assert_close(got, expected, atol=ATOL):
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def assert_grads(got: dict, expected: dict, prefix: str = ""):
    assert got.keys() == {prefix + name for name in expected}
    for name, g in expected.items():
        torch.testing.assert_close(got[prefix + name], g, atol=PARAM_ATOL, rtol=0, msg=name)


# -- PEFT ---------------------------------------------------------------------------------------
def test_peft_short_and_full_paths_name_the_same_module(lora):
    model = distgrad.wrap(lora)
    short = model.transformer.h[0]
    full = model.base_model.model.transformer.h[0]
    assert isinstance(short, distgrad.envoy.Envoy) and isinstance(full, distgrad.envoy.Envoy)
    block = lora.base_model.model.transformer.h[0]
    assert short._module is block and full._module is block
    assert model.transformer._module is lora.base_model.model.transformer
    assert model.lm_head._module is lora.base_model.model.lm_head
    # the short path's envoy sits under the real enclosing modules (trace._new_point walks them)
    assert model.transformer._parent._module is lora.base_model.model


@pytest.mark.parametrize("spelling", ["short", "full"])
def test_peft_reads_edits_and_grads_match_plain_autograd(lora, backward_mode, spelling):
    model = distgrad.wrap(lora)
    inner = model if spelling == "short" else model.base_model.model
    out, grad, logits, grads = plain_step(lora, lora.base_model.model.transformer.h[0])
    assert len(grads) == 4  # LoRA's A and B on both layers' c_attn: all that trains
    got_out, got_grad, got_logits = traced_step(model, inner.transformer.h[0])
    assert_close(got_out, out)
    assert_close(got_grad, grad)
    assert_close(got_logits, logits)
    assert_grads(param_grads(lora), grads)
    # parameter gradients through both spellings, LoRA's own included
    lora_a = inner.transformer.h[0].attn.c_attn.lora_A["default"].weight
    name = "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"
    assert_close(lora_a.grad, grads[name], atol=PARAM_ATOL)
    lora_b = model.transformer.h[1].attn.c_attn.lora_B["default"].weight
    assert_close(lora_b.grad, grads["base_model.model.transformer.h.1.attn.c_attn.lora_B.default"
                                    ".weight"], atol=PARAM_ATOL)
    assert model.transformer.h[1].mlp.c_fc.weight.grad is None  # frozen by PEFT, as in plain
    assert hook_count(lora) == 0


def test_peft_lora_submodule_output_is_served(lora):
    """A module only PEFT added (the adapter's B) is reachable by the short path."""
    model = distgrad.wrap(lora)
    seen = {}
    b = lora.base_model.model.transformer.h[1].attn.c_attn.lora_B["default"]
    handle = b.register_forward_hook(lambda m, a, o: seen.setdefault("b", o.detach().clone()))
    try:
        lora(IDS)
    finally:
        handle.remove()
    with model.trace(IDS):
        got = model.transformer.h[1].attn.c_attn.lora_B["default"].output.save()
    assert_close(got, seen["b"])


LORA = [f"transformer.h.{i}.attn.c_attn.lora_{ab}.default.weight" for i in (0, 1) for ab in "AB"]


@pytest.mark.parametrize("edit", [None, 3.0])
def test_lora_grads_read_in_the_body_match_plain_autograd(lora, backward_mode, edit):
    """The LoRA weights' gradients read through envoy paths in the body, after the backward
    block, with h[0]'s output gradient only read or multiplied by ``edit`` (a tensor hook in
    the oracle)."""
    inner = lora.base_model.model
    _, _, _, plain = plain_step(lora, inner.transformer.h[0], scale=1.0, grad_scale=1.0)
    _, _, _, edited = plain_step(lora, inner.transformer.h[0], scale=1.0,
                                 grad_scale=1.0 if edit is None else edit)
    model = distgrad.wrap(lora)
    with model.trace(IDS):
        h0 = model.transformer.h[0].output
        with model.output.logits.sum().backward():
            if edit is None:
                h0.grad.save()
            else:
                h0.grad = h0.grad * edit
        got = {}
        for name in LORA:
            block, ab = int(name.split(".")[2]), name.split(".")[5]
            adapter = getattr(model.transformer.h[block].attn.c_attn, ab)["default"]
            got[name] = adapter.weight.grad.save()
    for name in LORA:
        full = "base_model.model." + name
        assert_close(got[name], edited[full], atol=PARAM_ATOL)
        if edit is not None:  # it changes h[0]'s adapters (upstream of it), not h[1]'s
            changed = not torch.allclose(edited[full], plain[full], atol=1e-4)
            assert changed == name.startswith("transformer.h.0."), name


@pytest.mark.parametrize("engine", ["ddp", "fsdp1", "fsdp2", "zero1", "zero3"])
def test_lora_grads_under_each_engine_match_plain_autograd(engine, tmp_path):
    """The same on 2 ranks of each data-parallel engine (gloo), and (except under DeepSpeed,
    whose backward scales the loss itself) with ``backward(scaler=...)``:
    tests/dist/peft_job.py, both body paths."""
    import sys
    from pathlib import Path
    here = Path(__file__).parent / "dist"
    sys.path.insert(0, str(here))
    try:
        from launch import case_report, read_results, run_ranks
    finally:
        sys.path.remove(str(here))
    procs = run_ranks([str(here / "peft_job.py"), "--engine", engine, "--out", str(tmp_path)], 2,
                      timeout=180)
    results = read_results(tmp_path, 2)
    cases = ["case_lora_grads", "case_lora_grads_after_an_edit"]
    if not engine.startswith("zero"):
        cases.append("case_lora_grads_with_a_scaler")
    for case in cases:
        report = case_report(procs, results, case)
        assert not report, report
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"


# -- assignments an envoy does not serve --------------------------------------------------------
@pytest.mark.parametrize("where", ["in a trace", "outside a trace"])
def test_unserved_assignments_raise_and_change_nothing(gpt2, where):
    model = distgrad.wrap(gpt2)
    block = model.transformer.h[0]
    before = dict(vars(gpt2.transformer.h[0]))

    def attempts():
        value = torch.zeros(1)
        with pytest.raises(AttributeError, match=r"h\[0\]\.outptu = \.\.\..*Did you mean "
                                                 r"model\.transformer\.h\[0\]\.output"):
            block.outptu = value
        with pytest.raises(AttributeError, match=r"h\[0\]\.grad = \.\.\."):
            block.grad = value
        with pytest.raises(AttributeError, match=r"h\[0\]\.mlp = \.\.\."):
            block.mlp = torch.nn.Identity()

    if where == "in a trace":
        with model.trace(IDS):
            attempts()
            logits = model.output.logits
    else:
        attempts()
        with model.trace(IDS):
            logits = model.output.logits
    assert dict(vars(gpt2.transformer.h[0])) == before
    assert_close(logits, gpt2(IDS).logits.detach())
    assert hook_count(gpt2) == 0


def test_peft_short_path_assignment_is_not_lost(lora, backward_mode):
    """The silent wrong this guards: `model.transformer.h[0].output = ...` on a PEFT model used
    to land on the module as a plain attribute."""
    model = distgrad.wrap(lora)
    with model.trace(IDS):
        model.transformer.h[0].output = model.transformer.h[0].output * 0
        logits = model.output.logits
    block = lora.base_model.model.transformer.h[0]
    assert "output" not in vars(block)
    handle = block.register_forward_hook(lambda m, a, o: o * 0)
    try:
        expected = lora(IDS).logits.detach()
    finally:
        handle.remove()
    assert_close(logits, expected)


# -- torch.compile ------------------------------------------------------------------------------
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


@pytest.fixture(scope="module", params=["eager", "aot_eager",
                                        pytest.param("inductor", marks=pytest.mark.slow)])
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
    assert counting.runs > runs   # and the compiled graph is back outside it
    runs = counting.runs
    with pytest.raises(ZeroDivisionError):
        with model.trace(IDS):
            h = model.transformer.h[0].output
            1 / 0
    compiled(IDS)
    assert counting.runs > runs   # an error in the body leaves nothing forced either
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

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
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
