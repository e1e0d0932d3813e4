"""Hugging Face Trainer with an intervention in every training step.

``TracedTrainer`` is ``transformers.Trainer`` with one more argument: a function run as the
body of a trace around each ``training_step``. Here it saves the gradient reaching the first
block's output and doubles it. At the end, the parameters are checked against a plain
``Trainer`` whose raw tensor hook makes the same edit.

    python examples/trainer.py
"""

import logging
import sys
import tempfile

import torch
from transformers import Trainer, TrainingArguments

from distgrad.demo.models import build_gpt2
from distgrad.trainer import TracedTrainer

logging.getLogger("transformers").setLevel(logging.ERROR)
TOLERANCE = 1e-5  # fp32: parameters after 3 SGD steps, gradients read


def double_first_block(model, tr):
    hidden = model.transformer.h[0].output
    with tr.loss.backward():  # the Trainer's own backward of its own loss
        grad = hidden.grad
        hidden.grad = grad * 2
    return {"grad": grad}  # kept once per micro-batch in trainer.saved


def arguments():
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        optim="sgd",
        learning_rate=0.1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


rows = [torch.randint(0, 384, (8,), generator=torch.Generator().manual_seed(i)) for i in range(12)]
data = [{"input_ids": ids, "labels": ids} for ids in rows]

trainer = TracedTrainer(
    model=build_gpt2(), args=arguments(), train_dataset=data, intervention=double_first_block
)
trainer.train()
for record in trainer.saved:
    print(
        f"step {record.step} micro-batch {record.micro_batch}: "
        f"h[0] gradient norm {record.value['grad'].norm():.3e}"
    )

# The oracle: a plain Trainer, the edit made by a raw tensor hook.


def plain_trainer(factor):
    """Train as TracedTrainer did, a raw hook multiplying h[0]'s gradient by factor."""
    net, seen = build_gpt2(), []

    def on_gradient(grad):
        seen.append(grad)
        return grad * factor

    def on_output(module, args, out):
        out.register_hook(on_gradient)  # returns None: the output itself stays as it is

    net.transformer.h[0].register_forward_hook(on_output)
    Trainer(model=net, args=arguments(), train_dataset=data).train()
    return net, seen


def largest_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


oracle, seen = plain_trainer(2.0)
unedited, _ = plain_trainer(1.0)
edit_moved = largest_difference(oracle.parameters(), unedited.parameters())
params_off = largest_difference(trainer.model.parameters(), oracle.parameters())
grads_off = largest_difference([r.value["grad"] for r in trainer.saved], seen)
if len(trainer.saved) != len(seen) or edit_moved < 1e-4 or max(params_off, grads_off) > TOLERANCE:
    sys.exit(
        f"mismatch: {len(trainer.saved)} records for {len(seen)} backward passes; the "
        f"edit moved the parameters by {edit_moved:.1e}; against the raw-hook Trainer the "
        f"parameters differ by {params_off:.1e}, the saved gradients by {grads_off:.1e} "
        f"(tolerance {TOLERANCE})"
    )
print(
    f"ok: Trainer, {len(seen)} micro-batches: saved gradients and parameters equal the "
    f"raw-hook Trainer's (largest difference {max(params_off, grads_off):.1e})"
)
