"""A LoRA model (PEFT) under one engine (``--engine``: DDP, FSDP1, FSDP2, DeepSpeed ZeRO): its
adapters' gradients read in the body through the uniform parameter-gradient API, with and
without an edit of an activation gradient, and (except under DeepSpeed, whose backward scales
the loss itself) with a loss scaler (``backward(scaler=...)``). Started once per rank by
tests/test_peft.py.

The oracle is one process with plain autograd on the global batch (a tensor hook does the
edit); every engine averages over ranks, so the oracle's gradients are divided by the world
size. fp32, atol 1e-5 (cases.ATOL).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

import distgrad
from cases import close, run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from distgrad.demo.ranks import start_process_group, wrap_with_engine

torch.set_num_threads(1)
SCALE = 1e-3  # losses are logits.sum() * SCALE: gradients of order 1 (see job.py)
ROWS = 2      # per rank
LORA = [f"transformer.h.{i}.attn.c_attn.lora_{ab}.default.weight" for i in (0, 1) for ab in "AB"]


def build_lora():
    """The same LoRA GPT-2 on every rank. init_lora_weights=False: B is random too, so both A
    and B get gradients and the adapter changes the forward."""
    net = build_gpt2()
    torch.manual_seed(3)
    return get_peft_model(net, LoraConfig(r=4, target_modules=["c_attn"],
                                          init_lora_weights=False))


def global_ids(world: int):
    return torch.randint(0, 384, (ROWS * world, 8), generator=torch.Generator().manual_seed(5))


def oracle(ids, edit: float):
    """Plain autograd: the LoRA weights' gradients with h[0]'s output gradient times ``edit``."""
    net = build_lora()

    def on_output(mod, args, out):
        out.register_hook(lambda g: g * edit)

    net.base_model.model.transformer.h[0].register_forward_hook(on_output)
    (net(ids).logits.sum() * SCALE).backward()
    return {name: p.grad for name, p in net.base_model.model.named_parameters()
            if name in LORA}


def lora_weight(model, name):
    """``model.transformer.h[i].attn.c_attn.lora_A["default"].weight``: the envoy path."""
    block, ab = int(name.split(".")[2]), name.split(".")[5]
    adapters = getattr(model.transformer.h[block].attn.c_attn, ab)
    return adapters["default"].weight


def traced(model, local, edit: float | None) -> dict:
    """One trace: h[0]'s gradient edited (or only read), the LoRA gradients read in the body
    after the backward block, through the envoy paths."""
    with model.trace(local):
        h0 = model.transformer.h[0].output
        with (model.output.logits.sum() * SCALE).backward():
            if edit is None:
                h0.grad.save()
            else:
                h0.grad = h0.grad * edit
        grads = {name: lora_weight(model, name).grad.clone() for name in LORA}
    return grads


def clear_grads(wrapped):
    if type(wrapped).__name__ == "DeepSpeedEngine":
        wrapped.step()  # lr 0: clears ZeRO's partitioned gradients, leaves the weights
    else:
        wrapped.zero_grad(set_to_none=True)


def check(model, wrapped, rank, world, edit):
    ids = global_ids(world)
    local = ids[rank * ROWS:(rank + 1) * ROWS]
    ref = oracle(ids, 1.0 if edit is None else edit)
    plain = oracle(ids, 1.0)
    got = traced(model, local, edit)
    clear_grads(wrapped)
    for name in LORA:
        close(got[name], ref[name] / world, f"{name} (edit {edit})")
        # h[0]'s adapters lie upstream of the edit, h[1]'s downstream: the edit must change
        # the former (else the case tests nothing) and can change the latter by no means
        upstream = name.startswith("transformer.h.0.")
        if edit is not None and upstream == torch.allclose(ref[name], plain[name], atol=1e-4):
            raise AssertionError(f"{name}: the edit {'does not change' if upstream else 'changes'} "
                                 f"it in the oracle")


def case_lora_grads(model, wrapped, rank, world):
    check(model, wrapped, rank, world, None)


def case_lora_grads_after_an_edit(model, wrapped, rank, world):
    check(model, wrapped, rank, world, 3.0)


def case_lora_grads_with_a_scaler(model, wrapped, rank, world):
    """``backward(scaler=...)`` under DDP: h[0]'s gradient read unscaled and clipped (an edit
    that is not linear, so one applied to the scaled gradient would give other numbers); the
    oracle scales its loss, and its hook unscales, clips and scales back by hand."""
    ids = global_ids(world)
    local = ids[rank * ROWS:(rank + 1) * ROWS]
    scale = 2.0 ** 10
    net, seen = build_lora(), {}

    def on_output(mod, args, out):
        def on_grad(g):
            seen["g0"] = g / scale
            return (g / scale).clamp(-1e-4, 1e-4) * scale

        out.register_hook(on_grad)

    net.base_model.model.transformer.h[0].register_forward_hook(on_output)
    (net(ids).logits.sum() * SCALE * scale).backward()
    ref = {name: p.grad for name, p in net.base_model.model.named_parameters() if name in LORA}
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    with model.trace(local):
        h0 = model.transformer.h[0].output
        with (model.output.logits.sum() * SCALE).backward(scaler=scaler):
            g0 = h0.grad.save()
            h0.grad = h0.grad.clamp(-1e-4, 1e-4)
        got = {name: lora_weight(model, name).grad.clone() for name in LORA}
    clear_grads(wrapped)
    close(g0, seen["g0"] if rank == 0 else seen["g0"][rank * ROWS:(rank + 1) * ROWS],
          "h[0] gradient, unscaled")
    for name in LORA:  # scaled, as PyTorch leaves parameter gradients until scaler.step
        close(got[name] / scale, ref[name] / scale / world, f"{name} (scaler)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", default="ddp")
    args = parser.parse_args()
    distgrad.config.failure_timeout = 3.0
    start_process_group(args.engine)
    wrapped, _ = wrap_with_engine(args.engine, build_lora(), lr=0.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = distgrad.wrap(wrapped)
    cases = [case_lora_grads, case_lora_grads_after_an_edit]
    if not args.engine.startswith("zero"):
        cases.append(case_lora_grads_with_a_scaler)
    run_cases(cases, args.out, rank, model, wrapped, rank, world)


if __name__ == "__main__":
    sys.exit(main())
