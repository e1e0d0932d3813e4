"""Invokes of different lengths give nnsight's numbers: each prompt as it runs alone.

nnsight's ``LanguageModel`` pads a decoder's invokes on the left and passes ``position_ids``
counted from each row's first token, so that in every invoke ``model.lm_head.output[:, -1]``
is that prompt's last token, at the position it has alone. distgrad lays invokes out the same
way (``interleave/token_ids.py``). Each program here runs three ways on the same weights: in
distgrad, in nnsight 0.8.1 itself (``nnsight.LanguageModel`` around the same model built
afresh, with a tokenizer of its own, since nnsight sets its ``padding_side``; in a fresh
process, ``nnsight_job.py``) and, per prompt, alone in plain PyTorch (forward hooks,
``torch.autograd.grad``, ``generate``). On the tiny GPT-2 (absolute
positions: the ``position_ids`` matter) and the tiny Llama (rotary positions). fp32, rtol 1e-5
(atol 1e-6, and for gradients 1e-5 of their largest entry: the batch and the prompt alone sum
in different orders); distgrad and nnsight agree to the same tolerance.
"""

import importlib.util

import pytest
import torch
from conftest import NETS, run_in_nnsight

import distgrad
from distgrad.demo.models import build_tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nnsight") is None, reason="nnsight is not installed"
)

TOL = dict(rtol=1e-5, atol=1e-6)
LONG, SHORT = "The Eiffel Tower is in", "Hi"
IDS = [[40, 72, 101, 33, 8, 200, 17], [99, 12, 250], [40, 72]]  # no end-of-text id: they go on
GREEDY = dict(max_new_tokens=4, do_sample=False)


@pytest.fixture(params=["gpt2", "llama"])
def name(request):
    return request.param


@pytest.fixture
def net(name):
    return NETS[name]()


@pytest.fixture(scope="module")
def theirs():
    return run_in_nnsight(__name__)


def nnsight_numbers(nnsight) -> dict:
    """This module's programs run by nnsight (in ``nnsight_job.py``'s process), per model."""
    numbers = {}
    for name, build in NETS.items():
        model = nnsight.LanguageModel(build(), tokenizer=build_tokenizer())
        numbers[name] = {
            "text": _last_tokens(model, nnsight.save, [LONG, SHORT]),
            "ids": _last_tokens(model, nnsight.save, IDS),
            "edit": _edited_and_grad(model, nnsight.save, [LONG, SHORT]),
            "generate": _generated(model, nnsight.save, IDS),
        }
    return numbers


def _alone(net, tokenizer, prompt, module=None, edit=None):
    """``prompt`` alone: (last-token logits, ``module``'s output, and the gradient of the
    last-token logits' sum with respect to it), with ``edit`` applied to that output."""
    if isinstance(prompt, str):
        inputs = dict(tokenizer([prompt], return_tensors="pt"))
    else:
        inputs = {"input_ids": torch.tensor([prompt])}
    seen = {}

    def hook(mod, args, out):
        out = edit(out) if edit is not None else out
        seen["h"] = out
        return out

    handle = (module or net.lm_head).register_forward_hook(hook)
    try:
        logits = net(**inputs).logits
    finally:
        handle.remove()
    last = logits[:, -1]
    grad = torch.autograd.grad(last.sum(), seen["h"])[0]
    return last.detach(), seen["h"].detach(), grad


def _blocks(model):
    """The decoder blocks: GPT-2's ``transformer.h``, Llama's ``model.layers``."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _last_tokens(model, save, prompts):
    with model.trace() as tracer:
        outs = save([])
        for prompt in prompts:
            with tracer.invoke(prompt):
                outs.append(model.lm_head.output[:, -1])
    return outs


@pytest.mark.parametrize("form", ["text", "ids"])
def test_each_invokes_last_token_is_its_prompts(name, net, tokenizer, theirs, form):
    prompts = [LONG, SHORT] if form == "text" else IDS
    model = distgrad.wrap(net, tokenizer=tokenizer)
    got = _last_tokens(model, distgrad.save, prompts)
    for prompt, mine, nn_value in zip(prompts, got, theirs[name][form]):
        alone = _alone(net, tokenizer, prompt)[0]
        torch.testing.assert_close(mine, alone, **TOL)
        torch.testing.assert_close(mine, nn_value, **TOL)


def _edited_and_grad(model, save, prompts):
    """Zero the short prompt's last token at block 0; its last-token logits and the gradient
    reaching block 0 of their sum, and the long prompt's logits."""
    with model.trace() as tracer:
        with tracer.invoke(prompts[0]):
            long_last = save(model.lm_head.output[:, -1])
        with tracer.invoke(prompts[1]):
            block = _blocks(model)[0]
            block.output[:, -1] = 0
            h = block.output
            last = model.lm_head.output[:, -1]
            short_last = save(last)
            with last.sum().backward():
                grad = save(h.grad)
    return long_last, short_last, grad


