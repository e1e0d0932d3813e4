"""LoRA fine-tuning with PEFT: edit an activation gradient, read the adapters' gradients.

A PEFT model is wrapped as it is. Each of two training steps halves the gradient flowing into
the first block (and so into its adapter) and reads the first attention's ``lora_A`` and
``lora_B`` gradients through their module paths. At the end, those gradients and the trained
parameters are checked against the same steps in plain PyTorch with a raw tensor hook.

    python examples/lora.py
"""

import sys

import torch
from peft import LoraConfig, get_peft_model

import distgrad
from distgrad.demo.models import build_gpt2

TOLERANCE = 1e-5  # fp32: adapter gradients and parameters after 2 AdamW steps
ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(0))


def lora_model():
    # fan_in_fan_out: GPT-2's c_attn is a Conv1D, its weight stored transposed
    net = get_peft_model(
        build_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    )
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    return net, optimizer


net, optimizer = lora_model()
model = distgrad.wrap(net)
read = []
for step in range(2):
    with model.trace(ids, labels=ids):
        h0 = model.transformer.h[0].output
        with model.output.loss.backward():
            h0.grad = h0.grad * 0.5  # damp what reaches block 0 and its adapter
        c_attn = model.transformer.h[0].attn.c_attn
        a = c_attn.lora_A["default"].weight.grad.save()
        b = c_attn.lora_B["default"].weight.grad.save()
    print(f"step {step}: lora_A gradient norm {a.norm():.3e}, lora_B {b.norm():.3e}")
    read.append((a, b))
    optimizer.step()
    optimizer.zero_grad()

# The oracle: the same steps in plain PyTorch, the edit made by a raw tensor hook.
plain, plain_optimizer = lora_model()
c_attn = plain.base_model.model.transformer.h[0].attn.c_attn


def on_block_output(module, args, out):
    out.register_hook(lambda grad: grad * 0.5)  # returns None: the output stays as it is


plain.base_model.model.transformer.h[0].register_forward_hook(on_block_output)
worst = 0.0
for step, (a, b) in enumerate(read):
    plain(ids, labels=ids).loss.backward()
    for got, weight in ((a, c_attn.lora_A["default"].weight), (b, c_attn.lora_B["default"].weight)):
        if step == 1 and weight.grad.abs().max() == 0:
            sys.exit("the oracle's adapter gradient is zero: the comparison would prove nothing")
        worst = max(worst, (got - weight.grad).abs().max().item())
    plain_optimizer.step()
    plain_optimizer.zero_grad()
for p, q in zip(net.parameters(), plain.parameters()):
    worst = max(worst, (p - q).abs().max().item())
if worst > TOLERANCE:
    sys.exit(
        f"mismatch: the traced steps differ from the raw-hook steps by {worst:.1e} "
        f"(tolerance {TOLERANCE})"
    )
print(
    f"ok: LoRA, 2 steps: lora_A/lora_B gradients and parameters equal the raw-hook steps' "
    f"(largest difference {worst:.1e})"
)
