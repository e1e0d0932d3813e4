"""nnsight's tests/test_batching.py (invokes and batching), ported to the tiny random GPT-2 and
the MLP of nnsight_port.py.

Each invoke's values are checked against plain PyTorch on the same padded batch, or on the
prompt alone at its own positions (forward hooks), fp32, atol 1e-6 (1e-5 where a batch of other
rows changes the summation order). Barrier, cache, skip, iter and pipe tests are not ported
(see nnsight_port.py).
"""

import pytest
import torch
from nnsight_port import ET, MSG, assert_close, encode, hooked_run, mlp

import distgrad

P1 = "the cat sat"
P2 = "a much longer prompt appears here"


@pytest.fixture
def model(gpt2, tokenizer):
    return distgrad.wrap(gpt2, tokenizer=tokenizer)


def logits_of(net, tokenizer, text):
    return hooked_run(net, encode(tokenizer, text), {})[1].logits


def test_batched_matches_solo_logits(gpt2, tokenizer, model):
    """test_batching.py::TestTraceBatching::test_batched_matches_solo_logits"""
    with model.trace() as tracer:
        with tracer.invoke(P1):
            b1 = model.output.logits.save()
        with tracer.invoke(P2):
            b2 = model.output.logits.save()
    # as in nnsight, the shorter prompt is padded on the left, its tokens at their own positions
    solo1, solo2 = logits_of(gpt2, tokenizer, P1), logits_of(gpt2, tokenizer, P2)
    assert b1.shape[1] == b2.shape[1] == solo2.shape[1]
    assert_close(b1[:, -solo1.shape[1] :], solo1, atol=1e-5)
    assert_close(b2, solo2, atol=1e-5)


def test_each_invoke_sees_its_own_rows(gpt2, tokenizer, model):
    """test_batching.py::TestTraceBatching::test_each_invoke_sees_its_own_rows"""
    with model.trace() as tracer:
        with tracer.invoke(P1):
            a = model.transformer.h[0].output.save()
        with tracer.invoke(P2):
            b = model.transformer.h[0].output.save()
    seen, _ = hooked_run(gpt2, encode(tokenizer, [P1, P2]), {"h": gpt2.transformer.h[0]})
    assert a.shape[0] == b.shape[0] == 1 and a.shape[1] == b.shape[1]
    assert_close(torch.cat([a, b]), seen["h"])


def test_edit_is_isolated_to_its_invoke(gpt2, tokenizer, model):
    """test_batching.py::TestTraceBatching::test_edit_is_isolated_to_its_invoke"""
    with model.trace() as tracer:
        with tracer.invoke(P1):
            model.transformer.h[0].output[:] = 0
            edited = model.transformer.h[0].output.save()
        with tracer.invoke(P1):
            other = model.transformer.h[0].output.save()
    seen, _ = hooked_run(gpt2, encode(tokenizer, P1), {"h": gpt2.transformer.h[0]})
    assert torch.all(edited == 0)
    assert_close(other, seen["h"])


def test_edit_changes_only_its_prediction(gpt2, tokenizer, model):
    """test_batching.py::TestTraceBatching::test_edit_changes_only_its_prediction"""
    with model.trace() as tracer:
        with tracer.invoke(P1):
            model.transformer.wte.output[:] = 0
            zeroed = model.output.logits[0, -1].save()
        with tracer.invoke(P1):
            intact = model.output.logits[0, -1].save()
    base = logits_of(gpt2, tokenizer, P1)[0, -1]
    _, edited = hooked_run(
        gpt2, encode(tokenizer, P1), {"wte": gpt2.transformer.wte}, edits={"wte": torch.zeros_like}
    )
    assert not torch.allclose(zeroed, base, atol=1e-3)
    assert_close(zeroed, edited.logits[0, -1], atol=1e-5)
    assert_close(intact, base, atol=1e-5)


def test_three_invokes(gpt2, tokenizer, model):
    """test_batching.py::TestTraceBatching::test_three_invokes"""
    prompts = ("one two", "three four five", "six")
    with model.trace() as tracer:
        outs = distgrad.save([])
        for prompt in prompts:
            with tracer.invoke(prompt):
                outs.append(model.transformer.h[0].output)
    seen, _ = hooked_run(gpt2, encode(tokenizer, list(prompts)), {"h": gpt2.transformer.h[0]})
    assert len(outs) == 3
    assert_close(torch.cat(outs), seen["h"])


