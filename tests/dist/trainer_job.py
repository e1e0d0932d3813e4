"""Hugging Face Trainer runs traced by ``distgrad.trainer.TracedTrainer``, against the same runs
of a plain ``Trainer`` whose edits raw hooks make: on one process, or on every rank of a DDP job
(``TrainingArguments(use_cpu=True)`` on gloo; accelerate wraps the model in DDP).

Started by tests/test_trainer.py with ``--world 1`` or ``2``. Each run is 3 optimizer steps of
SGD on a tiny GPT-2 (dropout on; Trainer seeds it), gradient accumulation 1 and 2; data is
sharded over the ranks by the Trainer. The oracles are plain PyTorch: the parameters after the
steps, the gradients a tensor hook saw, the losses ``training_step`` returned. Cases cover
Trainer's loss paths (``num_items_in_batch``, label smoothing), bf16 autocast, gradient
checkpointing, and on 2 ranks DeepSpeed ZeRO-1 and ZeRO-3 (Trainer's ``deepspeed=``).
Tolerance: fp32, atol 1e-5 (cases.ATOL).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

import distgrad
from cases import close, expect_error, run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from distgrad.trainer import TracedTrainer

logging.getLogger("transformers").setLevel(logging.ERROR)
torch.set_num_threads(1)
STEPS = 3
# the steps move the parameters by far more than this, and the edit moves them by more again
DIFFERENT = 1e-4


def samples(world: int) -> list[dict]:
    """Enough (input_ids, labels) rows for STEPS steps of 2 rows x 2 micro-batches per rank."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(2 * 2 * STEPS * world):
        ids = torch.randint(0, 384, (8,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def arguments(accumulate: int, smoothing: float = 0.0, **more) -> TrainingArguments:
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="distgrad-trainer-"), use_cpu=True,
        per_device_train_batch_size=2, gradient_accumulation_steps=accumulate, max_steps=STEPS,
        optim="sgd", learning_rate=0.1, label_smoothing_factor=smoothing,
        train_sampling_strategy="sequential", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None, **more)


# the intervention of examples/trainer.py, returning tr.loss too
def double_first_block(model, tr):
    """Save the gradient reaching the first block's output, and double it."""
    hidden = model.transformer.h[0].output
    with tr.loss.backward():  # the Trainer's own accelerator.backward(loss)
        grad = hidden.grad
        hidden.grad = grad * 2
    return {"grad": grad, "loss": tr.loss}


def halve_mlp_and_double_block(model, tr):
    """A forward edit inside the first block (recomputed under checkpointing) and the
    gradient edit of ``double_first_block``."""
    model.transformer.h[0].mlp.output = model.transformer.h[0].mlp.output * 0.5
    return double_first_block(model, tr)


def halve_first_mlp(model, tr):
    """A forward edit only: the Trainer's backward runs after the body."""
    model.transformer.h[0].mlp.output = model.transformer.h[0].mlp.output * 0.5


def lora_gpt2():
    """The tiny GPT-2 with LoRA adapters on every attention's c_attn (both factors random, so
    each has a gradient from the first step); the base weights are frozen."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(build_gpt2(), LoraConfig(r=4, target_modules=["c_attn"],
                                                   init_lora_weights=False))


def double_and_read_adapter(model, tr):
    """``double_first_block``, then the gradient of block 1's LoRA B factor after the
    backward, read through the model's path (this micro-batch's accumulated gradient)."""
    value = double_first_block(model, tr)
    value["lora_B"] = model.transformer.h[1].attn.c_attn.lora_B["default"].weight.grad
    return value


class RecordingTrainer(Trainer):
    """The oracle: a plain Trainer that keeps what each training_step returned, and the LoRA B
    gradient of block 1 after it (when the model has adapters)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses, self.adapter_grads = [], []

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss)
        for name, p in self.model.named_parameters():
            if name.endswith("h.1.attn.c_attn.lora_B.default.weight"):
                self.adapter_grads.append(p.grad.detach().clone())
        return loss


def train_traced(intervention, args, world, build=build_gpt2, **kwargs):
    trainer = TracedTrainer(model=build(), args=args, train_dataset=samples(world),
                            intervention=intervention, **kwargs)
    trainer.train()
    return trainer


def train_with_hooks(args, world, gradient_edit=False, forward_edit=False, build=build_gpt2):
    """The same training with raw hooks doing the edit (or none, with neither flag)."""
    net = build()
    block = net.base_model.model.transformer.h[0] if build is lora_gpt2 else net.transformer.h[0]
    seen = []

    def double(grad):
        seen.append(grad.detach().clone())
        return grad * 2

    def on_block(mod, inputs, out):
        out.register_hook(double)

    handles = []
    if gradient_edit:
        handles.append(block.register_forward_hook(on_block))
    if forward_edit:
        handles.append(block.mlp.register_forward_hook(
            lambda mod, inputs, out: out * 0.5))
    trainer = RecordingTrainer(model=net, args=args, train_dataset=samples(world))
    trainer.train()
    for handle in handles:
        handle.remove()
    return trainer, seen


def every_rank(tensor) -> torch.Tensor:
    """The ranks' tensors joined in rank order (0-dim ones stacked), as rank 0's saves are."""
    if not dist.is_initialized():
        return tensor.reshape(1) if tensor.dim() == 0 else tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)


def whole_parameters(*trainers):
    """ZeRO-3 keeps each rank's shard of the parameters: gather them for the comparison."""
    if not any(t.is_deepspeed_enabled for t in trainers):
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters([p for t in trainers for p in t.model.parameters()])


def check_parameters(trainer, oracle, unedited) -> None:
    with whole_parameters(trainer, oracle, unedited):
        compare_parameters(trainer, oracle, unedited)


