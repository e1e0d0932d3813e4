"""One multi-process job: every case for one engine in one process group.

Started once per rank by tests/test_distributed.py (RANK, WORLD_SIZE, MASTER_ADDR/PORT set).
Each rank writes ``<out>/rank<r>.json``: case -> "ok" or what went wrong. The oracle is one
process with plain autograd on the global batch (every rank computes it; it is tiny).
Tolerances: fp32; activations and their gradients atol 1e-5, parameter gradients atol 1e-5
after the engine's average over ranks (DDP and FSDP average: the oracle divides by world size).
"""
from __future__ import annotations

import os
import sys

if os.environ.get("DISTGRAD_TEST_EXIT_RACE") == "1":  # before any import registers at exit
    import exit_race  # noqa: E402  (tests/dist is the script's folder)
    exit_race.arm(sys.argv[sys.argv.index("--out") + 1], int(os.environ["RANK"]))

import argparse
import logging
import signal

import torch
import torch.distributed as dist

import distgrad
from cases import close, expect_error, expect_failure_of_rank1, run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from distgrad.demo.ranks import start_process_group, wrap_with_engine
from dp_leaks import check_no_cycles  # noqa: E402
from ddp_backwards import CASES as DDP_BACKWARDS  # noqa: E402
from flow_job import case_flow_refuses_flat_params, case_norms_match_raw_hooks, clear_grads  # noqa: E402
from gpt2_oracle import PARAMS, SCALE, global_ids, oracle, param_envoy, rows_of  # noqa: E402
from invoke_cases import case_invokes  # noqa: E402
from saves_cases import case_gather_memory, case_saves, case_steady_saves, case_uneven  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
torch.set_num_threads(1)

def case_read_edit(model, wrapped, rank, world):
    sizes = [2] * world
    ids = global_ids(sum(sizes))
    local = ids[rows_of(rank, sizes)]
    ref = oracle(ids, edit=2.0)
    with model.trace(local):
        a1 = model.transformer.h[0].output
        h1 = model.transformer.h[1].output.save()
        loss = model.output.logits.sum() * SCALE
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    if rank == 0:
        close(g, ref["g0"], "gathered h[0] gradient")
        close(h1, ref["h1"], "gathered h[1] output")
    else:
        close(g, ref["g0"][rows_of(rank, sizes)], "rank-local h[0] gradient")
    for name in PARAMS:  # a collective on sharded engines: every rank reads
        got = param_envoy(model, name).grad
        close(got, ref["params"][name] / world, f"reduced grad of {name}")
    clear_grads(wrapped)


def case_watch_only_in_traces(model, wrapped, rank, world):
    """The failure watcher reads the store only while a trace runs."""
    engine = model._engine
    engine = getattr(engine, "inner", engine)  # accelerate composes another engine
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]
    with model.trace(ids):
        during = engine.failure_watcher.active.is_set()
        model.output.logits.save()
    if not during or engine.failure_watcher.active.is_set():
        raise AssertionError(f"watcher active during a trace: {during}, after it: "
                             f"{engine.failure_watcher.active.is_set()}")


def case_param_write(model, wrapped, rank, world):
    sizes = [2] * world
    ids = global_ids(sum(sizes))
    with model.trace(ids[rows_of(rank, sizes)]):
        with (model.output.logits.sum() * SCALE).backward():
            pass
    weight = model.transformer.h[1].mlp.c_fc.weight
    weight.grad = weight.grad * 0.5
    ref = oracle(ids)["params"]["transformer.h.1.mlp.c_fc.weight"] / world
    close(weight.grad, ref * 0.5, "gradient after assignment through distgrad")
    real = getattr(weight, "param", weight)
    from torch.distributed.tensor import DTensor
    if isinstance(real, DTensor):  # the stored gradient must stay a shard an optimizer can use
        if not isinstance(real.grad, DTensor) or real.grad.placements != real.placements:
            raise AssertionError(f"assigned gradient stored as {type(real.grad).__name__}")
        torch.optim.SGD([real], lr=0.0).step()
    clear_grads(wrapped)


def case_rank_dependent_save(model, wrapped, rank, world):
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]
    try:
        with model.trace(ids):
            out = model.output.logits
            if rank == 0:
                out.save()
    except ValueError as exc:
        if "different numbers" not in str(exc):
            raise
        return
    raise AssertionError("a save on rank 0 only did not raise")


