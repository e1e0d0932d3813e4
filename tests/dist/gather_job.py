"""The end-of-trace gather of saves (SavesGather) on its own (no model): saves of several dtypes,
modes and join dims, an uneven step, ragged steps (lengths that differ between the ranks outside
the join dim: NaN-padded, ``distgrad.rank_parts``), with and without
``config.gather_chunk_bytes``, checked exactly (torch.equal: the gather moves bytes, so nothing may differ) against the ranks' tensors
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


def ragged_tensors(step: int, rank: int) -> list:
    """Tensors whose length differs between the ranks outside the join dim (step 2: one length
    on every rank but rank 1's batch smaller)."""
    g = torch.Generator().manual_seed(1000 + 100 * step + rank)
    length = 4 if step == 2 else 3 + 2 * rank + step
    rows = 1 if (rank == 1 and step == 2) else 2
    return [torch.randn(rows, length, 3, generator=g),                  # joined on dim 0
            torch.randn(3, rows, length, generator=g).double(),         # joined on dim 1
            torch.randn(rows, length, generator=g).to(torch.bfloat16),  # gather="all"
            torch.randn(rows, 2, generator=g),                          # not ragged
            torch.randn(2, length, generator=g)]                        # joined on dim -1


RAGGED_MODES = ["rank0", "rank0", "all", "rank0", "rank0"]
RAGGED_DIMS = [0, 1, 0, 0, -1]


def padded(parts: list, dim: int) -> torch.Tensor:
    """The oracle: the ranks' tensors joined on dim, NaN-padded in the others."""
    shape = [max(p.shape[d] for p in parts) for d in range(parts[0].dim())]
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = torch.full(shape, float("nan"), dtype=parts[0].dtype)
    at = 0
    for p in parts:
        index = [slice(at, at + n) if d == dim else slice(0, n) for d, n in enumerate(p.shape)]
        out[tuple(index)] = p
        at += p.shape[dim]
    return out


def ragged_steps(rank: int, world: int) -> list:
    """Ragged saves, unchunked and streamed in chunks: the NaN-padded value and each rank's
    part (distgrad.rank_parts) exactly; step 2 is not ragged (joined as ever)."""
    wrong = []
    for bound in (None, 8, 40):
        distgrad.config.gather_chunk_bytes = bound
        saves_gather = SavesGather(dist.group.WORLD, rank, world)
        for step in range(4):
            saves = [(t, m, d) for t, m, d in zip(ragged_tensors(step, rank), RAGGED_MODES,
                                                   RAGGED_DIMS)]
            saves_gather(saves)
            every = [ragged_tensors(step, r) for r in range(world)]
            for i, (got, mode, dim) in enumerate(saves):
                what = f"ragged, bound {bound}, step {step}, save {i} ({mode}, dim {dim})"
                if not (mode == "all" or rank == 0):
                    if not torch.equal(got, every[rank][i]):
                        wrong.append(what + ": the rank's own value")
                    continue
                parts = [e[i] for e in every]
                expect = padded(parts, dim % parts[0].dim())
                if got.dtype != expect.dtype or not torch.equal(got.isnan(), expect.isnan()) \
                        or not torch.equal(got.nan_to_num(), expect.nan_to_num()):
                    wrong.append(what)
                ragged = len({p.shape for p in parts}) > 1 and step != 2 and dim != -1
                if ragged and not all(torch.equal(a, b) for a, b in
                                      zip(distgrad.rank_parts(got), parts)):
                    wrong.append(what + ": rank_parts")
                if not ragged and expect.isnan().any():
                    wrong.append(what + ": NaN in a save that is not ragged")
    distgrad.config.gather_chunk_bytes = None
    return wrong


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
    wrong += ragged_steps(rank, world)
    dist.destroy_process_group()
    if wrong:
        print(f"rank {rank} wrong:\n" + "\n".join(wrong), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
