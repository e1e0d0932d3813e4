"""nnsight's tests/test_batching.py, the invokers' input formats mixed in one trace and invokes
opened in helper functions, ported to the tiny random GPT-2.

Each invoke's rows are checked against plain PyTorch on its prompt alone, at its own positions
(forward hooks; the batch is right-padded, the tokenizer's side), fp32, atol 1e-5 (a batch of
other rows changes the summation order), and the whole batch against the invokes' rows joined.
"""

import pytest
import torch
from nnsight_port import ET, MSG, assert_close, encode, hooked_run

import distgrad


@pytest.fixture
def model(gpt2, tokenizer):
    return distgrad.wrap(gpt2, tokenizer=tokenizer)


def solo(net, tokenizer, text, module=None):
    """The logits (or ``module``'s output) of ``text`` run alone."""
    seen, out = hooked_run(net, encode(tokenizer, text), {} if module is None else {"m": module})
    return out.logits if module is None else seen["m"]


def test_mixed_formats_batch_together(gpt2, tokenizer, model):
    """test_batching.py::TestInvokerInputFormats::test_mixed_formats_batch_together: text, a
    list of token ids, a 1-D tensor of token ids, a list of two texts and an empty invoke."""
    ids_list = tokenizer("the quick brown fox").input_ids
    ids_tensor = tokenizer(ET, return_tensors="pt").input_ids[0]
    with model.trace() as tracer:
        with tracer.invoke(MSG):
            a = model.lm_head.output.save()
        with tracer.invoke(ids_list):
            b = model.lm_head.output.save()
        with tracer.invoke(ids_tensor):
            c = model.lm_head.output.save()
        with tracer.invoke(["a b c", "d e"]):
            d = model.lm_head.output.save()
        with tracer.invoke():
            whole = model.lm_head.output.save()
    assert whole.shape[0] == 5 and [t.shape[0] for t in (a, b, c, d)] == [1, 1, 1, 2]
    assert torch.equal(torch.cat([a, b, c, d]), whole)
    for rows, text in (
        (a, MSG),
        (b, "the quick brown fox"),
        (c, ET),
        (d[:1], "a b c"),
        (d[1:], "d e"),
    ):
        expected = solo(gpt2, tokenizer, text)
        assert_close(rows[:, -expected.shape[1] :], expected, atol=1e-5)


def test_mixed_formats_with_an_edit(gpt2, tokenizer, model):
    """The mixed-format batch with an edit in the token-id invoke: only its row changes, as
    the same edit on that prompt alone (plain forward hooks) gives."""
    ids_list = tokenizer(ET).input_ids
    with model.trace() as tracer:
        with tracer.invoke(MSG):
            a = model.lm_head.output.save()
        with tracer.invoke(ids_list):
            model.transformer.h[0].output[:] = 0
            b = model.lm_head.output.save()
        with tracer.invoke():
            whole = model.lm_head.output.save()
    h0 = gpt2.transformer.h[0]
    _, edited = hooked_run(gpt2, encode(tokenizer, ET), {"h": h0}, {"h": lambda out: out * 0})
    assert_close(
        a[:, -solo(gpt2, tokenizer, MSG).shape[1] :], solo(gpt2, tokenizer, MSG), atol=1e-5
    )
    assert_close(b[:, -edited.logits.shape[1] :], edited.logits, atol=1e-5)
    assert torch.equal(whole, torch.cat([a, b]))


def test_helpers_do_not_share_each_others_names(gpt2, tokenizer, model):
    """test_batching.py::TestInvokeFromHelper::test_helpers_do_not_share_each_others_names"""

    def binds(tracer):
        with tracer.invoke(ET):
            secret = model.transformer.h[0].output.sum()  # noqa: F841

    saw = {}

    def reads(tracer):
        with tracer.invoke(MSG):
            model.transformer.h[1].output  # past the other invoke's bind
            try:
                saw["value"] = secret  # noqa: F821
            except NameError:
                saw["value"] = "NameError"

    with torch.no_grad():
        with model.trace() as tracer:
            binds(tracer)
            reads(tracer)
    assert saw["value"] == "NameError"


def test_invoke_opened_in_helper(gpt2, tokenizer, model):
    """test_batching.py::TestInvokeFromHelper::test_invoke_opened_in_helper"""

    def invoke(tracer, prompt, key, outs):
        with tracer.invoke(prompt):
            outs[key] = model.transformer.h[0].output.save()

    outs = {}
    with torch.no_grad():
        with model.trace() as tracer:
            invoke(tracer, ET, "a", outs)
            invoke(tracer, MSG, "b", outs)
    h0 = gpt2.transformer.h[0]
    for key, text in (("a", ET), ("b", MSG)):
        expected = solo(gpt2, tokenizer, text, h0)
        assert outs[key].shape[0] == 1
        assert_close(outs[key][:, -expected.shape[1] :], expected, atol=1e-5)


def test_helper_called_inside_invoke_sees_its_rows(gpt2, tokenizer, model):
    """test_batching.py::TestInvokeFromHelper::test_helper_called_inside_invoke_sees_its_rows"""

    def read(layer):
        return model.transformer.h[layer].output.save()

    with torch.no_grad():
        with model.trace() as tracer:
            with tracer.invoke(ET):
                first = read(0)
            with tracer.invoke([MSG, ET]):
                second = read(0)
    seen, _ = hooked_run(gpt2, encode(tokenizer, [ET, MSG, ET]), {"h": gpt2.transformer.h[0]})
    assert first.shape[0] == 1 and second.shape[0] == 2
    assert_close(torch.cat([first, second]), seen["h"], atol=1e-5)


def test_empty_invoke_opened_in_helper(gpt2, tokenizer, model):
    """test_batching.py::TestInvokeFromHelper::test_empty_invoke_opened_in_helper"""

    def whole_batch(tracer, sink):
        with tracer.invoke():
            sink["logits"] = model.lm_head.output[:, -1].save()

    sink = {}
    with torch.no_grad():
        with model.trace() as tracer:
            with tracer.invoke(ET):
                pass
            with tracer.invoke(MSG):
                pass
            whole_batch(tracer, sink)
    _, out = hooked_run(gpt2, encode(tokenizer, [ET, MSG]), {})
    assert_close(sink["logits"], out.logits[:, -1], atol=1e-5)