def case_different_values_saved(model, wrapped, rank, world):
    """Rank r saves the gradient (then the output) of h[r % 2]: same shapes, different values.
    Joined, they would make one tensor of two modules' rows; every rank must raise, naming what
    each rank saved. The same saves on every rank then still give the oracle's numbers, with a
    value computed in the body (no module's value) saved next to them."""
    sizes = [2] * world
    ids = global_ids(sum(sizes))
    local = ids[rows_of(rank, sizes)]
    mine = rank % 2
    for kind in ("output.grad", "output"):
        try:
            with model.trace(local):
                a = model.transformer.h[mine].output
                if kind == "output":
                    a.save()
                with (model.output.logits.sum() * SCALE).backward():
                    if kind == "output.grad":
                        a.grad.save()
        except ValueError as exc:
            for r in range(world):
                named = f"rank {r}: model.transformer.h[{r % 2}].{kind}"
                if f"{named}," not in str(exc) and f"{named})" not in str(exc):
                    raise AssertionError(f"{named!r} not in: {exc}") from exc
        else:
            raise AssertionError(f"ranks saving h[0] and h[1]'s {kind} did not raise")
        clear_grads(wrapped)
    ref = oracle(ids)
    with model.trace(local):
        a = model.transformer.h[0].output
        loss = model.output.logits.sum() * SCALE
        with loss.backward():
            g = a.grad.save()
        total = loss.detach().save()
    if rank == 0:
        close(g, ref["g0"], "gathered h[0] gradient after the error")
        close(total, torch.stack([ref["losses"][rows_of(r, sizes)].sum() * SCALE
                                  for r in range(world)]), "saved loss")
    clear_grads(wrapped)


def case_rank_dependent_param_grad(model, wrapped, rank, world):
    """A parameter's gradient read on rank 0 only, inside the trace. Where the read is a local
    tensor (DDP) it works; where it is a collective (FSDP, ZeRO) the other rank never makes it:
    rank 0 raises TraceStateError after three failure-timeout slices, instead of waiting until
    gloo's timeout (or gloo aborting rank 1 on mismatched sizes), and rank 1 hears of it."""
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]

    def run():
        with model.trace(ids):
            with (model.output.logits.sum() * SCALE).backward():
                pass
            if rank == 0:
                model.transformer.h[1].mlp.c_fc.weight.grad

    if model._engine.param_agreement is None:  # a local read: nothing to agree on
        run()
        clear_grads(wrapped)
        return
    expect_error(run, distgrad.TraceStateError, "different values on different ranks")


# the rank case_failure fails on: 1, or on several nodes one of the last node's ranks
FAILING = int(os.environ.get("DISTGRAD_FAILING_RANK", "1"))


def case_failure(model, wrapped, rank, world):
    """Rank FAILING fails in the body before the backward; every rank must raise, none hang."""
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]

    def run():
        with model.trace(ids):
            a1 = model.transformer.h[0].output
            loss = model.output.logits.sum()
            if rank == FAILING:
                1 / 0
            with loss.backward():
                a1.grad

    expect_failure_of_rank1(rank, run, must_say=(f"rank {FAILING}", "ZeroDivisionError"),
                            failing=FAILING)


def case_killed(model, wrapped, rank, world):
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]

    def run():
        with model.trace(ids):
            a1 = model.transformer.h[0].output
            loss = model.output.logits.sum()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            with loss.backward():
                a1.grad

    expect_error(run, distgrad.RankFailedError, "stopped answering", heard=False)


def case_no_cycles(model, wrapped, rank, world):
    """Traces of the README program leave no tensor in cyclic garbage (see dp_leaks.py)."""
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]

    def plain_step():  # the engine without distgrad
        loss = wrapped(ids).logits.sum() * SCALE
        wrapped.backward(loss) if type(wrapped).__name__ == "DeepSpeedEngine" else loss.backward()
        clear_grads(wrapped)

    check_no_cycles(model, ids, SCALE, lambda: clear_grads(wrapped), plain_step)


def case_fails_on_rank1(model, wrapped, rank, world):
    """The harness's own check (tests/test_distributed.py names it; no engine test runs it):
    rank 1 fails an assertion while the others go on into a trace whose backward waits for
    rank 1 in DDP's all-reduce. The job must end in seconds, showing rank 1's assertion."""
    assert rank != 1, "deliberate failure on rank 1"
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]
    with model.trace(ids):
        with model.output.logits.sum().backward():
            pass


# a method each engine's wrapper has and the user's GPT-2 lacks (FSDP2's is on the sharded
# module itself, which is the user's module)
WRAPPER_METHODS = {"ddp": "no_sync", "accelerate": "no_sync", "fsdp1": "no_sync",
                   "fsdp2": "set_requires_gradient_sync", "zero1": "zero_optimization_stage",
                   "zero2": "zero_optimization_stage", "zero3": "zero_optimization_stage"}


def case_wrapper_names(model, wrapped, rank, world):
    """``model.<name>`` for a name the user's module lacks is the engine wrapper's own, so that
    ``model.no_sync()`` and ``accelerator.accumulate(model)`` reach it; a step inside
    ``model.no_sync()`` (where there is one) traces and gives this rank's own parameter
    gradients (FSDP1: a clear error, it cannot gather them until they are reduced)."""
    engine = os.environ["DISTGRAD_ENGINE"]
    method = getattr(model, WRAPPER_METHODS[engine])
    assert method.__self__ is wrapped, f"model.{WRAPPER_METHODS[engine]} is not the wrapper's"
    assert not hasattr(build_gpt2(), WRAPPER_METHODS[engine]) or engine == "fsdp2"
    if WRAPPER_METHODS[engine] != "no_sync":
        return
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]
    with model.no_sync():
        with model.trace(ids):
            with (model.output.logits.sum() * SCALE).backward():
                pass
    if engine == "fsdp1":  # it cannot gather gradients accumulated under no_sync: an error
        expect_error(lambda: param_envoy(model, PARAMS[0]).grad, ValueError, "no_sync()",
                     heard=False)
    else:
        own = oracle(ids)["params"]  # this rank's rows only: no all-reduce inside no_sync
        for name in PARAMS:
            close(param_envoy(model, name).grad, own[name], f"{name}.grad inside no_sync")
    with model.trace(ids):  # the synchronising backward: the average over the ranks again
        with (model.output.logits.sum() * SCALE).backward():
            pass
    clear_grads(wrapped)


