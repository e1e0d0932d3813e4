"""distgrad.flow under tensor parallelism: a case of tp_job.py (layouts tp, sp and fsdp-tp).

Oracle: the unsplit Llama on one process, the global batch, raw hooks on the decoder layers'
outputs (each rank's row is the part of that gradient it holds: all of it where the layer's
output is replicated over the tensor-parallel ranks, its sequence half under sp, its data-parallel
rows under fsdp-tp); parameters: the gradient of the loss fsdp averages (divided by dp).
Norms compared relatively, rtol 1e-5 (fp32 sums of squares).
"""
from __future__ import annotations

import torch

import distgrad
import distgrad.flow
from distgrad.demo.models import build_llama

RTOL = 1e-5
SCALE = 1e-3
SEQ = 8


def ids_of(seed: int, rows: int):
    return torch.randint(0, 384, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def oracle(batches, dp: int):
    """Per layer: the gradient reaching its output over the global batch of each backward,
    and the parameter-gradient norm after all of them (loss / dp, as the engines average)."""
    net = build_llama()
    grads = {i: [] for i in range(len(net.model.layers))}

    def watch(i):
        def on_output(mod, args, out):
            out = out[0] if isinstance(out, tuple) else out
            out.register_hook(lambda g: grads[i].append(g.detach().double()))
        return on_output

    for i, layer in enumerate(net.model.layers):
        layer.register_forward_hook(watch(i))
    for ids in batches:
        (net(ids).logits.sum() * SCALE / dp).backward()
    params = [torch.stack([p.grad.double().pow(2).sum() for p in layer.parameters()]).sum().sqrt()
              for layer in net.model.layers]
    return grads, torch.stack(params)


def near(got, want, what):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.double(), rtol=RTOL,
                               atol=0, msg=lambda m: f"{what}: {m}")


def case_flow(model, net, ctx):
    """Two backward passes in one step: every rank's row and the global norms against the
    unsplit model (under sp the norm weights' Partial gradients summed per group before
    squaring). Under sp both decoder layers return sequence shards, declared with tp_shards;
    undeclared (the job's own wrap names layer 0 only), the step raises; ranks holding
    different Partial gradients raise too."""
    rank, dp, dp_rank, tp_rank, sequence = ctx
    world = 2 * dp  # tensor-parallel pairs
    kwargs = {"position_ids": torch.arange(SEQ)[None]} if sequence else {}
    batches = [ids_of(31, 2 * dp), ids_of(32, 2 * dp)]
    if sequence:
        flow_model = distgrad.wrap(net, tp_shards={"model.layers.0": 1, "model.layers.1": 1})
    else:
        flow_model = model
    with distgrad.flow.Recorder(flow_model, layers="model.layers") as flow:
        for ids in batches:
            with flow_model.trace(ids[2 * dp_rank: 2 * dp_rank + 2], **kwargs):
                with (flow_model.output.logits.sum() * SCALE).backward():
                    pass
        record = flow.step()
        net.zero_grad(set_to_none=True)
    grads, params = oracle(batches, dp)
    # the oracle's gradients are of loss / dp: each rank's own loss is not divided
    whole = [torch.stack([g * dp for g in grads[i]]) for i in range(len(grads))]
    near(record["activation_global"], torch.stack([g.pow(2).sum().sqrt() for g in whole]),
         "global activation norms")
    for r in range(world):
        d, t = (r // 2, r % 2) if dp > 1 else (0, r)
        mine = []
        for g in whole:
            part = g[:, 2 * d: 2 * d + 2] if dp > 1 else g
            if sequence:
                part = part[:, :, t * SEQ // 2:(t + 1) * SEQ // 2]
            mine.append(part.pow(2).sum().sqrt())
        near(record["activation"][r], torch.stack(mine), f"rank {r}'s activation norms")
    near(record["param_global"], params, "global parameter norms")
    if sequence:
        uneven_partials(flow_model, net, kwargs, tp_rank)
        undeclared(model, net, kwargs)


def uneven_partials(model, net, kwargs, tp_rank):
    """The norm weights' gradients are Partial (each rank's sum over its positions), and the
    step sums every rank's pieces at the same offsets. Rank 1 drops one of layer 1's (fewer
    pieces), then the other of its two (as many pieces, of another parameter): step() raises
    on every rank, naming the layer, instead of failing the all_gather or adding unlike pieces."""
    layer = net.model.layers[1]
    for dropped in ({0: None, 1: "input_layernorm"},
                    {0: "input_layernorm", 1: "post_attention_layernorm"}):
        with distgrad.flow.Recorder(model, layers="model.layers") as flow:
            with model.trace(ids_of(34, 2), **kwargs):
                with (model.output.logits.sum() * SCALE).backward():
                    pass
            if dropped[tp_rank] is not None:
                getattr(layer, dropped[tp_rank]).weight.grad = None
            try:
                flow.step()
            except RuntimeError as exc:
                if "model.layers.1" not in str(exc) or "Partial" not in str(exc):
                    raise
            else:
                raise AssertionError(f"ranks' Partial pieces differ ({dropped}), and step() took them")
            net.zero_grad(set_to_none=True)


def undeclared(model, net, kwargs):
    """Layer 1 returns a sequence shard the wrap was not told of: the ranks' squares of that
    'same' value differ, and step() raises on every rank, naming it and tp_shards."""
    with distgrad.flow.Recorder(model, layers="model.layers") as flow:
        with model.trace(ids_of(33, 2), **kwargs):
            with (model.output.logits.sum() * SCALE).backward():
                pass
        try:
            flow.step()
        except RuntimeError as exc:
            if "model.layers.1" not in str(exc) or "tp_shards" not in str(exc):
                raise
        else:
            raise AssertionError("an undeclared sequence shard was divided as a copy")
        net.zero_grad(set_to_none=True)
