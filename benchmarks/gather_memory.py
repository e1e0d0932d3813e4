"""What the end-of-trace gather of gather="rank0" saves costs each rank in memory and in time.

    for w in 2 4 8; do
        OMP_NUM_THREADS=1 torchrun --nproc_per_node $w benchmarks/gather_memory.py
    done
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 8 benchmarks/gather_memory.py --chunk-mib 1

S saved tensors of ``--mib`` MiB each (float32, rows joined on dim 0) are gathered to rank 0 by
distgrad's ``SavesGather`` (what ``end_trace`` calls). Memory, per rank, for one gather of fresh
tensors:

* ``allocated``: the bytes of the buffers the gather allocated (``SavesGather.allocated``: send,
  receive, headers, layouts; not the global values rank 0 builds from the receive buffer);
* ``RSS growth``: the process's peak resident memory after the gather (``ru_maxrss``) less its
  resident memory before it (``/proc/self/statm``): everything the gather touched, the
  backend's own buffers and rank 0's global values included. Measured for S in increasing
  order, so each gather sets a new peak.

Time, median of ``--steps`` after a warm-up (every step starts on a barrier): the gather;
what a user writes by hand (one ``dist.gather`` to rank 0 per tensor); one raw ``dist.gather``
of all S tensors' bytes at once (the floor). Rank 0 prints one row per S for this world size.
Run with another ``PYTHONPATH`` the same script measures another version of distgrad (its
RSS only, where its gather has no ``allocated``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

import distgrad
from distgrad.engines.ranks import gather

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--chunk-mib",
        type=float,
        default=None,
        help="distgrad.config.gather_chunk_bytes, in MiB (default: none)",
    )
    args = parser.parse_args()
    if args.chunk_mib:
        distgrad.config.gather_chunk_bytes = int(args.chunk_mib * MIB)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = int(args.mib * MIB) // (4 * 256)  # [rows, 256] float32: --mib MiB a tensor
    dist.barrier()

    def saves_of(count: int) -> list:
        return [_of_rank(rows, count, rank, i) for i in range(count)]

    results = {}
    for count in args.counts:
        # memory: one gather of fresh tensors in a fresh SavesGather (its first trace)
        tensors = saves_of(count)
        originals = [t.clone() for t in tensors]
        saves_gather = gather.SavesGather(dist.group.WORLD, rank, world)
        dist.barrier()
        before = resident()
        saves_gather([(t, "rank0", 0) for t in tensors])
        grown = peak() - before
        allocated = sum(getattr(saves_gather, "allocated", {}).values()) or None
        # parity: rank 0 holds every rank's tensors joined, the others their own
        for i, tensor in enumerate(tensors):
            if rank == 0:
                expect = torch.cat([_of_rank(rows, count, r, i) for r in range(world)])
            else:
                expect = originals[i]
            assert torch.equal(tensor, expect), f"rank {rank}: save {i} of {count} differs"
        del tensors, originals

        # time, on the steady path
        tensors = saves_of(count)
        originals = [t.clone() for t in tensors]
        saves = [(t, "rank0", 0) for t in tensors]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        slots = [
            [torch.empty_like(t) for _ in range(world)] if rank == 0 else None for t in tensors
        ]
        flat_slots = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None

        def ours():
            saves_gather(saves)
            for tensor, original in zip(tensors, originals):
                tensor.data = original

        def by_hand():
            for t, slot in zip(tensors, slots):
                dist.gather(t, slot, dst=0)
            if rank == 0:
                return [torch.cat(slot) for slot in slots]

        def raw():
            dist.gather(flat, flat_slots, dst=0)

        fns = {"distgrad": ours, "by hand": by_hand, "raw": raw}
        times = {name: [] for name in fns}
        for step in range(args.steps + 3):
            for name, fn in fns.items():
                dist.barrier()
                t = time.perf_counter_ns()
                fn()
                if step >= 3:
                    times[name].append(time.perf_counter_ns() - t)
        results[count] = (
            grown,
            allocated,
            {k: statistics.median(v) / 1e3 for k, v in times.items()},
        )

    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        print(
            f"torch {torch.__version__}, world {world}, gloo, {args.mib} MiB a save, "
            f"chunks of {args.chunk_mib or '-'} MiB, median of {args.steps}"
        )
        print(
            "\n| world | S | rank 0 allocated / RSS growth MiB | other ranks' largest allocated "
            "/ RSS growth MiB | distgrad us | by hand us | raw gather us |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for count in args.counts:

            def mib(x):
                return "-" if x is None else f"{x / MIB:.1f}"

            zero = everyone[0][count]
            others = [everyone[r][count] for r in range(1, world)]
            alloc = None if others[0][1] is None else max(o[1] for o in others)
            t = zero[2]
            print(
                f"| {world} | {count} | {mib(zero[1])} / {mib(zero[0])} | {mib(alloc)} / "
                f"{mib(max(o[0] for o in others))} | {t['distgrad']:.0f} | {t['by hand']:.0f} | "
                f"{t['raw']:.0f} |"
            )
    dist.destroy_process_group()


def _of_rank(rows: int, count: int, r: int, i: int) -> torch.Tensor:
    """Rank r's save i of ``count``: known to every rank, so rank 0 can check the joined one."""
    return torch.randn(
        rows, 256, generator=torch.Generator().manual_seed(count * 10007 + r * 101 + i)
    )


if __name__ == "__main__":
    main()
