"""nnsight's tests/test_lm.py (tracing and generate), ported to the tiny random GPT-2.

nnsight's asserts on decoded text of pretrained GPT-2 (" New York City") become comparisons
with plain PyTorch on the same weights: forward hooks for values and edits, ``net.generate``
with the same hook for generated ids. fp32, atol 1e-6. With transformers 5 a GPT-2 block
returns a tensor, so nnsight's ``h[i].output[0]`` (the hidden states of a tuple) is
``h[i].output`` here. Scan, source, skip, iter, cache and edit tests are not ported (see
nnsight_port.py).
"""

import pytest
import torch
from nnsight_port import MSG, assert_close, encode, hooked_run

import distgrad

GREEDY = dict(max_new_tokens=3, do_sample=False)


@pytest.fixture
def model(gpt2, tokenizer):
    return distgrad.wrap(gpt2, tokenizer=tokenizer)


def plain_generate(net, tokenizer, text, module=None, edit=None):
    """``net.generate`` with ``edit`` on ``module``'s output at the first step (the prompt's
    forward), as a trace's edit of ``.output`` applies to the module's first call."""
    calls = []

    def hook(mod, args, out):
        calls.append(1)
        return edit(out) if len(calls) == 1 else None

    handle = module.register_forward_hook(hook) if module is not None else None
    try:
        return net.generate(**encode(tokenizer, text), **GREEDY)
    finally:
        if handle is not None:
            handle.remove()


def test_generation(gpt2, tokenizer, model):
    """test_lm.py::test_generation"""
    with model.generate(MSG, **GREEDY) as tracer:
        # deliberate difference: the generated ids are tracer.result (nnsight:
        # model.generator.output), and generate's inputs go to model.generate itself
        output = tracer.result.save()
    assert torch.equal(output, plain_generate(gpt2, tokenizer, MSG))


def test_tokenizer(gpt2, tokenizer, model):
    """``model.tokenizer`` as on nnsight's LanguageModel: what the traces tokenize text with;
    a model wrapped without one says how to give it."""
    assert model.tokenizer is tokenizer
    ids = model.tokenizer(MSG, return_tensors="pt")["input_ids"]
    with model.trace(MSG):
        logits = model.output.logits.save()
    assert_close(logits, gpt2(ids).logits)
    with pytest.raises(AttributeError, match=r"distgrad.wrap\(net, tokenizer=tokenizer\)"):
        distgrad.wrap(gpt2).tokenizer  # noqa: B018


def test_generation_with_invoke(gpt2, tokenizer, model):
    """test_lm.py::test_generation, as written there: kwargs to generate, the prompt to invoke."""
    with model.generate(**GREEDY) as tracer:
        with tracer.invoke(MSG):
            hs = model.transformer.h[-1].output.save()
    seen, _ = hooked_run(gpt2, encode(tokenizer, MSG), {"h": gpt2.transformer.h[-1]})
    assert_close(hs, seen["h"])


def test_result_in_an_invoke(gpt2, tokenizer, model):
    """test_lm.py::test_generation reads the ids inside an invoke: that invoke's rows."""
    with model.generate(**GREEDY) as tracer:
        with tracer.invoke(MSG):
            output = tracer.result.save()
    assert torch.equal(output, plain_generate(gpt2, tokenizer, MSG))


def test_save(gpt2, tokenizer, model):
    """test_lm.py::test_save: a block's input and output saved in a generate trace."""
    with model.generate("Hello world", **GREEDY):
        hs_input = model.transformer.h[-1].input.save()
        hs = model.transformer.h[-1].output.save()
    seen, _ = hooked_run(
        gpt2,
        encode(tokenizer, "Hello world"),
        {"h0": gpt2.transformer.h[0], "h1": gpt2.transformer.h[-1]},
    )
    assert hs.ndim == 3 and hs_input.ndim == 3
    assert_close(hs_input, seen["h0"])  # the last block's input is the first block's output
    assert_close(hs, seen["h1"])


def zero(out):
    return torch.zeros_like(out)


@pytest.mark.parametrize("style", ["set1", "set2", "set3"])
def test_set(gpt2, tokenizer, model, style):
    """test_lm.py::test_set1 (in-place ``[:] = 0``), ::test_set2 (assignment of
    ``wte.output * 0``), ::test_set3 (assignment of a new tensor)."""
    envoy = model.transformer.wte if style == "set2" else model.transformer.h[-1]
    module = gpt2.transformer.wte if style == "set2" else gpt2.transformer.h[-1]
    with model.generate(MSG, **GREEDY) as tracer:
        pre = envoy.output.clone().save()
        if style == "set1":
            envoy.output[:] = 0
        elif style == "set2":
            envoy.output = envoy.output * 0
        else:
            envoy.output = torch.zeros_like(envoy.output)
        post = envoy.output.save()
        logits = model.lm_head.output.save()
        output = tracer.result.save()
    assert not (pre == 0).all().item()
    assert (post == 0).all().item()
    seen, out = hooked_run(
        gpt2, encode(tokenizer, MSG), {"m": module, "head": gpt2.lm_head}, edits={"m": zero}
    )
    # generate computes the head at the last position only (transformers' logits_to_keep)
    assert_close(logits, seen["head"][:, -1:])
    assert torch.equal(output, plain_generate(gpt2, tokenizer, MSG, module, zero))


def test_set4(gpt2, tokenizer, model):
    """test_lm.py::test_set4: an edit in one invoke leaves the other's rows alone."""
    with model.trace() as tracer:
        with tracer.invoke(MSG):
            model.transformer.h[-1].output = torch.zeros_like(model.transformer.h[-1].output)
        with tracer.invoke(MSG):
            hs = model.transformer.h[-1].output.save()
            out = model.lm_head.output[0][-1].argmax(dim=-1).save()
    seen, plain = hooked_run(gpt2, encode(tokenizer, MSG), {"h": gpt2.transformer.h[-1]})
    assert torch.all(hs != 0)
    assert_close(hs, seen["h"])
    assert out == plain.logits[0, -1].argmax()


