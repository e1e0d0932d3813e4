"""Python bytecodes executed per further read+edit: distgrad vs raw hooks, and where they go.

    .venv/bin/python benchmarks/bytecodes.py [--top 25]

Timing on a shared 2-core machine drifts by tens of microseconds; a count of the bytecodes
each step runs does not. The count comes from ``sys.settrace`` with opcode events over one
step of part B of ``overhead.py`` at k=1 and at k=6 layers; (count(6) - count(1)) / 5 is what
one more read+edit adds, split by function. C work (greenlet switches, tensor copies) is not
counted, so this complements the timed benchmark and does not replace it.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from overhead import fresh, make_net, raw_step, traced_step_k

import distgrad


def count(step) -> collections.Counter:
    """Bytecodes run by ``step()``, per "file:function"."""
    counts = collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
        return tracer

    # greenlets of this thread run under the same trace function: runs are counted too
    sys.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(None)
    return counts


def per_extra(step_k) -> collections.Counter:
    for _ in range(3):  # warm caches (parsed bodies, children envoys, specialised bytecode)
        step_k(1), step_k(6)
    one, six = count(lambda: step_k(1)), count(lambda: step_k(6))
    return collections.Counter({f: (six[f] - one[f]) / 5 for f in set(one) | set(six)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25, help="functions to list for distgrad")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ids = torch.randint(0, 384, (2, 8))
    net = make_net(6)
    model = distgrad.wrap(net)

    def raw(k):
        fresh(net)
        raw_step(net, ids, k)

    def traced(k):
        fresh(net)
        traced_step_k(model, ids, k)

    totals = {}
    for name, step in (("raw hooks", raw), ("distgrad", traced)):
        found = per_extra(step)
        totals[name] = sum(found.values())
        if name == "distgrad":
            print(f"## Bytecodes per further read+edit, by function (distgrad, top {args.top})\n")
            for where, n in found.most_common(args.top):
                print(f"{n:8.1f}  {where}")
    print("\n| variant | bytecodes per further read+edit |\n|---|---:|")
    for name, n in totals.items():
        print(f"| {name} | {n:.0f} |")
    print(
        f"\ndistgrad adds {totals['distgrad'] - totals['raw hooks']:.0f} bytecodes per read+edit."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
