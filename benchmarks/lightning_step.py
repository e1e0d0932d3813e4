"""A Lightning training step traced by distgrad against the same step with raw hooks making the
same edit (save the gradient reaching ``transformer.h[0]``'s output and double it), one process:
under automatic optimization (``distgrad.lightning.TraceSteps`` against a raw forward hook that
registers a tensor hook) and under manual optimization (``model.trace_step(forward,
self.manual_backward)`` against the same raw hooks around ``self.manual_backward``).

The variants take turns, ``--rounds`` times, each training ``--steps`` optimizer steps (SGD,
progress bar, logger and checkpoints off); a callback times every step, and the first step of
each turn is dropped. Steps are timed in this process's CPU seconds (torch on one thread),
which other jobs on a shared machine do not inflate as they do a wall clock. Before timing,
each traced variant and its raw-hook twin train 3 steps from the same weights, and their
parameters must agree (atol 1e-5).

    python benchmarks/lightning_step.py [--size toy|user] [--steps 20] [--rounds 3]

``toy``: the tiny GPT-2 of the tests (2 layers, d_model 64), batch 2 x 8 tokens. ``user``:
a GPT-2 of 6 layers, d_model 512, 8 heads, a 8192-token vocabulary, batch 4 x 128 tokens.
Prints the median CPU ms per step of each variant and the traced/raw ratio per mode.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import lightning.pytorch as L
import torch
from trainer_step import SIZES  # the Trainer benchmark's sizes: the two pages' rows compare
from transformers import GPT2Config, GPT2LMHeadModel

import distgrad
from distgrad.lightning import TraceSteps

warnings.filterwarnings("ignore", module="lightning")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)


def build(size: str):
    config, _, _ = SIZES[size]
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**config, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))


def batches(size: str, steps: int) -> torch.Tensor:
    config, batch, seq = SIZES[size]
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, config["vocab_size"], (batch * steps, seq), generator=g)


def double_first_block(model, tr):
    hidden = model.net.transformer.h[0].output
    with tr.loss.backward():
        grad = hidden.grad.save()
        hidden.grad = grad * 2


def raw_hooks(net):
    def double(grad):
        grad.detach()  # (what the trace saves)
        return grad * 2

    def on_block(module, inputs, out):
        out.register_hook(double)

    return net.transformer.h[0].register_forward_hook(on_block)


class Step(L.LightningModule):
    """``kind``: "raw hooks" or "TraceSteps" (automatic), "manual raw hooks" or
    "manual trace_step"."""

    def __init__(self, size: str, kind: str):
        super().__init__()
        self.net, self.kind = build(size), kind
        self.automatic_optimization = not kind.startswith("manual")
        if "raw" in kind:
            raw_hooks(self.net)
        self.model = distgrad.wrap(self.net)

    def training_step(self, batch, batch_idx):
        forward = lambda: self.net(input_ids=batch, labels=batch).loss  # noqa: E731
        if self.automatic_optimization:
            return forward()
        opt = self.optimizers()
        opt.zero_grad()
        if self.kind == "manual raw hooks":
            self.manual_backward(forward())
        else:
            with self.model.trace_step(forward, self.manual_backward) as tr:
                hidden = self.model.transformer.h[0].output
                with tr.loss.backward():
                    grad = hidden.grad.save()
                    hidden.grad = grad * 2
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimes(L.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_end(self, *args):
        # this process's CPU time (torch on one thread): the machine is shared, and a wall clock
        # would count the time other jobs hold the cores
        self.times.append(time.process_time())


def train(kind: str, size: str, steps: int):
    """One turn: the module and the per-step seconds (the first step dropped)."""
    clock = StepTimes()
    callbacks = [clock]
    if kind == "TraceSteps":
        callbacks.append(TraceSteps(double_first_block, on_step=lambda record: None))
    module = Step(size, kind)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks,
        enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False,
    )  # fmt: skip
    _, batch, _ = SIZES[size]
    trainer.fit(module, torch.utils.data.DataLoader(batches(size, steps), batch_size=batch))
    times = clock.times
    return module, [b - a for a, b in zip(times, times[1:])]


PAIRS = [("raw hooks", "TraceSteps"), ("manual raw hooks", "manual trace_step")]


def check(size: str) -> None:
    for raw, traced in PAIRS:
        a, b = train(raw, size, 3)[0], train(traced, size, 3)[0]
        diff = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
        assert diff <= 1e-5, f"{raw} and {traced}: parameters differ by {diff:.3g} after 3 steps"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="toy")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    check(args.size)
    times = {kind: [] for pair in PAIRS for kind in pair}
    for _ in range(args.rounds):
        for kind in times:
            times[kind] += train(kind, args.size, args.steps)[1]
    print(f"size {args.size}, {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}")
    for raw, traced in PAIRS:
        base, median = statistics.median(times[raw]), statistics.median(times[traced])
        print(
            f"{traced:18s} {median * 1e3:9.2f} ms/step against {raw} {base * 1e3:9.2f}: "
            f"{median / base:5.2f}x"
        )


if __name__ == "__main__":
    main()