def test_set5(gpt2, tokenizer, model):
    """test_lm.py::test_set5: ``requires_grad_`` and an assignment in the first invoke."""
    with model.trace() as tracer:
        with tracer.invoke(MSG):
            model.transformer.h[0].output.requires_grad_(True)
            model.transformer.h[0].output = torch.zeros_like(model.transformer.h[0].output)
        with tracer.invoke(MSG):
            hs = model.transformer.h[0].output.save()
            out = model.lm_head.output[0][-1].argmax(dim=-1).save()
    seen, plain = hooked_run(gpt2, encode(tokenizer, MSG), {"h": gpt2.transformer.h[0]})
    assert torch.all(hs != 0)
    assert_close(hs, seen["h"])
    assert out == plain.logits[0, -1].argmax()


def test_adhoc_module(gpt2, tokenizer, model):
    """test_lm.py::test_adhoc_module: calling modules of the model on a value in the body."""
    with model.generate(MSG, **GREEDY):
        hidden_states = model.transformer.h[-1].output
        hidden_states = model.lm_head(model.transformer.ln_f(hidden_states))
        tokens = torch.softmax(hidden_states, dim=2).argmax(dim=2).save()
    _, plain = hooked_run(gpt2, encode(tokenizer, MSG), {})
    assert torch.equal(tokens, plain.logits.argmax(dim=2))


def test_embeddings_set2(gpt2, tokenizer, model):
    """test_lm.py::test_embeddings_set2: one generate's embeddings put into another's."""
    underscores = "_" * len(MSG)  # byte-level tokens: the same length as MSG
    with model.generate(MSG, **GREEDY) as tracer:
        embeddings = model.transformer.wte.output.save()
        output1 = tracer.result.save()
    with model.generate(underscores, **GREEDY) as tracer:
        model.transformer.wte.output = embeddings
        output2 = tracer.result.save()
    prompt = len(MSG) + 1  # + the tokenizer's end of sequence
    assert torch.equal(output1, plain_generate(gpt2, tokenizer, MSG))
    # MSG's embeddings at the first step: the continuation is MSG's own
    assert torch.equal(output2[:, prompt:], output1[:, prompt:])
    expected = plain_generate(
        gpt2, tokenizer, underscores, gpt2.transformer.wte, lambda out: embeddings
    )
    assert torch.equal(output2, expected)


def test_other_device_tensors(gpt2, tokenizer, model):
    """test_lm.py::test_other_device_tensors: a function of the user's own on a value."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(64, 64)
    bias = torch.randn(64)

    def fun(x):
        return torch.nn.ReLU()(lin(x) - bias)

    with model.trace("fish"):
        x = model.transformer.h[0].mlp.output
        y = fun(x)
        z = y.save()
    seen, _ = hooked_run(gpt2, encode(tokenizer, "fish"), {"mlp": gpt2.transformer.h[0].mlp})
    assert_close(z, fun(seen["mlp"]).detach())


def test_conditional_interventions(gpt2, tokenizer, model):
    """test_lm.py::test_conditional_interventions (no session)."""
    with model.trace("Hello World"):
        if torch.all(model.transformer.h[0].output < 100000):
            model.transformer.h[-1].output[:] = 0
        output = model.transformer.h[-1].output.save()
        logits = model.output.logits.save()
    assert torch.all(output == 0)
    seen, plain = hooked_run(
        gpt2, encode(tokenizer, "Hello World"), {"h": gpt2.transformer.h[-1]}, edits={"h": zero}
    )
    assert_close(logits, plain.logits)


def test_input_setting(gpt2, tokenizer, model):
    """test_lm.py::test_input_setting: a block's input from one trace set in another."""
    with model.trace(MSG):
        hs = model.transformer.h[1].inputs
        tokens_out_1 = model.lm_head.output.argmax(dim=-1).save()
    with model.trace(MSG):
        # deliberate difference: names bound in the body (``hs``, unsaved) stay real values
        model.transformer.h[1].input = hs[0][0]
        tokens_out_2 = model.lm_head.output.argmax(dim=-1).save()
    _, plain = hooked_run(gpt2, encode(tokenizer, MSG), {})
    assert torch.equal(tokens_out_1, tokens_out_2)
    assert torch.equal(tokens_out_1, plain.logits.argmax(dim=-1))


def test_out_of_order(model):
    """test_lm.py::test_out_of_order"""
    # deliberate difference: distgrad.OutOfOrderError (nnsight: Mediator.OutOfOrderError)
    with pytest.raises(distgrad.OutOfOrderError):
        with model.trace("_"):
            out = model.transformer.h[1].output.save()
            out_2 = model.transformer.h[0].inputs.save()


def test_module_called_twice_in_generate(gpt2, tokenizer, model):
    """test_lm.py::test_iter_idx, the part distgrad mirrors: a module's value at a given
    generation step, by its call index (nnsight: ``tracer.iter[i]``)."""
    with model.generate(MSG, **GREEDY):
        hs = [model.transformer.h[0].call(step).output.save() for step in range(3)]
    seen = []
    handle = gpt2.transformer.h[0].register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        plain_generate(gpt2, tokenizer, MSG)
    finally:
        handle.remove()
    # deliberate difference: steps are module calls (``.call(i)``), not tracer.iter/all/next
    for got, expected in zip(hs, seen):
        assert_close(got, expected)
