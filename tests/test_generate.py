"""``model.generate(...)`` traces: the generated ids (``tracer.result``) against a plain
``net.generate`` with the same inputs and keyword arguments (greedy, so the ids are exact), with
and without a forward edit (in plain PyTorch: a raw forward hook), and the errors for reading
them where generate has not returned."""

import pytest
import torch
from conftest import TEXT

import distgrad

NEW = 5
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
PROMPTS = [
    torch.randint(2, 384, (2, 6), generator=torch.Generator().manual_seed(seed))
    for seed in range(2)
]
SHIFT = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 5


def _plain_generate(net, prompt, edit=None):
    handle = None
    if edit is not None:
        handle = net.transformer.h[0].register_forward_hook(lambda mod, args, out: edit(out))
    try:
        return net.generate(prompt, **GREEDY)
    finally:
        if handle is not None:
            handle.remove()


def test_generated_ids_are_those_of_plain_generate(gpt2):
    model = distgrad.wrap(gpt2)
    for prompt in PROMPTS:  # each trace's own ids, not those of the trace before
        with model.generate(prompt, **GREEDY) as tracer:
            first = model.transformer.h[0].output.save()
            ids = tracer.result.save()
        expected = _plain_generate(gpt2, prompt)
        assert ids.shape == (2, 6 + NEW)
        assert torch.equal(ids, expected), (ids, expected)
        assert first.shape[:2] == (2, 6)  # module values read before it: the prompt's step


def test_generated_ids_with_an_edit_at_every_step_match_a_raw_hook(gpt2):
    model = distgrad.wrap(gpt2)
    prompt = PROMPTS[0]
    with model.generate(prompt, **GREEDY) as tracer:
        for step in range(NEW):  # one call of the block per decoding step
            block = model.transformer.h[0].call(step)
            block.output = block.output + SHIFT
        ids = tracer.result.save()
    expected = _plain_generate(gpt2, prompt, edit=lambda out: out + SHIFT)
    assert not torch.equal(expected, _plain_generate(gpt2, prompt)), (
        "the edit changes no id: the comparison would prove nothing"
    )
    assert torch.equal(ids, expected), (ids, expected)


def test_generated_ids_outside_the_body_raise(gpt2):
    model = distgrad.wrap(gpt2)
    tracer = model.generate(PROMPTS[0], **GREEDY)
    with pytest.raises(distgrad.TraceStateError, match="outside the body of its trace"):
        tracer.result  # not entered: generate has not run
    with tracer:
        model.transformer.h[0].output  # noqa: B018 - the run pauses there
    with pytest.raises(distgrad.TraceStateError, match=r"ids = tracer.result.save\(\)"):
        tracer.result  # the block has ended and nothing kept them
    with model.generate(PROMPTS[1], **GREEDY) as other:
        with pytest.raises(distgrad.TraceStateError, match="outside the body of its trace"):
            tracer.result  # an earlier trace's: never this trace's ids under that name
        ids = other.result.save()
    assert torch.equal(ids, _plain_generate(gpt2, PROMPTS[1]))


def test_module_values_after_the_generated_ids_raise(gpt2):
    model = distgrad.wrap(gpt2)
    with pytest.raises(distgrad.OutOfOrderError, match="before tracer.result"):
        with model.generate(PROMPTS[0], **GREEDY) as tracer:
            tracer.result.save()
            model.transformer.h[0].output  # noqa: B018
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in gpt2.modules())


def test_generated_ids_beside_invokes_raise_and_inside_them_are_served(gpt2, tokenizer):
    """In a generate trace with invokes the trace's own body cannot read the ids (the invokes
    run after it): a clear error, nothing left behind; inside each invoke they are its rows."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(distgrad.TraceStateError, match="Read it inside an invoke"):
        with model.generate(**GREEDY) as tracer:
            with tracer.invoke(PROMPTS[0]):
                pass
            tracer.result  # noqa: B018
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in gpt2.modules())
    with model.generate(**GREEDY) as tracer:
        with tracer.invoke(PROMPTS[0]):
            ids = tracer.result.save()
    assert torch.equal(ids, _plain_generate(gpt2, PROMPTS[0]))


def test_generated_ids_in_a_forward_trace_raise(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(distgrad.TraceStateError, match="read model.output"):
        with model.trace(PROMPTS[0]) as tracer:
            tracer.result  # noqa: B018
    with pytest.raises(distgrad.TraceStateError, match="read model.output"):
        with model.trace() as tracer:
            with tracer.invoke(TEXT):
                tracer.result.save()
    with model.generate(PROMPTS[0], **GREEDY) as tracer:  # the model generates again at once
        ids = tracer.result.save()
    assert torch.equal(ids, _plain_generate(gpt2, PROMPTS[0]))
