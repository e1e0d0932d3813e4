"""Timing shared by the multi-rank benchmarks: variants take turns in rounds of 10 steps, every
step starts on a barrier (the ranks' collectives must line up), rank 0 prints a table."""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist


def time_in_turns(fns: dict, steps: int, after=lambda: None) -> dict:
    """``{name: [ns per step]}`` for each zero-argument step function; ``after`` runs after
    each step, outside the timing (e.g. to clear gradients)."""
    times = {name: [] for name in fns}
    for _ in range(steps // 10):
        for name, fn in fns.items():
            for _ in range(10):
                dist.barrier()
                t = time.perf_counter_ns()
                fn()
                times[name].append(time.perf_counter_ns() - t)
                after()
    return times


def print_ratios(times: dict, base: str) -> None:
    """A markdown table of medians in microseconds and their ratio to ``base``."""
    print("\n| variant | us/step | ratio |\n|---|---:|---:|")
    reference = statistics.median(times[base]) / 1e3
    for name, v in times.items():
        m = statistics.median(v) / 1e3
        print(f"| {name} | {m:.1f} | {m / reference:.2f}x |")
