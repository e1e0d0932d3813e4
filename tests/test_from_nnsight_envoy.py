"""nnsight's tests/test_envoy.py (the envoy tree, attribute pass-through, reads outside a trace,
several wrappers of one module), ported to distgrad's envoys of a small block model.

Values are checked against plain PyTorch on the same module, fp32, exact (the same ops run).
Not ported, as distgrad has no such envoy API: ``get``, ``modules()``/``named_modules()`` as
envoys (they reach the module's own), ``rename=``, ``traceable``, ``tracer_cls=``,
``trace=False``, ``devices``/``to()`` returning the envoy, deprecated ``iter``/``all`` aliases.
"""

import pytest
import torch
from torch import nn

import distgrad


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = MLP()

    def forward(self, x):
        return self.mlp(self.attn(x))


class Model(nn.Module):
    """nnsight's test model (embed, three blocks, head), with a forward and non-module names."""

    def __init__(self, n_layers=3):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList([Block() for _ in range(n_layers)])
        self.head = nn.Linear(8, 8)
        self.config = "cfg"

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def describe(self):
        return "hello"


@pytest.fixture
def module():
    torch.manual_seed(0)
    return Model()


@pytest.fixture
def envoy(module):
    return distgrad.wrap(module)


@pytest.fixture
def x():
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["output", "input"])
def test_value_outside_a_trace(envoy, kind):
    """test_envoy.py::TestOutsideInterleaving::test_output_outside_a_trace and
    ::test_input_outside_a_trace: a ValueError naming the location, not an AttributeError"""
    with pytest.raises(ValueError, match=rf"model\.embed\.{kind} can only be used inside"):
        getattr(envoy.embed, kind)


def test_attribute_access_and_wrapped_modules(envoy, module):
    """test_envoy.py::TestTree::test_attribute_access, ::test_envoy_wraps_correct_module and
    ::test_modulelist_children_indexed"""
    # deliberate difference: an envoy's path is written as the user wrote it
    # ("model.layers[0]"), and its repr is "Envoy(path: Class)", not the module's repr
    assert envoy.embed._path == "model.embed"
    assert envoy.embed._module is module.embed
    assert envoy.layers[0]._module is module.layers[0]
    layer0 = getattr(envoy.layers, "0")
    assert layer0._module is module.layers[0]
    assert layer0.mlp.fc._module is module.layers[0].mlp.fc


def test_iter_modulelist_yields_layers(envoy, module):
    """test_envoy.py::TestTree::test_iter_modulelist_yields_layers"""
    layers = list(envoy.layers)
    assert [layer._module for layer in layers] == list(module.layers)
    assert [layer._path for layer in layers] == [f"model.layers[{i}]" for i in range(3)]
    # deliberate difference: only ModuleList, Sequential and ModuleDict envoys iterate
    # (nnsight's iterate any module's direct children)
    with pytest.raises(TypeError):
        list(envoy)


def test_getitem_and_len(envoy, module):
    """test_envoy.py::TestLookup::test_getitem_indexes_children and ::test_len_of_modulelist"""
    assert envoy.layers[2]._module is module.layers[2]
    assert len(envoy.layers) == 3


def test_attribute_pass_through(envoy, module):
    """test_envoy.py::TestAttributePassthrough: non-module attributes and methods are the
    module's, a child is an envoy, a missing name raises AttributeError, a module set on the
    torch module without registering it is wrapped"""
    assert envoy.config == "cfg"
    assert envoy.describe() == "hello"
    assert envoy.head.weight is module.head.weight
    with pytest.raises(AttributeError):
        envoy.does_not_exist
    object.__setattr__(module, "extra", nn.Linear(4, 4))
    assert envoy.extra._module is module.extra
    assert envoy.extra._path == "model.extra"


def test_setattr_is_refused(envoy, module):
    """test_envoy.py::TestSetattr::test_added_module_becomes_envoy"""
    # deliberate difference: assigning a module (or anything but .output/.input/.inputs) to an
    # envoy raises, naming the fix (change the module, wrap again); nnsight registers it
    with pytest.raises(AttributeError, match="an envoy takes assignments to .output"):
        envoy.extra = nn.Linear(8, 8)
    assert not hasattr(module, "extra")


def test_model_output_is_the_forward_output(envoy, module, x):
    """test_envoy.py::TestResult::test_result_is_the_forward_output and
    ::test_result_after_a_module_output"""
    # deliberate difference: a forward trace's result is model.output (tracer.result is what
    # generate() returned)
    with torch.no_grad():
        expected = module(x)
        with envoy.trace(x):
            out = envoy.output.save()
        with envoy.trace(x):
            envoy.embed.output
            after = envoy.output.save()
    assert torch.equal(out, expected) and torch.equal(after, expected)


def test_result_before_earlier_location_is_out_of_order(envoy, x):
    """test_envoy.py::TestResult::test_result_before_earlier_location_is_out_of_order"""
    with pytest.raises(distgrad.OutOfOrderError):
        with envoy.trace(x):
            envoy.output
            envoy.embed.output


def test_wrappers_of_one_module_agree(module, x):
    """test_envoy.py::TestMultipleWrappers::test_two_wrappers_agree, ::test_three_wrappers_agree
    and ::test_intermediate_saves_match_across_wrappers"""
    outs, embeds = [], []
    with torch.no_grad():
        for _ in range(3):
            wrapped = distgrad.wrap(module)
            with wrapped.trace(x):
                embeds.append(wrapped.embed.output.save())
                outs.append(wrapped.output.save())
        expected = module(x)
    assert all(torch.equal(out, expected) for out in outs)
    assert all(torch.equal(e, module.embed(x)) for e in embeds)


def test_modifications_are_independent(module, x):
    """test_envoy.py::TestMultipleWrappers::test_modifications_are_independent"""
    w1, w2 = distgrad.wrap(module), distgrad.wrap(module)
    with torch.no_grad():
        with w1.trace(x):
            w1.embed.output[:] = 0
            edited = w1.output.save()
        with w2.trace(x):
            clean = w2.output.save()
        expected_edited = module.head(
            module.layers[2](module.layers[1](module.layers[0](torch.zeros(2, 8))))
        )
        expected = module(x)
    assert torch.equal(edited, expected_edited)
    assert torch.equal(clean, expected)
