"""The GPT-2 of the data-parallel jobs on one process, with plain autograd: the oracle that
job.py's cases (and invoke_cases.py's) check every rank's numbers against.

Losses are ``logits.sum() * SCALE``: gradients of order 1, so that atol 1e-5 (cases.ATOL) is a
fair test of fp32 numbers summed in a different order (an all-reduce) rather than of their
magnitude."""
from __future__ import annotations

import torch

from distgrad.demo.models import build_gpt2

SCALE = 1e-3


def global_ids(n_rows: int):
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, 384, (n_rows, 8), generator=g)


def rows_of(rank: int, sizes: list[int]) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def oracle(ids, edit: float = 1.0):
    """Plain autograd on one process: h[0]'s output and gradient, h[1]'s output, param grads.
    ``edit`` multiplies h[0]'s gradient: a number, or per row (a tensor of shape [rows, 1, 1])."""
    net = build_gpt2()
    seen = {}

    def on_output(mod, args, out):
        seen["h0"] = out.detach().clone()

        def on_grad(g):
            seen["g0"] = g.detach().clone()
            return g * edit
        out.register_hook(on_grad)

    net.transformer.h[0].register_forward_hook(on_output)
    net.transformer.h[1].register_forward_hook(lambda m, a, o: seen.__setitem__("h1", o.detach().clone()))
    out = net(ids)
    (out.logits.sum() * SCALE).backward()
    seen["params"] = {n: p.grad.clone() for n, p in net.named_parameters()}
    seen["losses"] = out.logits.detach()
    return seen


PARAMS = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.bias",
          "transformer.wpe.weight"]


def param_envoy(model, name):
    obj = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj
