"""Shared models and the plain-autograd oracle.

Every test compares distgrad against the same computation done with plain PyTorch (forward
hooks, tensor hooks, retain_grad, torch.autograd.grad) on the same model and input. Models are
built once per worker from configs (random weights, dropout off) and their parameter gradients
are cleared before each test. Tolerance: fp32, atol 1e-6 for values distgrad hands over
unchanged, 1e-5 for parameter gradients (the same ops run in both, so they agree to rounding).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import distgrad
from distgrad.demo.models import build_gpt2, build_tokenizer

logging.getLogger("transformers").setLevel(logging.ERROR)
torch.set_num_threads(1)

# DeepSpeed compiles a C++ op on its first run and torch keeps it under TORCH_EXTENSIONS_DIR,
# shared by default across every checkout of the machine. A build there is guarded by a bare
# lock file: a build killed half way (a timed-out job) leaves it, and every later DeepSpeed job
# then waits for it forever. So the suite keeps its own build here (the jobs it starts inherit
# the variable), and pytest_configure removes a lock left by an earlier run.
EXTENSIONS = Path(__file__).resolve().parent.parent / "build" / "torch_extensions"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS))


def pytest_configure(config):
    # in the controlling process only, before any worker or job starts: no build is running
    if not hasattr(config, "workerinput") and os.environ["TORCH_EXTENSIONS_DIR"] == str(EXTENSIONS):
        for lock in EXTENSIONS.glob("**/lock"):
            lock.unlink(missing_ok=True)


ATOL = 1e-6
PARAM_ATOL = 1e-5
TEXT = "The Eiffel Tower is in"


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def _gpt2():
    return build_gpt2()


def build_test_llama():
    """The one-process suites' tiny Llama (seed 1)."""
    torch.manual_seed(1)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def _llama():
    return build_test_llama()


@pytest.fixture(scope="session")
def _mlp():
    torch.manual_seed(2)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    )


def prompts(tokenizer, texts) -> dict:
    """Texts as a decoder's batch of prompts, laid out as nnsight's ``LanguageModel`` lays them
    (and distgrad, for a model that generates): padded on the left, each row's
    ``position_ids`` counted from its first token."""
    enc = dict(tokenizer(texts, return_tensors="pt", padding=True, padding_side="left"))
    enc["position_ids"] = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return enc


NETS = {"gpt2": build_gpt2, "llama": build_test_llama}  # the fixtures' models, by name


def run_in_nnsight(module: str) -> dict:
    """What ``module``'s ``nnsight_numbers(nnsight)`` returns: nnsight 0.8.1 running the test
    module's programs in a fresh process (``nnsight_job.py``), since importing nnsight mounts
    its ``save`` on every object and patches ``torch.Tensor`` for the rest of the process."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here.parent), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "numbers.pt"
        proc = subprocess.run(
            [sys.executable, str(here / "nnsight_job.py"), module, str(out)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return torch.load(out, weights_only=True)


def _fresh(net):
    net.zero_grad(set_to_none=True)
    return net


@pytest.fixture
def gpt2(_gpt2):
    return _fresh(_gpt2)


@pytest.fixture
def llama(_llama):
    return _fresh(_llama)


@pytest.fixture
def mlp(_mlp):
    return _fresh(_mlp)


@pytest.fixture(params=["greenlet", "thread"])
def backward_mode(request):
    """Run a test both ways a backward hands values over: on the body's thread, the run in a
    greenlet (a CPU backward); and in a worker thread (the path a CUDA backward takes, whose
    hooks fire on autograd's device threads). Each forward and gradient edit test takes this
    fixture, so that an edit lost on either path fails."""
    old = distgrad.config.backward_mode
    distgrad.config.backward_mode = request.param
    yield request.param
    distgrad.config.backward_mode = old


def param_grads(net) -> dict:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def assert_param_grads(net, expected: dict, atol=PARAM_ATOL):
    got = param_grads(net)
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, atol=atol, rtol=0, msg=name)


def reference(net, inputs: dict | torch.Tensor, module, edit=None, loss_fn=None):
    """Plain autograd: the output of ``module``, the gradient reaching it, and parameter grads
    after optionally replacing that gradient with ``edit(grad)``."""
    net.zero_grad(set_to_none=True)
    seen = {}

    def on_output(mod, args, out):
        seen["out"] = out

        def on_grad(grad):
            seen["grad"] = grad.detach().clone()
            return edit(grad) if edit is not None else None

        out.register_hook(on_grad)

    handle = module.register_forward_hook(on_output)
    try:
        out = net(**inputs) if isinstance(inputs, dict) else net(inputs)
    finally:
        handle.remove()
    logits = out.logits if hasattr(out, "logits") else out
    loss = loss_fn(logits) if loss_fn else logits.sum()
    loss.backward()
    grads = param_grads(net)
    net.zero_grad(set_to_none=True)
    return seen["out"].detach(), seen["grad"], grads


def hook_count(net) -> int:
    """Every module hook entry PyTorch keeps (distgrad writes these dicts directly)."""
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._forward_hooks_with_kwargs)
        + len(m._forward_pre_hooks_with_kwargs)
        + len(m._forward_hooks_always_called)
        for m in net.modules()
    )
