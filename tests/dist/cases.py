"""What every job in tests/dist shares: comparing numbers, and running cases in one process
group with each case's outcome written per rank for pytest to read."""
from __future__ import annotations

import json
import os
import time
import traceback

import torch.distributed as dist

ATOL = 1e-5


def close(a, b, what: str, atol: float = ATOL) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != {list(b.shape)}")
    diff = (a - b).abs().max().item()
    if diff > atol:
        raise AssertionError(f"{what}: max abs diff {diff:.3g} > {atol}")


def expect_failure_of_rank1(rank: int, run, must_say=("rank 1",), within: float = 30) -> None:
    """``run()`` makes a trace whose body raises ZeroDivisionError on rank 1. Rank 1 must get
    its own error; every other rank a RankFailedError saying ``must_say``, within ``within`` s."""
    import distgrad
    start = time.monotonic()
    try:
        run()
    except ZeroDivisionError:
        if rank != 1:
            raise
        return
    except distgrad.RankFailedError as exc:
        took = time.monotonic() - start
        if rank == 1 or any(text not in str(exc) for text in must_say):
            raise AssertionError(f"wrong failure report on rank {rank}: {exc}")
        if took > within:
            raise AssertionError(f"the failure took {took:.1f} s to arrive")
        return
    raise AssertionError("no error reached this rank")


def expect_error(run, error, says: str, heard: bool = True) -> None:
    """``run()`` must raise ``error`` with ``says`` in its message on this rank or - when
    ``heard`` - a RankFailedError naming ``error``, from a rank that raised it first."""
    import distgrad
    try:
        run()
    except error as exc:
        if says not in str(exc):
            raise
        # what unwound distgrad's run on the way is not shown as the error's context
        assert type(exc.__context__).__name__ != "_Abort", "the error's context is an _Abort"
    except distgrad.RankFailedError as exc:
        if not heard or error.__name__ not in str(exc):
            raise
    else:
        raise AssertionError(f"no {error.__name__}")


def run_cases(cases, out: str, rank: int, *args) -> dict:
    """Run ``case(*args)`` for each case; ``out/rank{rank}.json`` says "ok" or the traceback,
    rewritten after every case (a rank that dies leaves what it had). Destroys the group; an
    error doing so is recorded as "teardown"."""
    results = {}

    def write():
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)

    for case in cases:
        try:
            case(*args)
            results[case.__name__] = "ok"
        except Exception:
            results[case.__name__] = traceback.format_exc()
        write()
    try:
        if dist.is_initialized():  # a failure case leaves it destroyed on every rank
            dist.destroy_process_group()
    except Exception as exc:  # recorded: a clean exit is part of the contract
        results["teardown"] = repr(exc)
        write()
    return results
