"""The pipeline machinery alone: a 1F1B step on ONE process (one stage holding the whole
model), traced against raw hooks, so that no other rank's waits or messages blur the number.

    python benchmarks/diagnostics/pp_one_process.py [--width 256] [--rounds 40]

The model, schedule (4 microbatches of 8 rows) and body are those of ``pp_overhead.py``: save
``layers[1]``'s output and its gradient and double the gradient, and the body that reads
nothing. With one stage nothing is sent, so the difference to raw hooks is what distgrad does on
the stage itself per step: starting the microbatches' bodies, 8 pauses (a forward value and a
gradient per microbatch), the scheduler between them, the bytes kept for other stages (none
here, but taken all the same: the send list is empty only in this set-up), the joins at the end.

Variants take turns in rounds of 10 steps. The per-variant median moves by hundreds of
microseconds from run to run on a shared machine, so the fastest step ("min") is printed too;
compare the "over raw" columns of runs made in the same minutes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks this one builds on

from pp_steps import one_process_steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    net, fns = one_process_steps(args.width, "29533")
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
        net.zero_grad(set_to_none=True)
    for _ in range(args.rounds):
        for name, fn in fns.items():
            for _ in range(10):
                t = time.perf_counter_ns()
                fn()
                times[name].append(time.perf_counter_ns() - t)
                net.zero_grad(set_to_none=True)
    base = {
        stat: f(times["raw hooks"]) / 1e3
        for stat, f in (("median", statistics.median), ("min", min))
    }
    print(
        f"torch {torch.__version__}, 1F1B on one process, 4 microbatches, width {args.width}, "
        f"{10 * args.rounds} steps per variant\n"
    )
    print("| variant | median us | over raw | min us | over raw |\n|---|---:|---:|---:|---:|")
    for name, v in times.items():
        med, low = statistics.median(v) / 1e3, min(v) / 1e3
        print(
            f"| {name} | {med:.1f} | {med - base['median']:+.1f} | {low:.1f} | "
            f"{low - base['min']:+.1f} |"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
