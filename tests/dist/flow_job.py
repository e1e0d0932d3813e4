"""distgrad.flow on 2 ranks (``--engine ddp`` or ``fsdp2``), started once per rank by
tests/test_flow.py. Each rank runs its own rows of a global batch.

The oracle is plain autograd with raw hooks on one process: per rank, the gradient reaching
each block's output for that rank's rows; for parameters, the global batch's gradient divided
by the world size (the engines average). Norms compared relatively, rtol 1e-5 (fp32 sums).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import distgrad
import distgrad.flow
from cases import run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from distgrad.demo.ranks import device, start_process_group, wrap_with_engine

torch.set_num_threads(1)
SCALE = 1e-3  # losses are logits.sum() * SCALE: gradients of order 1 (see job.py)
RTOL = 1e-5
ROWS = 2      # per rank
ODD = 100.0   # rank 1's loss factor in the odd-rank case


def raw_norms(net, micro_batches, edit: float = 1.0, scale: float = SCALE, divide: float = 1.0):
    """Plain autograd over ``micro_batches`` (ids, loss factor) or plain ids: the norm of the
    gradient reaching each block's output (squares summed over the micro-batches; h[1]'s
    gradient read before it is multiplied by ``edit``), and each block's parameter-gradient norm
    after them, the gradients divided by ``divide`` first."""
    squares = [0.0] * len(net.transformer.h)

    def watch(i):
        def on_output(mod, args, out):
            out.register_hook(lambda g: squares.__setitem__(i, squares[i] + g.double().pow(2).sum().item()))
            if i == 1 and edit != 1.0:
                out.register_hook(lambda g: g * edit)  # after the norm's hook: as the body edits
        return on_output

    hooks = [block.register_forward_hook(watch(i)) for i, block in enumerate(net.transformer.h)]
    for item in micro_batches:
        ids, factor = item if isinstance(item, tuple) else (item, 1.0)
        (net(ids).logits.sum() * scale * factor).backward()
    for hook in hooks:
        hook.remove()
    params = [torch.stack([(p.grad.double() / divide).pow(2).sum() for p in block.parameters()]).sum().sqrt()
              for block in net.transformer.h]
    return torch.tensor(squares).sqrt(), torch.stack(params).float()


def global_ids(world: int, seed: int):
    return torch.randint(0, 384, (ROWS * world, 8), generator=torch.Generator().manual_seed(seed))


def mine(ids, rank):
    return ids[rank * ROWS:(rank + 1) * ROWS]


def close(got, want, what):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want.float(), rtol=RTOL,
                               atol=0, msg=lambda m: f"{what}: {m}")


def clear_grads(wrapped):
    if type(wrapped).__name__ == "DeepSpeedEngine":
        # ZeRO keeps accumulating into its partitioned buffers until an optimizer step; the
        # job's optimizer has lr=0, so a step clears them and leaves the weights alone.
        wrapped.step()
    else:
        wrapped.zero_grad(set_to_none=True)


def traced_steps(model, wrapped, flow, rank, seeds, factor=1.0):
    for seed in seeds:
        with model.trace(mine(global_ids(flow.world, seed), rank)):
            with (model.output.logits.sum() * SCALE * factor).backward():
                pass
        flow.step()  # DeepSpeed: after engine.backward, before engine.step()
        clear_grads(wrapped)


def case_norms_match_raw_hooks(model, wrapped, rank, world, out):
    """Per rank: its own rows' activation-gradient norms; global: the root of the summed
    squares; parameters: the averaged gradient's norm, every rank recording the same."""
    seeds = [11, 12]
    with distgrad.flow.Recorder(model, layers="transformer.h") as flow:
        traced_steps(model, wrapped, flow, rank, seeds)
    for record, seed in zip(flow.run.steps, seeds):
        ids = global_ids(world, seed)
        per_rank = [raw_norms(build_gpt2(), [mine(ids, r)])[0] for r in range(world)]
        for r in range(world):
            close(record["activation"][r], per_rank[r], f"rank {r}'s activation norms")
        close(record["activation_global"], torch.stack(per_rank).pow(2).sum(0).sqrt(), "global activation norms")
        params = raw_norms(build_gpt2(), [ids], divide=world)[1]
        close(record["param_global"], params, "global parameter norms")
    assert flow.run.odd_ranks() == {}, flow.run.odd_ranks()


def case_odd_rank(model, wrapped, rank, world, out):
    """Rank 1's loss is 100x: every rank names rank 1, and rank 0's file (the CLI test draws
    it) records it; the parameter norm is that of the average with rank 1's part 100x."""
    seeds = [21, 22, 23]
    with distgrad.flow.Recorder(model, layers="transformer.h") as flow:
        traced_steps(model, wrapped, flow, rank, seeds, factor=ODD if rank == 1 else 1.0)
    odd = flow.run.odd_ranks()
    assert list(odd) == [1] and "x larger" in odd[1], odd  # (its own rows: about 100x)
    ids = global_ids(world, seeds[-1])
    batches = [(mine(ids, r), ODD if r == 1 else 1.0) for r in range(world)]
    close(flow.run.steps[-1]["param_global"], raw_norms(build_gpt2(), batches, divide=world)[1],
          "global parameter norms with rank 1 scaled")
    path = os.path.join(out, f"run{rank}.json")
    flow.save(path)
    assert os.path.exists(path) == (rank == 0), "only rank 0 writes the file"


def hooks_on(net) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()]


def expect_refusal(build, net, says: str) -> None:
    """``build()`` (a Recorder) raises NotImplementedError saying ``says`` on this rank (every
    rank runs it: none may go on to wait in step()'s collective), and leaves no hook on
    ``net``."""
    before = hooks_on(net)
    try:
        build()
    except NotImplementedError as exc:
        if says not in str(exc):
            raise
    else:
        raise AssertionError("the Recorder was built")
    assert hooks_on(net) == before, "the refused Recorder left hooks behind"


def case_flow_refuses_flat_params(model, wrapped, rank, world):
    """FSDP1 with use_orig_params=False (built here: the job's model keeps its original
    parameters) has only flat gradients spanning blocks: Recorder refuses on every rank,
    naming use_orig_params=True, whichever layers it is given."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    net = build_gpt2()
    flat = FullyShardedDataParallel(net, use_orig_params=False, device_id=device(),
                                    auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    flat_model = distgrad.wrap(flat)
    for layers in ("transformer.h", ["transformer.h.1"]):
        expect_refusal(lambda: distgrad.flow.Recorder(flat_model, layers=layers), flat,
                       "use_orig_params=True")


CASES = [case_norms_match_raw_hooks, case_odd_rank]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 3.0
    start_process_group(args.engine)
    wrapped, options = wrap_with_engine(args.engine, build_gpt2(), lr=0.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = distgrad.wrap(wrapped, accelerator=options.get("accelerator"))
    run_cases(CASES, args.out, rank, model, wrapped, rank, world, args.out)


if __name__ == "__main__":
    sys.exit(main())
