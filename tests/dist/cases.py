"""What every job in tests/dist shares: comparing numbers, and running cases in one process
group with each case's outcome written per rank for pytest to read."""
from __future__ import annotations

import json
import os
import traceback

import torch.distributed as dist

ATOL = 1e-5


def close(a, b, what: str, atol: float = ATOL) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != {list(b.shape)}")
    diff = (a - b).abs().max().item()
    if diff > atol:
        raise AssertionError(f"{what}: max abs diff {diff:.3g} > {atol}")


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
