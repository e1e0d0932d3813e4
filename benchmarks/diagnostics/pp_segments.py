"""Where a pipeline step's time goes on each rank: CPU time per segment, raw hooks against
distgrad, on ``pp_overhead.py``'s set-up.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/diagnostics/pp_segments.py \
        [--steps 110]

End to end, a 2-stage step moves by more from one minute to the next than most changes to
distgrad's path (``docs/performance.md``). Each stage's part of that path is steadier: this
times, with ``time.thread_time`` (CPU of the rank's main thread) around each call, the schedule's
chunks (the stage's forward and backward, with the hooks and the bodies woken in them), its
message posts and waits, and distgrad's own pieces: values packed onto the schedule's messages
(``outgoing``), unpacked from them (``arrived``), the bodies woken at action events, the ``"end"``
bundles and the end-of-step check. Rank 0 prints, per rank and variant, the median over steps
of each segment's sum in a step, and the step's wall time from the barrier. CPU equals wall
time here except in the waits; a wait is where a rank idles until the other stage's message.

The timers cost about 2 us a call; compare segments, not the wall time, with pp_overhead.py.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks this one builds on

from pp_overhead import setup

from distgrad.engines.pipeline import checks, direct, messages

_SPANS: list = []  # (segment, CPU ns) while a step is recorded
_ON = [False]
_cpu = time.thread_time_ns

SEGMENTS = [  # (owner, attribute, segment)
    (_PipelineStageBase, "forward_one_chunk", "forward chunks"),
    (_PipelineStageBase, "backward_one_chunk", "backward chunks"),
    (schedules, "_batch_p2p", "schedule's posts"),
    (schedules, "_wait_batch_p2p", "waits for the other stage"),
    (messages.Messages, "outgoing", "values packed onto messages"),
    (messages.Messages, "incoming", "room for values in receives"),
    (messages.Messages, "arrived", "values unpacked"),
    (direct.DirectStep, "hand", "bodies woken by hooks"),
    (direct.DirectStep, "event", "bodies woken at action events"),
    (messages.Messages, "flush", "bundles sent"),
    (checks.RequestCheck, "start", "end-of-step check sent"),
    (checks.RequestCheck, "wait_for_bundle", "waits for a bundle"),
    (messages.Messages, "finish", "end of the trace (check, sends done)"),
]


def _timed(fn, segment):
    def timed(*args, **kwargs):
        if not _ON[0]:
            return fn(*args, **kwargs)
        start = _cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            _SPANS.append((segment, _cpu() - start))

    return timed


def main() -> int:
    argv = sys.argv[1:] or ["--steps", "110"]
    for owner, name, segment in SEGMENTS:
        setattr(owner, name, _timed(getattr(owner, name), segment))
    args, net, fns = setup(argv)
    found: dict = {name: [] for name in fns}
    for _ in range(args.steps // 10):
        for name, fn in fns.items():
            for _ in range(10):
                dist.barrier()
                _SPANS.clear()
                _ON[0] = True
                wall, cpu = time.perf_counter_ns(), _cpu()
                fn()
                wall, cpu = time.perf_counter_ns() - wall, _cpu() - cpu
                _ON[0] = False
                net.zero_grad(set_to_none=True)
                sums = {"step (wall)": wall, "step (CPU)": cpu}
                for segment, ns in _SPANS:
                    sums[segment] = sums.get(segment, 0) + ns
                found[name].append(sums)
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, found)
    if dist.get_rank() == 0:
        names = ["step (wall)", "step (CPU)"] + [s for _, _, s in SEGMENTS]
        for rank, per_rank in enumerate(table):
            print(f"\n### rank {rank}: median us per step over {args.steps // 10 * 10} steps\n")
            print("| segment | " + " | ".join(fns) + " |")
            print("|---|" + "---:|" * len(fns))
            for segment in names:
                cells = [
                    statistics.median([s.get(segment, 0) for s in per_rank[name]]) / 1e3
                    for name in fns
                ]
                if any(cells):
                    print(f"| {segment} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