def compare_parameters(trainer, oracle, unedited) -> None:
    start = dict(build_gpt2().named_parameters())
    start.update({n: p for n, p in lora_gpt2().named_parameters()})
    moved = max((p - start[n]).abs().max().item() for n, p in oracle.model.named_parameters())
    assert moved > DIFFERENT, "the oracle's steps changed nothing: comparing would prove nothing"
    edit = max((p - q).abs().max().item() for p, q in zip(oracle.model.parameters(),
                                                          unedited.model.parameters()))
    assert edit > DIFFERENT, "the edit changed no parameter: the comparison would prove nothing"
    for (name, p), ref in zip(trainer.model.named_parameters(), oracle.model.parameters()):
        close(p.detach(), ref.detach(), f"parameter {name} after {STEPS} steps")


def check_gradient_edit(world, rank, accumulate, smoothing=0.0, forward_edit=False,
                        build=build_gpt2, **more):
    def args():
        return arguments(accumulate, smoothing, **more)

    body = halve_mlp_and_double_block if forward_edit else double_first_block
    if build is lora_gpt2:
        body = double_and_read_adapter
    trainer = train_traced(body, args(), world, build=build)
    oracle, seen = train_with_hooks(args(), world, gradient_edit=True, forward_edit=forward_edit,
                                    build=build)
    unedited, _ = train_with_hooks(args(), world, build=build)
    check_parameters(trainer, oracle, unedited)
    records = trainer.saved
    assert len(records) == STEPS * accumulate == len(seen), (len(records), len(seen))
    for i, (record, grad, loss) in enumerate(zip(records, seen, oracle.losses)):
        assert (record.step, record.micro_batch) == (i // accumulate, i % accumulate), record[:2]
        whole = every_rank(grad)  # a collective: every rank takes part
        close(record.value["grad"], whole if rank == 0 else grad,
              f"h[0]'s gradient at micro-batch {i}")
        # tr.loss: what the Trainer backpropagates, training_step's return value
        losses = every_rank(loss)
        mine = losses if rank == 0 else loss
        close(record.value["loss"].detach().reshape(mine.shape), mine,
              f"tr.loss at micro-batch {i}")
        if build is lora_gpt2:  # saved, so rank 0 holds every rank's, joined like the rest
            own = oracle.adapter_grads[i]
            joined = every_rank(own)
            close(record.value["lora_B"], joined if rank == 0 else own,
                  f"LoRA B's gradient at micro-batch {i}")
    assert "backward" not in vars(trainer.accelerator), "accelerator.backward left patched"
    return trainer


def case_gradient_edit_without_accumulation(world, rank):
    check_gradient_edit(world, rank, 1)


def case_gradient_edit_with_accumulation(world, rank):
    # GPT-2 takes the loss's token count (num_items_in_batch): Trainer does not divide by 2
    check_gradient_edit(world, rank, 2)


def case_gradient_edit_with_accumulation_and_label_smoothing(world, rank):
    # Trainer's label smoother computes the loss, and Trainer divides it by 2
    check_gradient_edit(world, rank, 2, smoothing=0.1)


def case_bf16_autocast(world, rank):
    trainer = check_gradient_edit(world, rank, 2, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16", trainer.accelerator.mixed_precision


def case_gradient_checkpointing(world, rank):
    # a forward edit inside a block that use_reentrant=True recomputes is refused (the
    # recompute could not repeat it: tests/test_checkpointing.py); gradient edits are not
    for reentrant in (False, True):
        trainer = check_gradient_edit(world, rank, 1, forward_edit=not reentrant,
                                      gradient_checkpointing=True,
                                      gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert trainer.model.is_gradient_checkpointing


def case_lora_adapters(world, rank):
    check_gradient_edit(world, rank, 2, build=lora_gpt2)


def deepspeed_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def case_deepspeed_zero1(world, rank):
    trainer = check_gradient_edit(world, rank, 2, deepspeed=deepspeed_config(1))
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"


def case_deepspeed_zero3(world, rank):
    trainer = check_gradient_edit(world, rank, 2, deepspeed=deepspeed_config(3))
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"


def case_forward_edit_without_block(world, rank):
    kept = []
    trainer = train_traced(halve_first_mlp, arguments(2), world, on_step=kept.append)
    oracle, _ = train_with_hooks(arguments(2), world, forward_edit=True)
    unedited, _ = train_with_hooks(arguments(2), world)
    check_parameters(trainer, oracle, unedited)
    assert not trainer.saved and len(kept) == 2 * STEPS, (len(trainer.saved), len(kept))
    assert all(record.value is None for record in kept)


def case_block_on_another_tensor_raises(world, rank):
    def wrong(model, tr):
        with model.output.logits.sum().backward():
            pass

    trainer = TracedTrainer(model=build_gpt2(), args=arguments(1), train_dataset=samples(world),
                            intervention=wrong)
    expect_error(trainer.train, distgrad.TraceStateError, "with tr.loss.backward()")
    assert "backward" not in vars(trainer.accelerator), "accelerator.backward left patched"


# DeepSpeed's cases run on 2 ranks only (its engine needs a process group)
DEEPSPEED_CASES = [case_deepspeed_zero1, case_deepspeed_zero3]
CASES = [case_gradient_edit_without_accumulation, case_gradient_edit_with_accumulation,
         case_gradient_edit_with_accumulation_and_label_smoothing, case_bf16_autocast,
         case_gradient_checkpointing, case_lora_adapters,
         case_forward_edit_without_block, case_block_on_another_tensor_raises]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 3.0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cases = CASES[:-1] + (DEEPSPEED_CASES if world > 1 else []) + CASES[-1:]  # failure last
    run_cases(cases, args.out, rank, world, rank)


if __name__ == "__main__":
    sys.exit(main())
