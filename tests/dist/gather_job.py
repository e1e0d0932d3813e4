"""The end-of-trace gather of saves (SavesGather) on its own (no model): saves of several dtypes,
modes and join dims, an uneven step, with and without ``config.gather_chunk_bytes``, checked
exactly (torch.equal: the gather moves bytes, so nothing may differ) against the ranks' tensors
joined on one process. Every rank makes every rank's tensors from seeds, so each can compute the
oracle. Exits non-zero on a mismatch; prints one line a bound: the rank's allocated buffers."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import distgrad
from distgrad.engines.ranks.gather import SavesGather

MODES = ["rank0", "rank0", "rank0", "all", "rank0", "all", "none"]
DIMS = [0, 1, 0, 0, 0, 0, 0]


def tensors(step: int, rank: int) -> list:
    g = torch.Generator().manual_seed(100 * step + rank)
    rows = 1 if (rank == 1 and step == 3) else 2  # step 3: rank 1's batch is smaller
    return [torch.randn(rows, 5, generator=g),                           # float32
            torch.randn(3, rows, 7, generator=g).double(),               # joined on dim 1
            torch.tensor(float(rank + step)),                            # 0-dim: stacked
            (torch.arange(rows * 3) + 10 * rank).view(rows, 3).to(torch.int32),
            torch.randn(rows, 4, generator=g) > 0,                       # bool
            torch.randn(rows, 3, generator=g),
            torch.randn(rows, generator=g)]


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    # small=0: no gather is small enough for one all_gather of headers and payload
    for bound, small in [(None, None), (None, 0), (8, None), (16, None), (40, None), (1 << 20, 0)]:
        distgrad.config.gather_chunk_bytes = bound
        saves_gather = SavesGather(dist.group.WORLD, rank, world)
        if small is not None:
            saves_gather.small_bytes = small
        guessed = []
        for step in range(6):
            saves = [(t, m, d) for t, m, d in zip(tensors(step, rank), MODES, DIMS)]
            saves_gather(saves)
            guessed.append(saves_gather.guessed)
            every = [tensors(step, r) for r in range(world)]
            for i, (got, mode, dim) in enumerate(saves):
                if mode == "all" or (mode == "rank0" and rank == 0):
                    parts = [e[i] for e in every]
                    expect = torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts, dim)
                else:
                    expect = every[rank][i]
                if got.dtype != expect.dtype or not torch.equal(got, expect):
                    wrong.append(f"bound {bound}, step {step}, save {i} ({mode}, dim {dim})")
            received = saves_gather.allocated.get("receive", 0)
            if bound and bound < 1 << 20 and received > world * bound:
                wrong.append(f"bound {bound}, step {step}: received {received} bytes")
        # steps 1, 2 repeat step 0; step 3 changes shapes; 4 differs from 3; 5 repeats 4
        streamed = bound is not None and bound < 1 << 20
        expect_guessed = [False, True, True, False, False, True]
        if guessed != [g and not streamed for g in expect_guessed]:
            wrong.append(f"bound {bound}: payload sent before the headers {guessed}")
        print(f"rank {rank} bound {bound}, small {small}: {saves_gather.allocated}", flush=True)
    dist.destroy_process_group()
    if wrong:
        print(f"rank {rank} wrong:\n" + "\n".join(wrong), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