def case_generate_result(model, wrapped, rank, world):
    """``tracer.result`` in a generate trace on every rank: rank 0 holds every rank's generated
    ids (rows in rank order), each rank its own; they equal plain ``generate`` on one process,
    with and without an edit at every decoding step."""
    ids = global_ids(2 * world)
    mine = ids[rows_of(rank, [2] * world)]
    for scale in (1.0, 0.5):
        with model.generate(mine, max_new_tokens=3, do_sample=False) as tracer:
            if scale != 1.0:
                for step in range(3):  # one call of the block per decoding step
                    block = model.transformer.h[0].call(step)
                    block.output = block.output * scale
            result = tracer.result.save()
        net = build_gpt2()
        handle = net.transformer.h[0].register_forward_hook(lambda m, a, out: out * scale)
        expected = net.generate(ids, max_new_tokens=3, do_sample=False)
        handle.remove()
        want = expected if rank == 0 else expected[rows_of(rank, [2] * world)]
        assert torch.equal(result, want), f"generated ids (scale {scale}) differ from generate's"


def case_param_grad_save(model, wrapped, rank, world):
    """``model.<param>.grad.save()``: where ``.grad`` is the parameter's own tensor (DDP,
    accelerate's DDP), the end-of-trace gather would rebind it to every rank's copies joined,
    so it raises on every rank and leaves the gradient as it was (and the failure destroys the
    group); where it is a fresh full copy (FSDP, ZeRO), it is gathered as any value. A copy
    (``.clone().save()``) is gathered everywhere."""
    ids = global_ids(2 * world)[rows_of(rank, [2] * world)]
    rows = build_gpt2().transformer.h[0].mlp.c_fc.weight.shape[0]  # (FSDP1 shows a flat shard)
    joined = (world if rank == 0 else 1) * rows

    def step(save):
        with model.trace(ids):
            with (model.output.logits.sum() * SCALE).backward():
                pass
            return save(param_envoy(model, PARAMS[0]).grad)

    copy = step(lambda grad: grad.clone().save())
    assert copy.shape[0] == joined, (copy.shape, joined)
    clear_grads(wrapped)
    if os.environ["DISTGRAD_ENGINE"] in ("ddp", "accelerate"):
        own = wrapped.module.transformer.h[0].mlp.c_fc.weight
        expect_error(lambda: step(lambda grad: grad.save()), ValueError,
                     "the model's own parameter gradient", heard=False)
        assert own.grad.shape == own.shape, "the parameter's .grad was rebound"
    else:
        assert step(lambda grad: grad.save()).shape[0] == joined
        clear_grads(wrapped)


def case_flow(model, wrapped, rank, world):
    """distgrad.flow's norms on this engine against raw hooks (flow_job.py's case; rtol 1e-5)."""
    case_norms_match_raw_hooks(model, wrapped, rank, world, None)


CASES = {"all": [case_wrapper_names, case_generate_result, case_read_edit, case_saves, case_steady_saves, case_gather_memory, case_uneven, case_watch_only_in_traces, case_param_write,
                 case_rank_dependent_save, case_different_values_saved, case_no_cycles, case_param_grad_save, case_flow, case_invokes, case_failure],
         "flow": [case_flow],
         "fails_on_rank1": [case_fails_on_rank1, case_saves],
         "gather_memory": [case_gather_memory],
         "killed": [case_killed], "rank_dependent_param_grad": [case_rank_dependent_param_grad],
         # many ranks or nodes: parity, gathers of every rank's rows, uneven batches, a failure
         "at_scale": [case_read_edit, case_saves, case_uneven, case_generate_result, case_failure]}
# one engine's own cases, run by "all" before case_failure
ENGINE_CASES = {"fsdp1": [case_flow_refuses_flat_params], "ddp": DDP_BACKWARDS,
                "accelerate": DDP_BACKWARDS}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True)
    parser.add_argument("--cases", default="all")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 3.0
    os.environ["DISTGRAD_ENGINE"] = args.engine
    start_process_group(args.engine)
    wrapped, options = wrap_with_engine(args.engine, build_gpt2(), lr=0.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = distgrad.wrap(wrapped, accelerator=options.get("accelerator"))
    cases = CASES[args.cases]
    if args.cases == "all":
        cases = cases[:-1] + ENGINE_CASES.get(args.engine, []) + cases[-1:]
    run_cases(cases, args.out, rank, model, wrapped, rank, world)

if __name__ == "__main__":
    sys.exit(main())
