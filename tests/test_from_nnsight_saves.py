"""``.save()`` on the containers a body gets from envoys, as nnsight spells it.

``model.transformer.h[1].inputs.save()`` (a tuple), ``model.output.save()`` (a transformers
``ModelOutput``), a module's tuple, list or dict output: each keeps the object and returns it,
as ``distgrad.save`` does (``distgrad/saveable.py``). Checked against nnsight 0.8.1 running the
same program on the tiny GPT-2 (built afresh, in a fresh process: ``nnsight_job.py``) and
against plain forward hooks, fp32, atol 1e-6;
the objects left after the trace are of their own classes, and an in-place change to a list
the body got reaches the model.
"""

import importlib.util
import pickle

import pytest
import torch
from conftest import ATOL, run_in_nnsight

import distgrad
from distgrad.demo.models import build_gpt2, build_tokenizer

TEXT = "Hello world"


def _close(got, expected):
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def nnsight_numbers(nnsight) -> dict:
    """The program below run by nnsight (in ``nnsight_job.py``'s process)."""
    model = nnsight.LanguageModel(build_gpt2(), tokenizer=build_tokenizer())
    (args, kwargs), args_alone, output = _inputs_and_output(model)
    return {
        "types": [type(args).__name__, type(args_alone).__name__, type(kwargs).__name__],
        "output type": type(output).__name__,
        "args": args[0],
        "kwargs": sorted(kwargs),
        "logits": output.logits,
    }


def _inputs_and_output(model):
    with model.trace(TEXT):
        inputs = model.transformer.h[1].inputs.save()
        args = model.transformer.h[1].inputs[0].save()
        output = model.output.save()
    return inputs, args, output


@pytest.mark.skipif(importlib.util.find_spec("nnsight") is None, reason="no nnsight")
def test_inputs_and_model_output_save_as_in_nnsight(tokenizer):
    gpt2 = build_gpt2()  # the weights nnsight_numbers builds
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    (args, kwargs), args_alone, output = _inputs_and_output(model)
    theirs = run_in_nnsight(__name__)
    seen = {}
    handle = gpt2.transformer.h[1].register_forward_pre_hook(
        lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True
    )
    try:
        with torch.no_grad():
            logits = gpt2(**tokenizer([TEXT], return_tensors="pt")).logits
    finally:
        handle.remove()
    # the objects nnsight returns: plain builtins and the model's own output class
    assert [type(v).__name__ for v in (args, args_alone, kwargs)] == theirs["types"]
    assert [type(args), type(args_alone), type(kwargs)] == [tuple, tuple, dict]
    assert type(output) is type(gpt2(**tokenizer([TEXT], return_tensors="pt")))
    assert type(output).__name__ == theirs["output type"]
    pickle.dumps(output)  # its own class again: nothing of distgrad's is left on it
    _close(args[0], seen["args"][0])
    _close(args_alone[0], args[0])
    _close(args[0], theirs["args"])
    assert sorted(kwargs) == sorted(seen["kwargs"]) == theirs["kwargs"]
    _close(output.logits, logits)
    _close(output.logits, theirs["logits"])


def test_saves_in_invokes_are_each_invokes_rows(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace() as tracer:
        with tracer.invoke(TEXT):
            first = model.output.save()
        with tracer.invoke(["Paris is", "Rome"]):
            inputs = model.transformer.h[0].inputs.save()
            second = model.output.save()
    args = inputs[0]
    assert type(first) is type(second) and type(args) is tuple
    assert first.logits.shape[0] == 1 and second.logits.shape[0] == 2 and args[0].shape[0] == 2
    with model.trace([TEXT, "Paris is", "Rome"]):
        whole = model.output.logits.save()
    _close(first.logits, whole[:1])
    _close(second.logits, whole[1:])


class ListOut(torch.nn.Module):
    """A block whose output is a list and a head that reads it, and a dict-returning one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.split = Split()

    def forward(self, x):
        parts = self.split(self.a(x))
        return self.b(parts[0] + parts[1])


class Split(torch.nn.Module):
    def forward(self, x):
        return [x * 2, x + 1]


def test_a_list_output_saves_and_an_in_place_change_reaches_the_model():
    net = ListOut()
    x = torch.randn(3, 4)
    model = distgrad.wrap(net)
    with model.trace(x):
        parts = model.split.output
        parts[1] = torch.zeros(3, 4)  # in place, as on the list the model goes on with
        saved = parts.save()
        out = model.output.save()
    assert type(saved) is list
    with torch.no_grad():
        h = net.a(x)
        expected = net.b(h * 2)
    _close(saved[0], h * 2)
    assert torch.equal(saved[1], torch.zeros(3, 4))
    _close(out, expected)


class DictOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return {"h": self.lin(x), "x": x}


def test_a_dict_output_and_a_tuple_output_save():
    net = torch.nn.Sequential(DictOut())
    x = torch.randn(2, 4)
    model = distgrad.wrap(net)
    with model.trace(x):
        out = model[0].output.save()
    assert type(out) is dict
    with torch.no_grad():
        _close(out["h"], net[0].lin(x))
    lstm = torch.nn.LSTM(4, 3, batch_first=True)
    model = distgrad.wrap(torch.nn.Sequential(lstm))
    seq = torch.randn(2, 5, 4)
    with model.trace(seq):
        result = model[0].output.save()  # (output, (h, c))
    assert type(result) is tuple
    with torch.no_grad():
        _close(result[0], lstm(seq)[0])


def test_save_outside_the_trace_raises(gpt2, tokenizer):
    model = distgrad.wrap(gpt2, tokenizer=tokenizer)
    with model.trace(TEXT):
        inputs = model.transformer.h[0].inputs
    with pytest.raises(distgrad.TraceUsageError, match="outside a trace"):
        inputs.save()
