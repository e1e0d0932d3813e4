"""A plain module (no DDP, FSDP or DeepSpeed wrapper) traced in a job of 2 processes
(``lightning_job.py`` runs these on 2 ranks): its saves reach rank 0 as the global batch, as
the one-process oracle of ``lightning_job.py`` has them (rel 1e-5); a trace on rank 0 alone
keeps ``gather="none"`` saves and raises, instead of waiting for ever, where a save would be
gathered, and the ranks trace together afterwards; a submodule of a ``fully_shard`` parent,
stepped through the parent, gives FSDP2's full weight gradient; a parameter's ``.grad`` that
nothing reduced raises on every rank; a backward block on a module inside a DDP module, whose forward
the trace bypassed, raises on every rank before any backward runs."""

from __future__ import annotations

import time

import torch.distributed as dist

import distgrad
from cases import expect_error
from distgrad.trace import engine_of
from lightning_job import ROWS, build_net, oracle, rel_close, rows


def trace_first_rows(model, world, rank, gather="rank0"):
    ids = rows(world, rank, 0)
    with model.trace(input_ids=ids, labels=ids):
        hidden = distgrad.save(model.transformer.h[0].output, gather=gather)
        with model.output.loss.backward():
            grad = distgrad.save(hidden.grad, gather=gather)
    return hidden, grad


def case_plain_module_saves_reach_rank0(world, rank):
    model = distgrad.wrap(build_net())  # a plain module: the one-process engine
    hidden, grad = trace_first_rows(model, world, rank)
    assert engine_of(model).world_size == world
    want = oracle(world, edit=1.0)
    mine = slice(None) if rank == 0 else slice(rank * ROWS, (rank + 1) * ROWS)
    rel_close(hidden, want["h0"][0][mine], "h[0]'s output")
    rel_close(grad, world * want["g0"][0][mine], "h[0]'s gradient")


def case_trace_on_rank0_only(world, rank):
    model = distgrad.wrap(build_net())
    if rank == 0:
        hidden, grad = trace_first_rows(model, world, rank, gather="none")  # nothing sent
        assert hidden.shape[0] == ROWS and grad.shape[0] == ROWS
        timeout, distgrad.config.peer_timeout = distgrad.config.peer_timeout, 2.0
        start = time.monotonic()
        try:
            expect_error(
                lambda: trace_first_rows(model, world, rank),
                distgrad.TraceStateError,
                "gather='none'",
                heard=False,
            )
        finally:
            distgrad.config.peer_timeout = timeout
        assert time.monotonic() - start < 30
    dist.barrier()  # the group survived; the ranks' next trace gathers as usual
    hidden, _ = trace_first_rows(model, world, rank)
    assert hidden.shape[0] == (ROWS * world if rank == 0 else ROWS), hidden.shape


def case_submodule_of_a_fully_sharded_parent(world, rank):
    """``net.transformer`` wrapped while ``fully_shard`` shards ``net``: the step runs through
    the parent (``trace_step``), saves are gathered, and a weight's ``.grad`` is FSDP2's full
    gradient (a DTensor gathered), the one-process oracle's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = build_net()
    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    model = distgrad.wrap(net.transformer)
    ids = rows(world, rank, 0)
    with model.trace_step(
        lambda: net(input_ids=ids, labels=ids).loss, lambda loss: loss.backward()
    ) as tr:
        hidden = model.h[0].output.save()
        with tr.loss.backward():
            pass
        weight_grad = model.h[1].mlp.c_fc.weight.grad.clone()
    want = oracle(world, edit=1.0)
    mine = slice(None) if rank == 0 else slice(rank * ROWS, (rank + 1) * ROWS)
    rel_close(hidden, want["h0"][0][mine], "h[0]'s output")
    rel_close(weight_grad, want["weight_grad"][0], "h[1]'s c_fc weight .grad (FSDP2's, whole)")


def case_unreduced_parameter_grad_raises(world, rank):
    model = distgrad.wrap(build_net())
    ids = rows(world, rank, 0)

    def read():
        with model.trace(input_ids=ids, labels=ids):
            with model.output.loss.backward():
                pass
            model.transformer.h[1].mlp.c_fc.weight.grad  # each rank's own: nothing reduced it

    expect_error(read, ValueError, "different gradients")


def case_block_bypassing_a_ddp_parent_raises(world, rank):
    from torch.nn.parallel import DistributedDataParallel

    net = build_net()
    ddp = DistributedDataParallel(net)  # the user's DDP model; the trace below calls net itself
    model = distgrad.wrap(net)
    ids = rows(world, rank, 0)

    def slip():
        with model.trace(input_ids=ids, labels=ids):
            with model.output.loss.backward():
                pass

    expect_error(slip, distgrad.TraceStateError, "Wrap the DistributedDataParallel instead")
    assert all(p.grad is None for p in net.parameters()), "the refused backward ran"
    del ddp


IN_JOB_CASES = [
    case_plain_module_saves_reach_rank0,
    case_trace_on_rank0_only,
    case_submodule_of_a_fully_sharded_parent,
]


IN_JOB_FAILURES = [case_block_bypassing_a_ddp_parent_raises, case_unreduced_parameter_grad_raises]
