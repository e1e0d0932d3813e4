"""Saved values reaching rank 0 (or every rank): cases of job.py, on every data-parallel engine.

Saves of several shapes and modes, a loop whose layout repeats (the cached plan), an uneven
last batch, and the memory a gather allocates on each rank (``gather="rank0"``: other ranks
hold their own saves plus a constant), with ``distgrad.config.gather_device`` and
``gather_chunk_bytes``. Oracle: gpt2_oracle on the global batch; atol 1e-5 (cases.ATOL).
"""
from __future__ import annotations

import torch

import distgrad
from cases import close  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from flow_job import clear_grads  # noqa: E402
from gpt2_oracle import SCALE, global_ids, oracle, rows_of  # noqa: E402


def case_saves(model, wrapped, rank, world):
    sizes = [2] * world
    ids = global_ids(sum(sizes))
    local = ids[rows_of(rank, sizes)]
    ref = oracle(ids)["losses"]
    sums = torch.stack([ref[rows_of(r, sizes)].sum() for r in range(world)])
    across = torch.cat([ref[rows_of(r, sizes)][:, :2, :3] for r in range(world)], dim=1)
    for step in range(2):  # the second trace repeats the layout: the cached plan must hold
        with model.trace(local):
            logits = model.output.logits
            total = logits.sum().save()                      # 0-dim: stacked to [world]
            everywhere = logits.save(gather="all")
            mine = logits[:, -1].save(gather="none")
            last = logits[:, -1, :5].save(dim=0)
        if rank == 0:
            close(total, sums, "stacked 0-dim save")
            close(last, ref[:, -1, :5], "second save of the trace")
        close(everywhere, ref, "gather='all' save")
        close(mine, ref[rows_of(rank, sizes)][:, -1], "gather='none' save")
    for step in range(2):  # another batch dim, and two dtypes in one trace
        with model.trace(local):
            tokens = distgrad.save(model.transformer.wte.input)
            side = model.output.logits[:, :2, :3].save(dim=1)
        if rank == 0:
            close(side, across, "save joined on dim 1")
            assert torch.equal(tokens, ids), "int64 save next to a float save"