def test_empty_invoke_sees_whole_batch(gpt2, tokenizer, model):
    """test_batching.py::TestTraceBatching::test_empty_invoke_sees_whole_batch"""
    with model.trace() as tracer:
        with tracer.invoke(P1):
            pass
        with tracer.invoke(P2):
            pass
        with tracer.invoke():
            whole = model.output.logits.save()
    assert_close(whole, logits_of(gpt2, tokenizer, [P1, P2]))


def test_invoker_group_batching(model):
    """test_batching.py::TestInvokerGrouping::test_invoker_group_batching"""
    with model.trace() as tracer:
        with tracer.invoke(ET):
            o1 = model.lm_head.output[:, -1].save()
        with tracer.invoke([MSG, ET]):
            o2 = model.lm_head.output[:, -1].save()
        with tracer.invoke():
            o3 = model.lm_head.output[:, -1].save()
        with tracer.invoke(MSG):
            o5 = model.lm_head.output[:, -1].save()
    assert [o.shape[0] for o in (o1, o2, o3, o5)] == [1, 2, 4, 1]
    assert torch.equal(torch.cat([o1, o2, o5]), o3)


def test_no_input_and_no_invoke_raises(model):
    """test_batching.py::TestBatchingErrors::test_no_input_and_no_invoke_raises"""
    with pytest.raises(ValueError, match="invoke"):
        with model.trace():
            pass


def test_invoke_while_running_raises(model):
    """test_batching.py::TestBatchingErrors::test_invoke_while_running_raises"""
    with pytest.raises(ValueError):
        with model.trace() as tracer:
            with tracer.invoke(P1):
                with tracer.invoke(P2):
                    pass


def test_plain_model_batches():
    """test_batching.py::TestBatchingErrors::test_plain_model_cannot_batch"""
    net = mlp()
    model = distgrad.wrap(net)
    xa, xb = torch.randn(2, 8), torch.randn(3, 8)
    # deliberate difference: invokes of tensors are joined along dim 0 for any module
    # (nnsight raises NotImplementedError for a model without batching)
    with model.trace() as tracer:
        with tracer.invoke(xa):
            a = model.fc1.output.save()
        with tracer.invoke(xb):
            b = model.output.save()
    assert_close(a, net.fc1(xa).detach())
    assert_close(b, net(xb).detach())


def test_name_bound_in_one_invoke_reads_in_the_next(model):
    """test_batching.py::TestInvokeScope::test_name_bound_in_one_invoke_reads_in_the_next"""
    with model.trace() as tracer:
        with tracer.invoke(ET):
            first = model.transformer.h[0].output
            first_sum = first.sum().save()
        with tracer.invoke(MSG):
            second = model.transformer.h[1].output
            second_sum = second.sum().save()
            crossed = (first.sum() + second.sum()).save()
    assert torch.allclose(crossed, first_sum + second_sum)


def test_crossed_value_is_the_earlier_invokes_rows(gpt2, tokenizer, model):
    """test_batching.py::TestInvokeScope::test_crossed_value_is_the_earlier_invokes_rows"""
    with model.trace() as tracer:
        with tracer.invoke(ET):
            first = model.transformer.h[0].output
        with tracer.invoke([MSG, ET]):
            mine = model.transformer.h[1].output.save()
            crossed = first.clone().save()
    seen, _ = hooked_run(
        gpt2,
        encode(tokenizer, [ET, MSG, ET]),
        {"h0": gpt2.transformer.h[0], "h1": gpt2.transformer.h[1]},
    )
    assert_close(crossed, seen["h0"][:1])
    assert_close(mine, seen["h1"][1:])


def test_loop_variable_binds_per_invoke(model):
    """test_batching.py::TestInvokeScope::test_loop_variable_binds_per_invoke"""
    seen = []
    with model.trace() as tracer:
        for prompt in (ET, MSG):
            with tracer.invoke(prompt):
                seen.append(prompt)
    assert seen == [ET, MSG]


def test_outer_name_survives_the_trace(model):
    """test_batching.py::TestInvokeScope::test_outer_name_survives_the_trace"""
    keep = "untouched"
    with model.trace(ET):
        model.transformer.h[0].output.save()
    assert keep == "untouched"


def test_name_bound_in_invoke_is_visible_after_the_trace(model):
    """test_batching.py::TestInvokeScope::test_name_bound_in_invoke_is_visible_after_the_trace"""
    with model.trace() as tracer:
        with tracer.invoke(ET):
            inside = model.transformer.h[0].output.save()
            unsaved = model.transformer.h[0].output * 2
    assert isinstance(inside, torch.Tensor) and inside.shape[0] == 1
    # deliberate difference: an unsaved name of an invoke body raises NotSavedError on use
    with pytest.raises(distgrad.NotSavedError):
        unsaved.shape


