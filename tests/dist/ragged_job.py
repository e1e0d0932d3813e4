"""Ragged saves on 2 ranks: each rank's batch has its own sequence length, as when a trainer
pads every rank's batch to that rank's longest row, under DDP and FSDP2 in one process group.

Started by tests/test_ragged_saves.py. Rank r runs 2 rows of ``LENGTHS[r]`` tokens. The saved
outputs, gradients and logits are checked against one process with plain autograd on each
rank's rows (forward hooks, tensor hooks; the loss of a rank's rows is its own, so each rank's
activation gradients are those of its loss): each rank's part of the padded global value
(``distgrad.rank_parts``), NaN everywhere else, the opt-out ``gather="none"``, and the errors
for a ragged integer save, for saves of different numbers of dims or dtypes and for a join
dim the tensor lacks. Parameter gradients are checked too (DDP and FSDP2 average them: the
oracle's sum over ranks divided by 2).
Tolerance: fp32, rtol 1e-5, atol 1e-6 (torch.testing.assert_close).
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch
import torch.distributed as dist

import distgrad
from cases import expect_error, run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from distgrad.demo.ranks import start_process_group, wrap_with_engine
from flow_job import clear_grads  # noqa: E402
from gpt2_oracle import PARAMS, SCALE, param_envoy  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
torch.set_num_threads(1)
LENGTHS = [5, 8]  # tokens a row, per rank
ROWS = 2


def ids_of(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randint(0, 384, (ROWS, LENGTHS[rank]), generator=g)


def same(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def oracle(world: int) -> dict:
    """Plain autograd on one process, each rank's rows in their own forward (their lengths
    differ): per rank h[0]'s output and gradient and the logits; the parameter gradients of the
    ranks' losses summed."""
    net = build_gpt2()
    seen = {"h0": [], "g0": [], "logits": []}

    def on_output(mod, args, out):
        seen["h0"].append(out.detach().clone())
        out.register_hook(lambda g: seen["g0"].append(g.detach().clone()))

    net.transformer.h[0].register_forward_hook(on_output)
    for rank in range(world):
        logits = net(ids_of(rank)).logits
        (logits.sum() * SCALE).backward()
        seen["logits"].append(logits.detach())
    seen["params"] = {n: p.grad.clone() for n, p in net.named_parameters()}
    return seen


def check_padding(value, parts, dim, what):
    """Everything of ``value`` outside the ranks' parts is NaN."""
    outside = torch.ones(value.shape, dtype=torch.bool)
    at = 0
    for part in parts:
        index = [slice(at, at + n) if d == dim else slice(0, n) for d, n in enumerate(part.shape)]
        outside[tuple(index)] = False
        at += part.shape[dim]
    assert value[outside].isnan().all(), f"{what}: padding that is not NaN"
    assert not value[~outside].isnan().any(), f"{what}: NaN in the ranks' data"


def case_ragged_saves(model, wrapped, rank, world):
    ref = oracle(world)
    longest = max(LENGTHS)
    with model.trace(ids_of(rank)):
        h = model.transformer.h[0].output
        out = h.save()
        across = h.transpose(0, 1).save(dim=1)  # [tokens, rows, 64], joined on the rows
        logits = model.output.logits.save(gather="all")
        mine = model.output.logits.clone().save(gather="none")  # (another tensor)
        with (model.output.logits.sum() * SCALE).backward():
            g = h.grad.save()
    for name in PARAMS:  # a collective on FSDP2: every rank reads
        got = param_envoy(model, name).grad
        same(got, ref["params"][name] / world, f"averaged gradient of {name}")
    clear_grads(wrapped)
    same(mine, ref["logits"][rank], "gather='none' logits")
    same(logits.shape, torch.Size([ROWS * world, longest, 384]), "gather='all' shape")
    for r, part in enumerate(distgrad.rank_parts(logits)):
        same(part, ref["logits"][r], f"rank {r}'s logits of gather='all'")
    check_padding(logits, ref["logits"], 0, "gather='all' logits")
    if rank != 0:
        same(out, ref["h0"][rank], "rank-local output")
        same(g, ref["g0"][rank], "rank-local gradient")
        expect_error(lambda: distgrad.rank_parts(out), ValueError, "is not one", heard=False)
        return
    assert out.shape == (ROWS * world, longest, 64), out.shape
    assert across.shape == (longest, ROWS * world, 64), across.shape
    for value, expected, dim, what in [
        (out, ref["h0"], 0, "h[0] output"),
        (g, ref["g0"], 0, "h[0] gradient"),
        (across, [t.transpose(0, 1) for t in ref["h0"]], 1, "h[0] output joined on dim 1"),
    ]:
        parts = distgrad.rank_parts(value)
        assert len(parts) == world
        for r, part in enumerate(parts):
            same(part, expected[r], f"rank {r}'s part of the {what}")
        check_padding(value, expected, dim, what)


def case_ragged_errors(model, wrapped, rank, world):
    """Ragged integer ids cannot be padded with NaN; a save whose number of dims differs between
    the ranks cannot be joined, nor one whose dtype differs, nor one saved with a dim it does
    not have. Each raises on every
    rank, naming the save; the next trace works."""
    ids = ids_of(rank)

    def ragged_ids():
        with model.trace(ids):
            distgrad.save(model.transformer.wte.input)

    expect_error(ragged_ids, ValueError, "which torch.int64 cannot hold", heard=False)
    expect_error(ragged_ids, ValueError, "(model.transformer.wte.input", heard=False)

    def different_dims():
        with model.trace(ids):
            logits = model.output.logits * 1  # computed in the body, as its sum is
            (logits.sum(-1) if rank == 0 else logits).save()

    expect_error(different_dims, ValueError, "different numbers of dims", heard=False)

    def different_dtypes():
        with model.trace(ids):
            logits = model.output.logits * 1
            (logits.double() if rank == 1 else logits).save()

    expect_error(different_dtypes, ValueError, "has dtypes ['torch.float32', 'torch.float64']",
                 heard=False)

    def dim_out_of_range():
        with model.trace(ids):
            model.output.logits.save(dim=3)

    expect_error(dim_out_of_range, ValueError, "(model.output.logits) was saved with "
                 ".save(dim=3), but it has 3 dims", heard=False)
    with model.trace(ids):
        kept = distgrad.save(model.transformer.wte.input, gather="none")
        last = model.output.logits[:, -1].save()  # one shape on every rank: joined as ever
    assert torch.equal(kept, ids)
    if rank == 0:
        assert last.shape == (ROWS * world, 384), last.shape


CASES = [case_ragged_saves, case_ragged_errors]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 10.0
    start_process_group("ddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = []
    for engine in ("ddp", "fsdp2"):  # both in one process group
        wrapped, _ = wrap_with_engine(engine, build_gpt2(), lr=0.0)
        model = distgrad.wrap(wrapped)
        for case in CASES:
            def run(case=case, model=model, wrapped=wrapped):
                case(model, wrapped, rank, world)
            run.__name__ = f"{case.__name__}[{engine}]"
            cases.append(run)
    run_cases(cases, args.out, rank)


if __name__ == "__main__":
    sys.exit(main())