def forward_ref(net, ids):
    """One process: the outputs of h[0] and h[1] and the logits, without gradients."""
    seen = {}
    hooks = [net.transformer.h[i].register_forward_hook(
        lambda m, a, o, i=i: seen.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i in range(2)]
    with torch.no_grad():
        logits = net(ids).logits
    for hook in hooks:
        hook.remove()
    return seen[0], seen[1], logits


def case_steady_saves(model, wrapped, rank, world):
    """A training loop's saves: one layout again and again (from its third trace the ranks'
    bytes are received straight into the saved values, bound while the collective runs), a rank
    whose batch shrinks for one step (every rank must notice and fall back), values smaller
    than the header, and gather='all'. New data every step, so a stale value cannot pass."""
    net = build_gpt2()
    kinds = ["wide"] * 4 + ["odd"] + ["wide"] * 3 + ["small"] * 4 + ["all"] * 4
    for step, kind in enumerate(kinds):
        sizes = [2] + [1] * (world - 1) if kind == "odd" else [2] * world
        ids = torch.randint(0, 384, (sum(sizes), 8), generator=torch.Generator().manual_seed(step))
        mode = "all" if kind == "all" else "rank0"
        with model.trace(ids[rows_of(rank, sizes)]):
            h0, h1 = (model.transformer.h[i].output for i in range(2))
            h0, h1 = (h[0] if isinstance(h, tuple) else h for h in (h0, h1))
            logits = model.output.logits
            if kind == "small":  # [2, 2] floats: 16 bytes a value
                saved = [logits[:, -1, i:i + 2].save() for i in range(3)]
            else:
                saved = [h0.save(gather=mode), h1.save(gather=mode), logits[..., :64].save(gather=mode)]
        ref0, ref1, ref_logits = forward_ref(net, ids)
        refs = ([ref_logits[:, -1, i:i + 2] for i in range(3)] if kind == "small"
                else [ref0, ref1, ref_logits[..., :64]])
        for i, (got, ref) in enumerate(zip(saved, refs)):
            if rank != 0 and mode == "rank0":
                ref = ref[rows_of(rank, sizes)]
            close(got, ref, f"save {i} of step {step} ({kind})")


def case_uneven(model, wrapped, rank, world):
    sizes = [2] + [1] * (world - 1)
    ids = global_ids(sum(sizes))
    with model.trace(ids[rows_of(rank, sizes)]):
        a1 = model.transformer.h[0].output
        with (model.output.logits.sum() * SCALE).backward():
            g = a1.grad.save()
    if rank == 0:
        close(g, oracle(ids)["g0"], "gathered gradient, uneven batches")
    clear_grads(wrapped)


def case_gather_memory(model, wrapped, rank, world):
    """gather="rank0" saves go to rank 0 alone: a rank other than 0 allocates its own saved bytes
    and 48 bytes of header a rank, and receives nothing, whatever the world size (the job runs
    on 2 and on 4 ranks); rank 0 receives every rank's bytes. (A repeated gather of at most
    SavesGather.small_bytes from all ranks is one all_gather of headers and payload, received by
    every rank: turned off here, to see the rule on saves of any size; tests/dist/gather_job.py
    covers both.) gather="all" saves still reach
    every rank. Values equal the oracle's, also landed on the CPU by config.gather_device,
    streamed in chunks of config.gather_chunk_bytes (the receive buffer is then world x the
    bound), and on the steady path (a trace that repeats the one before sends the payload
    before the headers; not when streamed)."""
    engine = model._engine
    # (accelerate composes another engine)
    saves_gather = getattr(engine, "inner", engine).saves_gather
    sizes = [2] * world
    ids = global_ids(sum(sizes))
    local = ids[rows_of(rank, sizes)]
    ref = oracle(ids)
    logits_bytes = 2 * 8 * ref["losses"].shape[-1] * 4  # [2, 8, vocab] floats a rank
    small, saves_gather.small_bytes = saves_gather.small_bytes, 0
    try:
        steps = ([("rank0", None, None)] * 3 + [("all", None, None)] * 2 +
                 [("rank0", "cpu", None), ("all", "cpu", None)] +
                 [("rank0", None, 4096)] * 2 + [("all", "cpu", 4096)])
        for step, (mode, device, bound) in enumerate(steps):
            distgrad.config.gather_device = device
            distgrad.config.gather_chunk_bytes = bound  # the logits: 24 KiB a rank, 6 chunks
            with model.trace(local):
                a = model.transformer.h[0].output
                logits = model.output.logits.save(gather=mode)
                loss = model.output.logits.sum() * SCALE
                with loss.backward():
                    g = a.grad.save(gather=mode)
                total = loss.detach().save(gather=mode)  # 0-dim: 8 bytes padded from 4
            own = logits_bytes + 2 * 8 * ref["g0"].shape[-1] * 4 + 8
            got = saves_gather.allocated
            kept = rank == 0 or mode == "all"
            expected = {"headers": 48 * world, "send": own,
                        "receive": world * (bound or own) if kept else 0}
            if {k: got.get(k, 0) for k in expected} != expected:
                raise AssertionError(f"step {step} ({mode}) rank {rank} allocated {got}, "
                                     f"expected {expected}")
            steady = step in (1, 2, 4)  # a trace that repeats the one before it
            if saves_gather.guessed != steady or steady and "layouts" in got:
                raise AssertionError(f"step {step}: payload sent before the headers: "
                                     f"{saves_gather.guessed}, allocated {got}")
            if kept:
                close(logits, ref["losses"], f"gathered logits, step {step} ({mode})")
                close(g, ref["g0"], f"gathered h[0] gradient, step {step} ({mode})")
                close(total, torch.stack([ref["losses"][rows_of(r, sizes)].sum() * SCALE
                                          for r in range(world)]), f"saved loss, step {step}")
            else:
                close(logits, ref["losses"][rows_of(rank, sizes)], f"local logits, step {step}")
                close(g, ref["g0"][rows_of(rank, sizes)], f"local gradient, step {step}")
            if kept and device is not None:
                for value in (logits, g, total):
                    assert value.device == torch.device(device), (step, value.device)
            clear_grads(wrapped)
    finally:
        distgrad.config.gather_device = distgrad.config.gather_chunk_bytes = None
        saves_gather.small_bytes = small
