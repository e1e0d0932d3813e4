"""Models inside PEFT's ``PeftModel``: both paths to a module, reads, edits and LoRA gradients
against plain autograd (on one process and on 2 ranks of each engine), and the assignments an
envoy does not serve.

Oracle: the same step done with plain PyTorch hooks on a model with the same weights
(tests/wrapped_steps.py), to the usual tolerances (atol 1e-6 for values, 1e-5 for parameter
gradients).
"""

from __future__ import annotations

import pytest
import torch
from conftest import PARAM_ATOL, hook_count, param_grads
from peft import LoraConfig, get_peft_model
from wrapped_steps import IDS, assert_close, assert_grads, plain_step, traced_step

import distgrad
from distgrad.demo.models import build_gpt2


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
    assert_close(
        lora_b.grad,
        grads["base_model.model.transformer.h.1.attn.c_attn.lora_B.default.weight"],
        atol=PARAM_ATOL,
    )
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
    _, _, _, edited = plain_step(
        lora, inner.transformer.h[0], scale=1.0, grad_scale=1.0 if edit is None else edit
    )
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
    procs = run_ranks(
        [str(here / "peft_job.py"), "--engine", engine, "--out", str(tmp_path)], 2, timeout=180
    )
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
        with pytest.raises(
            AttributeError,
            match=r"h\[0\]\.outptu = \.\.\..*Did you mean "
            r"model\.transformer\.h\[0\]\.output",
        ):
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
