"""What invokes take: empty invokes over the whole batch, token ids of different lengths padded
as text is, call options of the trace beside the invokes' inputs (generate), and
``invoker.inputs``. Each number against plain PyTorch on the padded batch with its mask, the
same weights (fp32, atol 1e-6 for values, 1e-5 for parameter gradients)."""

import pytest
import torch
from conftest import ATOL, param_grads, prompts

import distgrad
from distgrad.demo.models import build_tokenizer
from distgrad.interleave import batching

pytestmark = pytest.mark.usefixtures("backward_mode")

TEXTS = ["Hello world", "Paris is", "Rome isnt"]
GREEDY = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)


def _plain(net, inputs: dict, edit=None):
    """net(**inputs) with a forward hook on h[0]: (h0 output, logits, h0 gradient of
    logits.sum(), parameter gradients). ``edit(out)`` replaces the output."""
    seen = {}

    def on_output(mod, args, out):
        out = edit(out) if edit is not None else out
        out.retain_grad()
        seen["out"] = out
        return out

    net.zero_grad(set_to_none=True)
    handle = net.transformer.h[0].register_forward_hook(on_output)
    try:
        logits = net(**inputs).logits
    finally:
        handle.remove()
    logits.sum().backward()
    grads = param_grads(net)
    net.zero_grad(set_to_none=True)
    return seen["out"].detach(), logits.detach(), seen["out"].grad, grads


def _close(got, expected):
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# -- empty invokes --------------------------------------------------------------------------
def test_an_empty_invoke_sees_the_batch_as_the_invokes_before_it_left_it(gpt2, tokenizer):
    # As nnsight serves it: bodies at one value in invoke order, each seeing the edits of the
    # bodies before it (the empty invoke reads zeros in invoke 0's row, and adds 1 on top).
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            model.transformer.h[0].output = model.transformer.h[0].output * 0
            la = model.output.logits.save()
        with tr.invoke(TEXTS[1:]):
            b = model.transformer.h[0].output.save()
        with tr.invoke():
            seen = model.transformer.h[0].output.clone().save()
            model.transformer.h[0].output = model.transformer.h[0].output + 1
        with tr.invoke():
            after = model.transformer.h[0].output.clone().save()
            logits = model.output.logits.save()
    enc = prompts(tokenizer, TEXTS)
    plain, _, _, _ = _plain(gpt2, enc)

    def edit(out):
        out = out.clone()
        out[0] = 0
        return out

    zeroed, _, _, _ = _plain(gpt2, enc, edit)
    _, ref_logits, _, _ = _plain(gpt2, enc, lambda out: edit(out) + 1)
    assert seen.shape[0] == 3 and b.shape[0] == 2
    _close(seen, zeroed)
    _close(b, plain[1:])  # read before the empty invoke's edit, as nnsight shows it
    _close(after, zeroed + 1)
    _close(logits, ref_logits)
    _close(la, ref_logits[:1])


def test_an_empty_invokes_backward_reads_the_whole_batch(gpt2, tokenizer, backward_mode):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[0].output.save()
        with tr.invoke(TEXTS[1:]):
            b = model.transformer.h[0].output.save()
        with tr.invoke():
            h = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                g = h.grad.save()
    got = param_grads(gpt2)
    gpt2.zero_grad(set_to_none=True)
    out, _, grad, ref = _plain(gpt2, prompts(tokenizer, TEXTS))
    _close(a, out[:1])
    _close(b, out[1:])
    _close(g, grad)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0, msg=name)


def test_an_empty_invoke_reads_the_gradient_an_invoke_before_it_edited(
    gpt2, tokenizer, backward_mode
):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]):
            a = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                a.grad = a.grad * 10
        with tr.invoke(TEXTS[1:]):
            pass
        with tr.invoke():
            h = model.transformer.h[0].output
            with model.output.logits.sum().backward():  # one backward: the two losses summed
                g = h.grad.save()
    got = param_grads(gpt2)
    gpt2.zero_grad(set_to_none=True)
    seen = {}

    def on_output(mod, args, out):
        def on_grad(grad):
            grad = grad.clone()
            grad[0] *= 10
            seen["grad"] = grad
            return grad

        out.register_hook(on_grad)

    handle = gpt2.transformer.h[0].register_forward_hook(on_output)
    try:
        logits = gpt2(**prompts(tokenizer, TEXTS)).logits
    finally:
        handle.remove()
    (logits[:1].sum() + logits.sum()).backward()
    ref = param_grads(gpt2)
    _close(g, seen["grad"])
    gpt2.zero_grad(set_to_none=True)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0, msg=name)


def test_empty_invokes_in_a_trace_with_inputs_share_its_batch(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXTS) as tr:
        with tr.invoke():
            model.transformer.h[0].output[:, -1] = 0
        with tr.invoke():
            h = model.transformer.h[0].output.save()
            logits = model.output.logits.save()

    def edit(out):
        out = out.clone()
        out[:, -1] = 0
        return out

    enc = prompts(tokenizer, TEXTS)
    ref_h, ref_logits, _, _ = _plain(gpt2, enc, edit)
    _close(h, ref_h)
    _close(logits, ref_logits)


