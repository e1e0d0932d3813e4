"""Steering generation: an edit at every decoding step of ``generate``.

``model.generate(...)`` opens a trace over Hugging Face ``generate``. Each decoding step calls
the first block once more; ``model.transformer.h[0].call(step)`` names that step's call, so
the loop below adds a vector of its own to the block's output at every step.
``tracer.result`` is what ``generate`` returned. At the end, the generated ids are checked
against plain ``net.generate`` with a raw forward hook adding the same vectors (greedy
decoding, so the ids must be equal).

    python examples/generate.py
"""

import sys

import torch

import distgrad
from distgrad.demo.models import build_gpt2

NEW_TOKENS = 5
GREEDY = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
prompt = torch.randint(2, 384, (2, 6), generator=torch.Generator().manual_seed(0))
# one vector per step: a different token at any step whose edit went missing
steering = torch.randn(NEW_TOKENS, 64, generator=torch.Generator().manual_seed(1)) * 0.1

net = build_gpt2()
model = distgrad.wrap(net)
with model.generate(prompt, **GREEDY) as tracer:
    for step in range(NEW_TOKENS):  # step 0 runs the prompt, each later one a new token
        block = model.transformer.h[0].call(step)
        block.output = block.output + steering[step]
    ids = tracer.result.save()
print("steered:", ids[:, prompt.shape[1] :].tolist())

# The oracle: plain generate, the edit made by a raw forward hook.
unsteered = net.generate(prompt, **GREEDY)
calls = []


def add_steering(module, args, out):
    calls.append(module)
    return out + steering[len(calls) - 1]  # replaces the block's output


handle = net.transformer.h[0].register_forward_hook(add_steering)
expected = net.generate(prompt, **GREEDY)
handle.remove()
if torch.equal(expected, unsteered):
    sys.exit("the steering changes no token: the comparison would prove nothing")
if not torch.equal(ids, expected):
    sys.exit(
        f"mismatch: generated {ids.tolist()}, plain generate with the hook {expected.tolist()}"
    )
print(
    f"ok: generate with an edit at each of {NEW_TOKENS} steps: the ids equal plain generate's "
    f"with a raw hook"
)
