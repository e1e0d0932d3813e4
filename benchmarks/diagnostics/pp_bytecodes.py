"""Python bytecodes one pipeline step runs, on one process: raw hooks, a distgrad body that
reads nothing, and the full body of ``pp_overhead.py``, with the functions that make the
differences.

    .venv/bin/python benchmarks/diagnostics/pp_bytecodes.py [--top 30]

The set-up is ``pp_one_process.py``'s (one stage holding the whole 4-block model, Schedule1F1B,
4 microbatches). Like ``bytecodes.py`` for the core, a count does not drift the way a timing
does on a shared machine, so it tells whether a change to the pipeline path made a step do
less. It counts Python only: tensor copies, greenlet switches and messages are not in it.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks this one builds on

from bytecodes import count
from pp_steps import one_process_steps

import distgrad.interleave.transports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30, help="functions to list per difference")
    args = parser.parse_args()
    net, steps = one_process_steps(256, "29534")
    counts = {}
    for name, step in steps.items():
        for _ in range(3):  # warm: parsed bodies, cached keys, specialised bytecode
            step()
            net.zero_grad(set_to_none=True)
        # pooled greenlets made before tracing started would not be traced
        distgrad.interleave.transports._idle.runners = []
        counts[name] = count(step)
        net.zero_grad(set_to_none=True)
    print("| step | bytecodes |\n|---|---:|")
    for name, found in counts.items():
        print(f"| {name} | {sum(found.values())} |")
    empty, full = "distgrad, a body that reads nothing", "distgrad"
    for more, less in ((empty, "raw hooks"), (full, empty)):
        diff = collections.Counter(
            {f: counts[more][f] - counts[less][f] for f in set(counts[more]) | set(counts[less])}
        )
        print(f"\n## {more} minus {less}: {sum(diff.values())}, top {args.top}\n")
        for where, n in diff.most_common(args.top):
            print(f"{n:8d}  {where}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
