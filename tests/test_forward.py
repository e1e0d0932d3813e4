"""Forward values: reads, edits, inputs, repeated modules, paths, and their errors."""

import pytest
import torch
from conftest import ATOL, TEXT, prompts

import distgrad

# every read and edit in every body mode (generator, in place, in place with a threaded backward)
pytestmark = pytest.mark.usefixtures("backward_mode")


def _enc(tokenizer, text=TEXT):
    return dict(
        tokenizer([text] if isinstance(text, str) else text, return_tensors="pt", padding=True)
    )


def _plain_output(net, module, inputs, edit=None):
    seen = {}

    def hook(mod, args, out):
        seen["out"] = out
        return edit(out) if edit else None

    h = module.register_forward_hook(hook)
    with torch.no_grad():
        final = net(**inputs) if isinstance(inputs, dict) else net(inputs)
    h.remove()
    return seen["out"], final


def test_output_read_is_the_real_value(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXT):
        mlp = model.transformer.h[1].mlp.output.save()
        logits = model.output.logits.save()
    ref_mlp, ref = _plain_output(gpt2, gpt2.transformer.h[1].mlp, _enc(tokenizer))
    torch.testing.assert_close(mlp, ref_mlp, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("style", ["assign", "inplace"])
def test_output_edit_flows_on(gpt2, tokenizer, style):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXT):
        if style == "assign":
            model.transformer.h[0].output = model.transformer.h[0].output * 0.5
        else:
            model.transformer.h[0].output[:, 0] = 0
        logits = model.output.logits.save()

    def edit(out):
        out = out.clone()
        if style == "assign":
            return out * 0.5
        out[:, 0] = 0
        return out

    _, ref = _plain_output(gpt2, gpt2.transformer.h[0], _enc(tokenizer), edit)
    torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=0)


def test_input_and_inputs(mlp):
    x = torch.randn(3, 8)
    model = distgrad.wrap(mlp)
    with model.trace(x):
        first = model[2].input.save()
        args, kwargs = model[2].inputs
        model[4].input = torch.zeros(3, 16)
        out = model.output.save()
    torch.testing.assert_close(first, torch.tanh(mlp[0](x)), atol=ATOL, rtol=0)
    assert args[0] is first and kwargs == {}
    torch.testing.assert_close(out, mlp[4].bias.expand(3, 4), atol=ATOL, rtol=0)


def test_inputs_assignment_and_root_input_by_keyword(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    enc = _enc(tokenizer)
    with model.trace(TEXT):
        ids = model.input.save()  # the root is called with keywords only
        args, kwargs = model.transformer.h[1].inputs
        model.transformer.h[1].inputs = ((args[0] * 0,), kwargs)
        logits = model.output.logits.save()
    assert torch.equal(ids, enc["input_ids"])
    _, ref = _plain_output(gpt2, gpt2.transformer.h[0], enc, edit=lambda o: o * 0)
    torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=0)


class Looped(torch.nn.Module):
    """One layer applied three times, and a ModuleDict."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(4, 3)})

    def forward(self, x):
        for _ in range(3):
            x = torch.relu(self.layer(x))
        return self.heads["a"](x), self.heads["b"](x)


def test_repeated_calls_and_module_dict():
    torch.manual_seed(0)
    net, x = Looped(), torch.randn(2, 4)
    outs = []
    hook = net.layer.register_forward_hook(lambda m, a, o: outs.append(o.detach()))
    with torch.no_grad():
        ref_a, ref_b = net(x)
    hook.remove()
    model = distgrad.wrap(net)
    with model.trace(x):
        c0 = model.layer.output.save()
        again = model.layer.output  # paused at this call: the same value
        c2 = model.layer.call(2).output.save()
        b = model.heads["b"].output.save()
        a_out, _ = model.output
    assert again is c0
    torch.testing.assert_close(c0, outs[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(c2, outs[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(b, ref_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(a_out, ref_a, atol=ATOL, rtol=0)

    with model.trace(x):
        model.layer.call(1).output = torch.zeros(2, 4)
        a_out, b_out = model.output
    torch.testing.assert_close(
        b_out, net.heads["b"](torch.relu(net.layer(torch.zeros(2, 4)))), atol=ATOL, rtol=0
    )


class _Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x, self.y = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, h):
        return self.y(self.x(h))


class _SharedTwice(torch.nn.Module):
    """One block instance under two parents: model.A[0] and model.B[0] are the same module."""

    def __init__(self):
        super().__init__()
        shared = _Pair()
        self.A = torch.nn.Sequential(shared, torch.nn.ReLU())
        self.B = torch.nn.Sequential(shared, torch.nn.Tanh())

    def forward(self, h):
        return self.B(self.A(h))


def test_enclosing_outputs_of_a_module_shared_by_two_parents():
    """Reading inside the shared block through B must still hook B itself before the run
    enters it, although the block's own ancestors through A were hooked already."""
    torch.manual_seed(0)
    net, x = _SharedTwice(), torch.randn(2, 4)
    model = distgrad.wrap(net)
    with model.trace(x):
        model.A[0].x.output  # hooks A[0] (the shared block), A, the root
        y1 = model.B[0].y.call(1).output.save()  # y's second call, inside B
        b = model.B.output.save()
    with torch.no_grad():
        a = net.A(x)
        torch.testing.assert_close(y1, net.B[0].y(net.B[0].x(a)), atol=ATOL, rtol=0)
        torch.testing.assert_close(b, net.B(a), atol=ATOL, rtol=0)


