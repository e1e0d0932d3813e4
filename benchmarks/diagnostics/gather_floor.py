"""What any end-of-trace gather pays per saved tensor before it sends a byte (one process).

    python benchmarks/diagnostics/gather_floor.py [--sizes 1 4 16 64]

The goal in docs/performance.md: the gather of S saved tensors costs at most 1.2x one raw
all_gather of the same bytes, flat in S. Whatever the gather does, on rank 0 each of the S
saved tensors the user holds must (1) be read for its dtype and shape, to know the ranks
saved the same things, (2) get a new tensor object for its global value (a view of one
gathered block), and (3) be rebound to it (``tensor.data = value``), because ``.save()``
returned the user's own tensor. This times exactly those three steps, with tensors of
ddp_overhead.py's shape ([2, 8, 64] float32 per rank, 2 ranks), and prints them next to the
budget the 1.2x target leaves at each S (0.2 x the raw all_gather time, which ddp_overhead.py
measures on 2 ranks).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def read_layout(tensors: list, block: torch.Tensor):
    return [(t.dtype, t.shape) for t in tensors]  # (1) what each rank saved


def make_values(tensors: list, block: torch.Tensor):
    return block.unbind(0)  # (2) one tensor object per global value


def per_tensor_steps(tensors: list, block: torch.Tensor) -> None:
    read_layout(tensors, block)
    values = make_values(tensors, block)
    for tensor, value in zip(tensors, values):  # (3) the user's tensor shows the global value
        tensor.data = value


def median_us(fn, tensors, block, originals, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        fn(tensors, block)
        times.append(time.perf_counter_ns() - t0)
        for tensor, original in zip(tensors, originals):
            tensor.data = original
    return statistics.median(times) / 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # as in SavesGather
    print(
        "| saved tensors S | all three steps us | us per tensor | (1) layout us | (2) values "
        "us | (3) rebinding us |\n|---:|---:|---:|---:|---:|---:|"
    )
    for s in a.sizes:
        tensors = [torch.randn(2, 8, 64) for _ in range(s)]
        originals = [t.data for t in tensors]
        block = torch.empty(s, 4, 8, 64)
        values = block.unbind(0)

        def rebind(tensors, block):
            for tensor, value in zip(tensors, values):
                tensor.data = value

        us = [
            median_us(fn, tensors, block, originals, a.steps)
            for fn in (per_tensor_steps, read_layout, make_values, rebind)
        ]
        print(f"| {s} | {us[0]:.1f} | {us[0] / s:.2f} | {us[1]:.1f} | {us[2]:.1f} | {us[3]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