def test_read_before_the_bind_raises(model):
    """test_batching.py::TestInvokeScope::test_read_before_the_bind_raises"""
    with pytest.raises(NameError):
        with model.trace() as tracer:
            with tracer.invoke(ET):
                first = model.transformer.h[0].output
            with tracer.invoke(MSG):
                crossed = first.clone().save()


def test_list_and_invoke_attention_masks_match(model):
    """test_batching.py::TestInvokerGrouping::test_list_and_invoke_attention_masks_match,
    each invoke reading its own rows (its empty whole-batch invoke is pending)."""
    prompts = ["Hi", "A B C", "D"]
    with model.trace(prompts):
        ground_truth = model.lm_head.output.save()
    with model.trace() as tracer:
        with tracer.invoke("Hi"):
            first = model.lm_head.output.save()
        with tracer.invoke(["A B C", "D"]):
            rest = model.lm_head.output.save()
    assert torch.equal(torch.cat([first, rest]), ground_truth)


def test_batched_positions_match_single_prompt(gpt2, tokenizer, model):
    """test_batching.py::TestInvokerGrouping::test_batched_positions_match_single_prompt"""
    short, long = "Hello world", ET
    with model.trace([short, long]):
        batched = model.lm_head.output.save()
    alone = logits_of(gpt2, tokenizer, short)
    # as in nnsight: padded on the left, each prompt's tokens at their own positions
    assert batched[0, -1].argmax() == alone[0, -1].argmax()
    assert_close(batched[:1, -alone.shape[1] :], alone, atol=1e-5)
    assert batched[1, -1].argmax() == logits_of(gpt2, tokenizer, long)[0, -1].argmax()


def test_cross_invoke_isolation(gpt2, tokenizer, model):
    """test_batching.py::TestInvokerGrouping::test_cross_invoke_isolation"""
    with model.trace() as tracer:
        with tracer.invoke(MSG):
            model.transformer.h[-1].output[:] = 0
        with tracer.invoke(MSG):
            hidden = model.transformer.h[-1].output.save()
            token = model.lm_head.output[0][-1].argmax(dim=-1).save()
    assert torch.all(hidden != 0)
    assert token == logits_of(gpt2, tokenizer, MSG)[0, -1].argmax()


def test_pretokenized_invoke_matches_string(gpt2, tokenizer, model):
    """test_batching.py::TestInvokerInputFormats::test_pretokenized_invoke_matches_string"""
    ids = tokenizer(MSG, return_tensors="pt").input_ids
    with model.trace() as tracer:
        with tracer.invoke(ids):
            a = model.lm_head.output[0, -1].save()
        with tracer.invoke(ET):
            pass
    # MSG is the longer prompt: its row has no padding, so its last logits are MSG's alone
    assert_close(a, logits_of(gpt2, tokenizer, MSG)[0, -1], atol=1e-5)


def test_ragged_token_id_invokes(gpt2, tokenizer, model):
    """test_batching.py::TestInvokerInputFormats::test_mixed_formats_batch_together, its
    token-id invokes of different lengths"""
    ids_a = tokenizer(ET, return_tensors="pt").input_ids
    ids_b = tokenizer(MSG, return_tensors="pt").input_ids
    with model.trace() as tracer:
        with tracer.invoke(ids_a):
            a = model.lm_head.output.save()
        with tracer.invoke(ids_b):
            b = model.lm_head.output.save()
    assert_close(a[:, -ids_a.shape[1] :], logits_of(gpt2, tokenizer, ET), atol=1e-5)
    assert_close(b, logits_of(gpt2, tokenizer, MSG), atol=1e-5)


def test_per_invoke_truncation(gpt2, tokenizer, model):
    """test_batching.py::TestInvokerInputFormats::test_per_invoke_truncation: the tokenizer's
    keywords reach the tokenizer (the rest go to the model's call)."""
    with model.trace() as tracer:
        with tracer.invoke("word " * 50, truncation=True, max_length=4):
            short = model.transformer.h[0].output.save()
    assert short.shape[1] == 4
    enc = dict(tokenizer(["word " * 50], return_tensors="pt", truncation=True, max_length=4))
    seen, _ = hooked_run(gpt2, enc, {"h": gpt2.transformer.h[0]})
    assert_close(short, seen["h"])


def test_invoker_inputs(tokenizer, model):
    """nnsight's ``invoker.inputs``: the invoke's inputs as the model receives them."""
    with model.trace() as tracer:
        with tracer.invoke(MSG) as invoker:
            inputs = distgrad.save(invoker.inputs)
    args, kwargs = inputs
    assert torch.equal(kwargs["input_ids"], tokenizer(MSG, return_tensors="pt").input_ids)
