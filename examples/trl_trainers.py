"""TRL's SFTTrainer and DPOTrainer with an intervention in every training step.

``TraceSteps`` put first among a trainer's bases runs a function as the body of a trace around
each ``training_step``; here it saves the output of the policy's first block and the gradient
reaching it, and doubles the gradient. DPO's reference model runs as TRL runs it, untraced. On
several ranks each rank pads its batch to its own longest row, so rank 0's records hold the
ranks' values padded with NaN (``distgrad.rank_parts`` gives each rank's part). At the end,
everything is checked against plain TRL whose raw hooks make the same edit.

    python examples/trl_trainers.py
    torchrun --nproc-per-node 2 examples/trl_trainers.py    # DDP over gloo on the CPU
"""

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
from distgrad.demo.models import build_gpt2, build_tokenizer
from distgrad.trainer import TraceSteps

logging.getLogger("transformers").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
datasets.disable_progress_bars()
TOLERANCE = 1e-5  # fp32, relative: parameters after 2 SGD steps, values saved
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


class TracedSFT(TraceSteps, SFTTrainer):
    pass


class TracedDPO(TraceSteps, DPOTrainer):
    pass


def double_first_block(model, tr):
    ids = model.transformer.wte.input.save(gather="none")  # integers: each rank keeps its own
    hidden = model.transformer.h[0].output  # the policy's: DPO's reference model is not traced
    with tr.loss.backward():  # the trainer's own backward of its own loss
        grad = hidden.grad
        hidden.grad = grad * 2
    # hidden and grad are gathered to rank 0 (ids, saved with gather="none", are not)
    return {"input_ids": ids, "hidden": hidden, "grad": grad}  # kept in trainer.saved


def options():
    return dict(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        ddp_backend="gloo" if WORLD > 1 else None,
        per_device_train_batch_size=2,
        max_steps=2,
        optim="sgd",
        learning_rate=0.1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


words = "a tiny model reads bytes of text that differ in length".split()
texts = [" ".join(words[(i * 7 + k) % len(words)] for k in range(1 + i * 5 % 9)) for i in range(16)]
sft_data = datasets.Dataset.from_dict({"text": texts[: 4 * WORLD]})
dpo_data = datasets.Dataset.from_dict(
    {
        "prompt": [text + ":" for text in texts[: 4 * WORLD]],
        "chosen": [" " + text for text in texts[3 : 3 + 4 * WORLD]],
        "rejected": [" " + text for text in texts[5 : 5 + 4 * WORLD]],
    }
)
tokenizer = build_tokenizer()  # ByT5's bytes: nothing to download

sft = TracedSFT(
    model=build_gpt2(),
    args=SFTConfig(**options()),
    train_dataset=sft_data,
    processing_class=tokenizer,
    intervention=double_first_block,
)
sft.train()
dpo = TracedDPO(
    model=build_gpt2(),
    ref_model=build_gpt2(),
    args=DPOConfig(**options()),
    train_dataset=dpo_data,
    processing_class=tokenizer,
    intervention=double_first_block,
)
dpo.train()
if sft.is_world_process_zero():
    for record in sft.saved:
        hidden = record.value["hidden"]  # on several ranks: [2 * world, longest, 64]
        parts = distgrad.rank_parts(hidden) if hidden.isnan().any() else [hidden]
        print(f"SFT step {record.step}: the ranks' shapes {[list(p.shape) for p in parts]}")

# The oracle: plain TRL, the edit made by a raw tensor hook.


def hooked(net):
    """Raw hooks: per forward, the token ids, the first block's output and its gradient
    (doubled)."""
    seen = []
    net.transformer.wte.register_forward_hook(
        lambda module, args, out: seen.append({"input_ids": args[0].clone()})
    )

    def on_output(module, args, out):
        seen[-1]["hidden"] = out.detach().clone()

        def on_gradient(grad):
            seen[-1]["grad"] = grad.detach().clone()
            return grad * 2

        out.register_hook(on_gradient)

    net.transformer.h[0].register_forward_hook(on_output)
    return seen


def differences(traced, net, seen):
    """The largest relative difference of the parameters from the plain run's (``net``), and
    of each rank's part of every record from what that rank's hooks saw (rank 0 holds every
    rank's); how many records were ragged."""
    off = [
        (p - q).abs().max() / q.abs().max()
        for p, q in zip(traced.model.parameters(), net.parameters())
    ]
    every = [seen]
    if WORLD > 1:
        every = [None] * WORLD
        dist.all_gather_object(every, seen)  # each rank's hooked values, on every rank
    ragged = 0
    for step, record in enumerate(traced.saved if traced.is_world_process_zero() else []):
        for key in ("hidden", "grad"):
            value = record.value[key]
            ragged += bool(value.isnan().any())
            parts = distgrad.rank_parts(value) if value.isnan().any() else value.chunk(WORLD)
            off += [
                (p - e[step][key]).abs().max() / e[step][key].abs().max()
                for p, e in zip(parts, every)
            ]
    own_ids = all(  # on every rank: the ids it saved with gather="none", its own
        torch.equal(record.value["input_ids"], s["input_ids"])
        for record, s in zip(traced.saved, seen)
    )
    return max(off).item(), ragged, own_ids


plain = {
    "SFT": lambda net: SFTTrainer(
        model=net, args=SFTConfig(**options()), train_dataset=sft_data, processing_class=tokenizer
    ),
    "DPO": lambda net: DPOTrainer(
        model=net,
        ref_model=build_gpt2(),
        args=DPOConfig(**options()),
        train_dataset=dpo_data,
        processing_class=tokenizer,
    ),
}
checked = []
for name, traced in [("SFT", sft), ("DPO", dpo)]:
    net = build_gpt2()
    seen = hooked(net)
    plain[name](net).train()
    moved = max(
        (p - q).abs().max().item() for p, q in zip(net.parameters(), build_gpt2().parameters())
    )
    off, ragged, own_ids = differences(traced, net, seen)
    if len(traced.saved) != len(seen) or moved < 1e-4 or off > TOLERANCE or not own_ids:
        sys.exit(
            f"mismatch: {name}: {len(traced.saved)} records for {len(seen)} backward passes; "
            f"the plain steps moved the parameters by {moved:.1e}; against plain TRL with raw "
            f"hooks the parameters and saved values differ by {off:.1e} (relative; tolerance "
            f"{TOLERANCE}); the ids saved with gather='none' are this rank's: {own_ids}"
        )
    if WORLD > 1 and traced.is_world_process_zero() and not ragged:
        sys.exit(f"mismatch: {name}: no record was ragged, so rank_parts went unchecked")
    checked.append(f"{name}Trainer {len(seen)} steps, {ragged} ragged values, {off:.1e}")
print(
    f"ok: TRL on {WORLD} rank(s): parameters and saved values equal plain TRL with raw hooks "
    f"({'; '.join(checked)}: the largest relative difference)"
)
