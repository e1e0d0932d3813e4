"""A Hugging Face Trainer step traced by ``distgrad.trainer.TracedTrainer`` against the same
step of a plain ``Trainer`` whose raw hooks make the same edit (save the gradient reaching
``transformer.h[0]``'s output and double it), one process.

The two trainers take turns, ``--rounds`` times, each training ``--steps`` optimizer steps
(SGD, no accumulation, logging and saving off); a callback times every step, and the first
step of each turn is dropped (the dataloader and optimizer start there). Before timing, both
train 3 steps from the same weights and their parameters must agree (atol 1e-5).

    python benchmarks/trainer_step.py [--size toy|user] [--steps 20] [--rounds 3]

``toy``: the tiny GPT-2 of the tests (2 layers, d_model 64), batch 2 x 8 tokens. ``user``:
a GPT-2 of 6 layers, d_model 512, 8 heads, a 8192-token vocabulary, batch 4 x 128 tokens.
nnsight has no Trainer integration (a user would rewrite ``training_step``), so it is not
timed here. Prints the median ms per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from distgrad.trainer import TracedTrainer

logging.getLogger("transformers").setLevel(logging.ERROR)
SIZES = {
    "toy": (dict(n_layer=2, n_embd=64, n_head=2, vocab_size=384), 2, 8),
    "user": (dict(n_layer=6, n_embd=512, n_head=8, vocab_size=8192), 4, 128),
}


def build(size: str):
    config, _, _ = SIZES[size]
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**config))


def data(size: str, steps: int) -> list[dict]:
    config, batch, seq = SIZES[size]
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.randint(0, config["vocab_size"], (seq,), generator=g) for _ in range(batch * steps)
    ]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def arguments(size: str, steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="distgrad-bench-"),
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=SIZES[size][1],
        optim="sgd",
        learning_rate=0.01,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


def double_first_block(model, tr):
    hidden = model.transformer.h[0].output
    with tr.loss.backward():
        grad = hidden.grad.save()
        hidden.grad = grad * 2


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def with_raw_hooks(net):
    saved = []

    def double(grad):
        saved.append(grad.detach())
        return grad * 2

    def on_block(module, inputs, out):
        out.register_hook(double)

    net.transformer.h[0].register_forward_hook(on_block)
    return net


def train(kind: str, size: str, steps: int):
    """One turn: the trainer and the per-step seconds (the first step dropped)."""
    clock = StepTimes()
    common = dict(args=arguments(size, steps), train_dataset=data(size, steps), callbacks=[clock])
    if kind == "raw hooks":
        trainer = Trainer(model=with_raw_hooks(build(size)), **common)
    else:
        trainer = TracedTrainer(
            model=build(size),
            intervention=double_first_block,
            on_step=lambda record: None,
            **common,
        )
    trainer.train()
    times = clock.times
    return trainer, [b - a for a, b in zip(times, times[1:])]


def check(size: str) -> None:
    raw, _ = train("raw hooks", size, 3)
    traced, _ = train("distgrad", size, 3)
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(raw.model.parameters(), traced.model.parameters())
    )
    assert diff <= 1e-5, f"the variants' parameters differ by {diff:.3g} after 3 steps"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="toy")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    check(args.size)
    times = {"raw hooks": [], "distgrad": []}
    for _ in range(args.rounds):
        for kind in times:
            times[kind] += train(kind, args.size, args.steps)[1]
    base = statistics.median(times["raw hooks"])
    print(f"size {args.size}, {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}")
    for kind, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{kind:10s} {median * 1e3:9.2f} ms/step  {median / base:5.2f}x raw hooks")


if __name__ == "__main__":
    main()
