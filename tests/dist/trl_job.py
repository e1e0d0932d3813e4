"""TRL's SFTTrainer and DPOTrainer traced by the ``TraceSteps`` mixin, on 2 DDP ranks (gloo,
CPU; accelerate wraps the policy in DDP), against the same runs of plain TRL whose edit a raw
hook makes.

Started by tests/test_trl.py. Each run is 2 optimizer steps of SGD on the tiny GPT-2 (random
weights; DPO's reference model is a second one), ByT5's byte tokenizer and a dataset of python
lists whose rows have different lengths: TRL pads each rank's batch to its own longest row,
so the saves are ragged and rank 0's records hold them padded with NaN
(``distgrad.rank_parts``). The intervention saves the output of the policy's first block and
the gradient reaching it, and doubles that gradient. Oracle: plain TRL, a forward hook on the
same block saving its output and a tensor hook saving and doubling its gradient, on each rank
(plain autograd on that rank's rows); each rank's hooked values are collected on rank 0.
Checked: the parameters after the steps, each rank's part of every record (its own padding
positions included) and NaN beyond it. Tolerance: fp32, rtol 1e-5, atol 1e-6.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

import datasets
import torch
import torch.distributed as dist
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

import distgrad
from cases import run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2, build_tokenizer
from distgrad.trainer import TraceSteps

logging.getLogger("transformers").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
datasets.disable_progress_bars()
torch.set_num_threads(1)
STEPS = 2
WORDS = ["a", "tiny", "model", "reads", "bytes", "of", "text", "that", "differ", "in", "length"]


def sentence(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + (i * 5) % 9))


def options() -> dict:
    return dict(
        output_dir=tempfile.mkdtemp(prefix="distgrad-trl-"), use_cpu=True,
        per_device_train_batch_size=2, max_steps=STEPS, optim="sgd", learning_rate=0.1,
        train_sampling_strategy="sequential", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, ddp_backend="gloo")


def sft_data() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": [sentence(i) for i in range(4 * STEPS)]})


def dpo_data() -> datasets.Dataset:
    rows = range(4 * STEPS)
    return datasets.Dataset.from_dict({
        "prompt": [sentence(i) + ":" for i in rows],
        "chosen": [" " + sentence(i + 3) for i in rows],
        "rejected": [" " + sentence(i + 5) for i in rows],
    })


class TracedSFT(TraceSteps, SFTTrainer):
    pass


class TracedDPO(TraceSteps, DPOTrainer):
    pass


def double_first_block(model, tr):
    """Save the output of the first block and the gradient reaching it; double the gradient."""
    hidden = model.transformer.h[0].output
    with tr.loss.backward():
        grad = hidden.grad
        hidden.grad = grad * 2
    return {"hidden": hidden, "grad": grad}


def hooked(net) -> list:
    """The oracle's raw hooks on the first block: per forward, its output and the gradient
    reaching it (doubled on the way)."""
    seen = []

    def on_output(mod, args, out):
        record = {"hidden": out.detach().clone()}
        seen.append(record)

        def double(grad):
            record["grad"] = grad.detach().clone()
            return grad * 2

        out.register_hook(double)

    net.transformer.h[0].register_forward_hook(on_output)
    return seen


def same(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


def compare(traced, plain, seen, rank, world):
    for (name, p), q in zip(traced.model.named_parameters(), plain.model.parameters()):
        same(p.detach(), q.detach(), f"parameter {name} after {STEPS} steps")
    start = dict(build_gpt2().named_parameters())
    moved = max((p - start[n]).abs().max().item() for n, p in plain.model.named_parameters())
    assert moved > 1e-4, "plain TRL's steps changed nothing: comparing would prove nothing"
    every = [None] * world
    dist.all_gather_object(every, seen)  # each rank's hooked values, on every rank
    records = traced.saved
    assert len(records) == STEPS == len(seen), (len(records), len(seen))
    if rank != 0:
        for record, hook in zip(records, seen):  # rank-local values where not gathered
            for key in ("hidden", "grad"):
                same(record.value[key], hook[key], f"rank {rank}'s own {key}")
        return
    ragged = 0
    for step, record in enumerate(records):
        lengths = {every[r][step]["hidden"].shape[1] for r in range(world)}
        ragged += len(lengths) > 1
        print(f"step {step}: the ranks' lengths {[every[r][step]['hidden'].shape[1] for r in range(world)]}",
              flush=True)
        for key in ("hidden", "grad"):
            value = record.value[key]
            parts = distgrad.rank_parts(value) if len(lengths) > 1 else value.chunk(world)
            for r, part in enumerate(parts):
                same(part, every[r][step][key], f"step {step}, rank {r}'s {key}")
            filled = sum(part.numel() for part in parts)
            assert value.isnan().sum() == value.numel() - filled, f"step {step}: padding"
    assert ragged, "no step had ranks of different lengths: the ragged path was not run"


def case_sft(rank, world):
    tok = build_tokenizer()
    traced = TracedSFT(model=build_gpt2(), args=SFTConfig(**options()), train_dataset=sft_data(),
                       processing_class=tok, intervention=double_first_block)
    traced.train()
    net = build_gpt2()
    seen = hooked(net)
    plain = SFTTrainer(model=net, args=SFTConfig(**options()), train_dataset=sft_data(),
                       processing_class=tok)
    plain.train()
    compare(traced, plain, seen, rank, world)


def case_dpo(rank, world):
    tok = build_tokenizer()
    traced = TracedDPO(model=build_gpt2(), ref_model=build_gpt2(), args=DPOConfig(**options()),
                       train_dataset=dpo_data(), processing_class=tok,
                       intervention=double_first_block)
    traced.train()
    net = build_gpt2()
    seen = hooked(net)
    plain = DPOTrainer(model=net, ref_model=build_gpt2(), args=DPOConfig(**options()),
                       train_dataset=dpo_data(), processing_class=tok)
    plain.train()
    compare(traced, plain, seen, rank, world)


CASES = [case_sft, case_dpo]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 30.0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_cases(CASES, args.out, rank, rank, world)


if __name__ == "__main__":
    sys.exit(main())