def test_text_list_dict_and_tensor_inputs(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    # texts of different lengths: a batch of prompts, padded on the left at their own positions
    enc = prompts(tokenizer, ["ab", "abcd"])
    results = []
    for inputs in (["ab", "abcd"], enc, enc["input_ids"]):
        with model.trace(inputs):
            results.append(model.transformer.h[0].output.save())
    assert results[0].shape[0] == 2
    torch.testing.assert_close(results[0], results[1], atol=ATOL, rtol=0)
    # token ids alone (no attention mask): the same as the plain call with ids only
    ref, _ = _plain_output(gpt2, gpt2.transformer.h[0], enc["input_ids"])
    torch.testing.assert_close(results[2], ref, atol=ATOL, rtol=0)


def test_forward_out_of_order(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(distgrad.OutOfOrderError, match=r"model\.transformer\.h\[0\]\.output"):
        with model.trace(TEXT):
            model.transformer.h[1].output
            model.transformer.h[0].output


def test_bad_paths_name_what_exists(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(AttributeError, match=r"Did you mean model\.transformer\.h\b"):
        model.transformer.hh
    with pytest.raises(IndexError, match=r"model\.transformer\.h\[5\].*indices 0\.\.1"):
        model.transformer.h[5]
    with pytest.raises(TypeError, match="cannot be indexed"):
        model.transformer.wte[0]


def test_misuse_outside_a_trace(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with pytest.raises(distgrad.TraceStateError, match="inside `with model.trace"):
        model.transformer.h[0].output
    with pytest.raises(distgrad.TraceStateError, match=r"\.save\(\) was called outside a trace"):
        torch.ones(2).save()
    with pytest.raises(TypeError, match="no tokenizer"):
        with distgrad.wrap(gpt2).trace(TEXT):
            pass
    with pytest.raises(distgrad.TraceStateError, match="do not nest"):
        with model.trace(TEXT):
            with model.trace(TEXT):
                pass


def test_generate_reads_forward_but_refuses_backward(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.generate(TEXT, max_new_tokens=2, do_sample=False, pad_token_id=0):
        first = model.transformer.h[0].output.save()
    assert first.shape[:2] == (1, len(TEXT) + 1)
    # plain generate: the block's output at its first call (the prompt's forward)
    calls = []
    handle = gpt2.transformer.h[0].register_forward_hook(lambda m, a, out: calls.append(out))
    try:
        with torch.no_grad():
            gpt2.generate(**_enc(tokenizer), max_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    assert len(calls) == 2  # one forward per new token
    torch.testing.assert_close(first, calls[0], atol=ATOL, rtol=0)
    with pytest.raises(NotImplementedError, match="generate"):
        with model.generate(TEXT, max_new_tokens=2, do_sample=False, pad_token_id=0):
            out = model.output.logits
            with out.sum().backward():
                pass


def test_methods_returning_the_module_return_the_envoy(mlp):
    """``model = model.to(dev)`` keeps the wrapped model (as in nnsight); ``.device`` of a plain
    module's envoy is its parameters'; other methods return what the module's return."""
    model = distgrad.wrap(mlp)
    assert model.to("cpu") is model and model.cpu() is model and model.train() is model
    assert model[0].requires_grad_(True) is model[0]
    assert model.device == torch.device("cpu") and model[1].device == torch.device("cpu")
    assert model.state_dict().keys() == mlp.state_dict().keys()
    x = torch.randn(2, 8)
    model = model.to(torch.float32)
    with model.trace(x):
        out = model.output.save()
    torch.testing.assert_close(out, mlp(x), atol=0, rtol=0)