def test_empty_invokes_without_a_batch_raise(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(distgrad.TraceStateError, match="empty tracer.invoke"):
        with model.trace() as tr:
            with tr.invoke():
                model.transformer.h[0].output.save()
    with pytest.raises(distgrad.TraceStateError, match="already has inputs"):
        with model.trace(TEXTS) as tr:
            with tr.invoke(TEXTS[0]):
                pass


# -- token ids of different lengths ---------------------------------------------------------
ROWS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def _padded(rows, pad=0, left=False):
    """Rows padded to one length; on the left with each row's positions counted from its
    first token (nnsight's ``LanguageModel`` layout)."""
    width = max(map(len, rows))
    ids, mask = [], []
    for r in rows:
        fill = [pad] * (width - len(r))
        ids.append(fill + r if left else r + fill)
        mask.append([0] * len(fill) + [1] * len(r) if left else [1] * len(r) + [0] * len(fill))
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    if left:
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_ids_of_different_lengths_are_padded(gpt2, side, backward_mode):
    """A model that generates has its invokes padded on the left whatever the tokenizer's
    ``padding_side`` (as nnsight's ``LanguageModel`` sets it), each row at its own positions."""
    tokenizer = build_tokenizer()  # its own: the shared fixture keeps its padding side
    tokenizer.padding_side = side
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(ROWS[0]) as first:  # a list of ints: one row
            a = model.transformer.h[0].output.save()
            with model.output.logits.sum().backward():
                ga = a.grad.save()
        with tr.invoke(torch.tensor(ROWS[1])):  # a 1-D tensor: one row
            b = model.transformer.h[0].output.save()
            with model.output.logits.sum().backward():  # one backward, over the three losses
                pass
        with tr.invoke(input_ids=[ROWS[2]]) as third:  # a list of rows, by keyword
            c = model.transformer.h[0].output.save()
            lc = model.output.logits.save()
            with lc.sum().backward():
                gc = c.grad.save()
    assert tokenizer.padding_side == side  # the tokenizer is left as it was
    got = param_grads(gpt2)
    batch = _padded(ROWS, left=True)
    out, logits, grad, ref = _plain(gpt2, batch)
    for got_h, rows in ((a, slice(0, 1)), (b, slice(1, 2)), (c, slice(2, 3))):
        assert got_h.shape == (1, 5, 64)  # the padded rows, as the model ran them
        _close(got_h, out[rows])
    _close(lc, logits[2:])
    _close(ga, grad[:1])
    _close(gc, grad[2:])
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0, msg=name)
    # ids positional in some invokes and by keyword in others: all are passed as input_ids=
    assert first.inputs[0] == () and torch.equal(
        first.inputs[1]["input_ids"], batch["input_ids"][:1]
    )
    assert torch.equal(first.inputs[1]["attention_mask"], batch["attention_mask"][:1])
    assert torch.equal(first.inputs[1]["position_ids"], batch["position_ids"][:1])
    assert torch.equal(third.inputs[1]["input_ids"], batch["input_ids"][2:])
    assert first.args == (ROWS[0],) and third.kwargs == {"input_ids": [ROWS[2]]}


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_model_that_does_not_generate_is_padded_on_the_tokenizers_side(gpt2, side):
    """GPT-2's body alone (``GPT2Model`` cannot generate): its invokes are padded where the
    tokenizer pads; rows padded on the left still count their positions from their first
    token."""
    tokenizer = build_tokenizer()
    tokenizer.padding_side = side
    model = distgrad.wrap(gpt2.transformer, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(ROWS[0]):
            a = model.h[0].output.save()
        with tr.invoke(ROWS[1]):
            b = model.h[0].output.save()
    batch = _padded(ROWS[:2], left=side == "left")
    seen = []
    handle = gpt2.transformer.h[0].register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        with torch.no_grad():
            gpt2.transformer(**batch)
    finally:
        handle.remove()
    _close(torch.cat([a, b]), seen[0])


def test_text_and_token_ids_in_one_batch(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    text_ids = tokenizer(TEXTS[1])["input_ids"]
    masked = torch.tensor([[1, 1, 0]])  # an invoke's own mask is padded with zeros
    with model.trace() as tr:
        with tr.invoke(TEXTS[1]):
            a = model.output.logits.save()
        with tr.invoke(torch.tensor([ROWS[0]]), attention_mask=masked):
            b = model.output.logits.save()
    batch = _padded([text_ids, ROWS[0]], left=True)
    batch["attention_mask"][1, -3:] = masked[0]
    # a mask with a gap is not left padding: that row keeps the positions the model counts,
    # and the other is not padded, so none are passed (as nnsight's LanguageModel does)
    del batch["position_ids"]
    _, logits, _, _ = _plain(gpt2, batch)
    _close(a, logits[:1])
    _close(b, logits[1:])


def test_ids_that_cannot_be_padded_raise(gpt2, mlp):
    model = distgrad.wrap(gpt2)  # no tokenizer: no pad id
    with pytest.raises(ValueError, match="no tokenizer to pad them with"):
        with model.trace() as tr:
            with tr.invoke(input_ids=torch.tensor([ROWS[0]])):
                model.output.save()
            with tr.invoke(input_ids=torch.tensor([ROWS[1]])):
                pass
    with pytest.raises(ValueError, match="tokenizer=...\\)"):
        with model.trace() as tr:  # positional ids are ids only with a tokenizer
            with tr.invoke(torch.tensor([ROWS[0]])):
                pass
            with tr.invoke(torch.tensor([ROWS[1]])):
                pass
    no_pad = build_tokenizer()
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="tokenizer has no pad token"):
        with distgrad.wrap(gpt2, tokenizer=no_pad).trace() as tr:
            with tr.invoke(ROWS[0]):
                pass
            with tr.invoke(ROWS[1]):
                pass
    with pytest.raises(ValueError, match="pad them to one length"):
        with distgrad.wrap(mlp).trace() as tr:  # features, not ids: nothing to pad with
            with tr.invoke(torch.randn(2, 8)):
                pass
            with tr.invoke(torch.randn(1, 5)):
                pass


# -- call options beside the invokes' inputs ------------------------------------------------
def test_generate_with_invokes_matches_plain_generate_on_the_batch(gpt2):
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"  # as generate wants a batch of prompts padded
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.generate(**GREEDY) as tr:
        with tr.invoke(ROWS[0]):
            h = model.transformer.h[0].output.save()  # the prompt's step
            first = tr.result.save()
        with tr.invoke([ROWS[1], ROWS[2]]):
            rest = tr.result.save()
    batch = _padded(ROWS, left=True)
    steps = []  # h[0]'s output at each step of plain generate (positions from the mask)
    handle = gpt2.transformer.h[0].register_forward_hook(lambda m, a, out: steps.append(out))
    try:
        expected = gpt2.generate(**batch, **GREEDY)
    finally:
        handle.remove()
    assert expected.shape == (3, 5 + GREEDY["max_new_tokens"])
    assert torch.equal(first, expected[:1]) and torch.equal(rest, expected[1:])
    _close(h, steps[0][:1])


def test_trace_options_pass_to_the_call(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    # (not output_hidden_states=True: transformers then leaves hooks of its own on the model)
    with model.trace(return_dict=False) as tr:
        with tr.invoke(TEXTS[0]):
            output = distgrad.save(model.output)
        with tr.invoke(TEXTS[1:]):
            pass
    _, logits, _, _ = _plain(gpt2, prompts(tokenizer, TEXTS))
    assert isinstance(output, tuple)  # the option reached the call
    _close(output[0], logits[:1])
    with pytest.raises(ValueError, match="return_dict= is passed"):
        with model.trace(return_dict=False) as tr:
            with tr.invoke(TEXTS[0], return_dict=True):
                pass
    with pytest.raises(NotImplementedError, match="num_beams=2"):
        with model.generate(num_beams=2, **GREEDY) as tr:
            with tr.invoke(TEXTS[0]):
                pass


# -- invoker.inputs -------------------------------------------------------------------------
def test_invoker_inputs_are_its_rows_of_the_tokenized_batch(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tr:
        with tr.invoke(TEXTS[0]) as first:
            ids = distgrad.save(first.inputs[1]["input_ids"])
        with tr.invoke(TEXTS[1:]) as second:
            pass
        with pytest.raises(distgrad.TraceStateError, match="once the invokes' inputs are joined"):
            second.inputs  # noqa: B018 - between the invoke blocks: not joined yet
        with tr.invoke() as whole:
            pass
    enc = prompts(tokenizer, TEXTS)
    keys = {"input_ids", "attention_mask", "position_ids"}
    assert first.inputs[0] == () and first.inputs[1].keys() == keys
    assert torch.equal(ids, enc["input_ids"][:1])
    for key in keys:
        assert torch.equal(second.inputs[1][key], enc[key][1:])
        assert torch.equal(whole.inputs[1][key], enc[key])
    assert second.args == (TEXTS[1:],) and whole.args == () and whole.kwargs == {}


def test_tokenizer_keywords_reach_the_tokenizer(gpt2, tokenizer):
    """Keywords beside text that the tokenizer takes go to it (a trace and an invoke alike);
    ``max_length`` alone stays an option of the call (generate's), with ``truncation`` it
    bounds the text."""
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    text = "The Eiffel Tower is in"
    plain = dict(tokenizer([text], return_tensors="pt", add_special_tokens=False))
    with model.trace(text, add_special_tokens=False):
        ids = model.transformer.wte.input.save()
        logits = model.output.logits.save()
    assert torch.equal(ids, plain["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(logits, gpt2(**plain).logits, atol=ATOL, rtol=0)
    with model.trace() as tr:
        with tr.invoke(text, truncation=True, max_length=5):
            short = model.transformer.wte.input.save()
    assert short.shape == (1, 5)
    assert batching.tokenizer_options(tokenizer, {"max_length": 9, "do_sample": False}) == (
        {},
        {"max_length": 9, "do_sample": False},
    )
