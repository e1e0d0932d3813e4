"""Models and plain-PyTorch references shared by the tests ported from nnsight's own suite
(``test_from_nnsight_*.py``).

nnsight's tests run pretrained GPT-2 and compare decoded text ("... New York City"); the ports
run the tiny random GPT-2 of ``conftest`` (or the small models below) and compare every number
with the same computation done by plain PyTorch on the same weights: forward hooks for
activations and edits, ``torch.autograd.grad`` / tensor hooks for gradients. fp32, atol 1e-6.
Where distgrad differs on purpose, the test says "deliberate difference: ...".

nnsight features distgrad does not offer, whose tests are not ported:

- ``model.session()``: several traces as one program (plain Python between traces instead).
- ``tracer.stop()``: ending the forward early from the body.
- ``.skip(value)``: replacing a module's call without running it.
- ``.source``: values inside a module's forward (operations of its source).
- ``model.iter`` and ``model.all()``: nnsight's deprecated spellings of ``tracer.iter`` and
  ``tracer.all()``, which distgrad serves (``test_from_nnsight_steps.py``).
- ``model.scan(...)``: shapes from a fake-tensor run.
- ``tracer.cache(...)``: recording every module's values.
- ``tracer.barrier(n)``: ordering invoke bodies against each other.
- ``model.edit()`` and ``clear_edits()``: editing contexts kept on the model.
- ``model.generator.output`` and ``model.pipe(...)``: generate's output as a module
  (``tracer.result`` holds the generated ids).
- ``remote=True`` (NDIF), vLLM and serving backends.
- ``nnsight.util.WrapperModule`` and attaching modules to an envoy.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from conftest import prompts
from torch import nn

ATOL = 1e-6
ET = "The Eiffel Tower is in the city of"
MSG = "Madison Square Garden is located in the city of"


def tiny(seed: int = 0) -> nn.Module:
    """nnsight's ``tiny_model`` (tests/test_tiny.py): Linear(5, 10) then Linear(10, 2), named."""
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict([("layer1", nn.Linear(5, 10)), ("layer2", nn.Linear(10, 2))]))


def tiny_input(seed: int = 1) -> torch.Tensor:
    return torch.rand((1, 5), generator=torch.Generator().manual_seed(seed))


class MLP(nn.Module):
    """The two-layer MLP of nnsight's tests/test_backward.py and test_batching.py."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def mlp_fc1_grad(net: MLP, x: torch.Tensor) -> torch.Tensor:
    """The gradient flowing into fc1's output for ``net(x).sum()``, by plain autograd."""
    a1 = net.fc1(x)
    return torch.autograd.grad(net.fc2(torch.relu(a1)).sum(), a1)[0]


def encode(tokenizer, text) -> dict:
    """Text as the GPT-2 of the ports runs it: prompts of different lengths padded on the left,
    with their own positions (``conftest.prompts``, nnsight's ``LanguageModel`` layout)."""
    return prompts(tokenizer, text)


def hooked_run(net: nn.Module, inputs, modules: dict, edits: dict | None = None):
    """Run ``net`` with forward hooks: returns ``({name: output}, model output)``.

    ``modules`` maps a name to a submodule whose output to record; ``edits`` maps a name to a
    function of that output whose result replaces it (recorded after the edit)."""
    edits = edits or {}
    seen, handles = {}, []
    for name, module in modules.items():

        def hook(mod, args, out, name=name):
            if name in edits:
                out = edits[name](out)
            seen[name] = out
            return out

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = net(**inputs) if isinstance(inputs, dict) else net(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen, out


def assert_close(got, expected, atol=ATOL):
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