def test_an_edit_and_a_gradient_in_the_shorter_invoke(name, net, tokenizer, theirs):
    prompts = [LONG, SHORT]
    model = distgrad.wrap(net, tokenizer=tokenizer)
    got = _edited_and_grad(model, distgrad.save, prompts)

    def zero_last(out):
        out = out.clone()
        out[:, -1] = 0
        return out

    block = _blocks(net)[0]
    short_last, _, grad = _alone(net, tokenizer, SHORT, block, zero_last)
    n = grad.shape[1]
    torch.testing.assert_close(got[0], _alone(net, tokenizer, LONG)[0], **TOL)
    torch.testing.assert_close(got[1], short_last, **TOL)
    # the prompt's own positions; the gradient reaches a few hundred, so its rounding between
    # the batch and the prompt alone is held to 1e-5 of its largest entry
    scale = grad.abs().max().item()
    torch.testing.assert_close(got[2][:, -n:], grad, rtol=1e-5, atol=1e-5 * scale)
    assert torch.all(got[2][:, :-n] == 0)  # padding: masked, no gradient
    assert len(theirs[name]["edit"]) == 3
    for mine, nn_value in zip(got, theirs[name]["edit"]):
        torch.testing.assert_close(mine, nn_value, **TOL)


def _generated(model, save, prompts):
    with model.generate(**GREEDY) as tracer:
        outs = save([])
        for prompt in prompts:
            with tracer.invoke(prompt):
                outs.append(tracer.result)
    return outs


def test_batched_generate_continues_each_prompt(name, net, tokenizer, theirs):
    model = distgrad.wrap(net, tokenizer=tokenizer)
    got = _generated(model, distgrad.save, IDS)
    for prompt, mine, nn_ids in zip(IDS, got, theirs[name]["generate"]):
        ids = torch.tensor([prompt])
        alone = net.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **GREEDY)
        assert torch.equal(mine[:, -GREEDY["max_new_tokens"] :], alone[:, len(prompt) :])
        assert torch.equal(mine, nn_ids)


def test_the_tokenizers_padding_side_is_left_as_it_is(gpt2):
    """A decoder's invokes are padded on the left whatever the tokenizer's ``padding_side``
    (as nnsight's ``LanguageModel`` sets it), and the tokenizer is not changed."""
    tokenizer = build_tokenizer()
    assert tokenizer.padding_side == "right"
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke(LONG):
            pass
        with tracer.invoke(SHORT) as short:
            pass
    mask = short.inputs[1]["attention_mask"]
    n = len(tokenizer(SHORT)["input_ids"])
    assert mask[0, -n:].all() and not mask[0, :-n].any()
    assert torch.equal(short.inputs[1]["position_ids"][0, -n:], torch.arange(n))
    assert tokenizer.padding_side == "right"


def test_a_padding_side_beside_the_text_is_the_tokenizers(gpt2, tokenizer):
    """``padding_side="right"`` given with the text goes to the tokenizer: the rows are padded
    on the right and the model counts their positions, as ``net(**tokenizer(..., padding_side=
    "right"))`` runs them."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke(LONG, padding_side="right"):
            pass
        with tracer.invoke(SHORT, padding_side="right") as short:
            logits = model.output.logits.save()
    assert "position_ids" not in short.inputs[1]
    enc = tokenizer([LONG, SHORT], return_tensors="pt", padding=True, padding_side="right")
    with torch.no_grad():
        expected = gpt2(**enc).logits[1:]
    torch.testing.assert_close(logits, expected, **TOL)
    assert not short.inputs[1]["attention_mask"][0, -1]  # padded at the end


class CallWithoutPaddingSide(type(build_tokenizer())):
    """A tokenizer whose call takes no ``padding_side`` (as before transformers 4.45): it pads
    on its ``padding_side`` attribute."""

    def __call__(self, text, padding=False, return_tensors=None, **kwargs):
        return super().__call__(text, padding=padding, return_tensors=return_tensors, **kwargs)


def test_a_tokenizer_without_padding_side_in_its_call(gpt2):
    tokenizer = CallWithoutPaddingSide()
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    got = _last_tokens(model, distgrad.save, [LONG, SHORT])
    assert tokenizer.padding_side == "right"  # set for the call only
    for prompt, mine in zip([LONG, SHORT], got):
        torch.testing.assert_close(mine, _alone(gpt2, tokenizer, prompt)[0], **TOL)
