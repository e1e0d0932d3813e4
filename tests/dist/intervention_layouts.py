"""The cases of tests/dist/intervention_job.py where the gradient of a parameter beside the
model is not a mean over data-parallel ranks: a trace whose body runs no backward, tensor
parallelism and a pipeline schedule raise on every rank naming the tensor (each breaks the
process group, so they run last, the job restarting between them), and the way out the
pipeline error names (the vector registered on the stage's module) equals one process (rel
1e-5).
"""

from __future__ import annotations

import torch
from cases import expect_error  # noqa: E402  (tests/dist is the script's folder)
from intervention_setup import REL, ROWS, D, batches, interventions, mine, rel
from torch.nn import MSELoss

import distgrad
from distgrad.demo.models import build_gpt2, build_llama, build_mlp, parallelize_llama, stage_of


def case_backward_after_the_trace_raises(rank, world, ref):
    """A body that brings the vector into the forward and runs no backward: a backward after
    the trace would leave its gradient each rank's own, so the trace raises on every rank,
    naming it, before any backward."""
    from torch.nn.parallel import DistributedDataParallel

    model = distgrad.wrap(DistributedDataParallel(build_gpt2()))
    steer = interventions()[0]
    ids = mine(batches(world, 1)[0], rank)

    def run():
        with model.trace(ids):
            model.transformer.h[0].output = model.transformer.h[0].output + steer
            model.output.logits.sum().save()

    expect_error(run, NotImplementedError, "the body ran no backward", heard=False)
    assert steer.grad is None


def case_tensor_parallel_raises(rank, world, ref):
    """Under tensor parallelism each rank's gradient of a vector beside the model is only
    what its shards reached: a clear error naming the tensor, on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    net = parallelize_llama(build_llama(), mesh)
    model = distgrad.wrap(net)
    steer = torch.nn.Parameter(torch.zeros(D))
    ids = batches(world, 1)[0][:ROWS]

    def run():
        with model.trace(ids):
            model.model.layers[0].output = model.model.layers[0].output + steer
            with model.output.logits.sum().backward():
                pass

    expect_error(run, NotImplementedError, "nn.Parameter of shape [64]", heard=False)


def mlp_with_vector():
    """The pipeline MLP with a vector registered on layers[1] (the stage's own parameter)."""
    net = build_mlp()
    torch.manual_seed(13)
    net.layers[1].steer = torch.nn.Parameter(torch.randn(8) * 0.1)
    return net


def pipeline_batch():
    g = torch.Generator().manual_seed(17)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def case_pipeline_vector_on_the_stage(rank, world, ref):
    """The way out the pipeline error names: the vector registered on the stage's module is
    the stage's own parameter, and its gradient (and the stages') equal one process's."""
    from torch.distributed.pipelining import Schedule1F1B

    net = mlp_with_vector()
    schedule = Schedule1F1B(stage_of(net, rank, world), n_microbatches=4, loss_fn=MSELoss())
    model = distgrad.wrap(schedule, full_model=net)
    x, y = pipeline_batch()
    with model.trace(x, target=y) as tr:
        model.layers[1].output = model.layers[1].output + net.layers[1].steer
        with tr.loss.backward():
            pass
    ref_net = mlp_with_vector()
    ref_net.layers[1].register_forward_hook(lambda m, a, out: out + ref_net.layers[1].steer)
    MSELoss()(ref_net(x), y).backward()
    mine_layers = [0, 1] if rank == 0 else [2, 3]
    for i in mine_layers:
        for (name, p), q in zip(net.layers[i].named_parameters(), ref_net.layers[i].parameters()):
            err = rel(p.grad, q.grad)
            assert err <= REL, f"pipeline: layers[{i}].{name}.grad: rel {err:.2e} > {REL}"


def case_pipeline_raises(rank, world, ref):
    """Under a pipeline schedule the vector's gradient would be its stage's rank's alone,
    summed over the microbatches: a clear error naming the tensor on the rank whose stage
    used it (rank 0 runs layers[0] and layers[1]), heard by the others."""
    from torch.distributed.pipelining import Schedule1F1B

    net = build_mlp()
    schedule = Schedule1F1B(stage_of(net, rank, world), n_microbatches=4, loss_fn=MSELoss())
    model = distgrad.wrap(schedule, full_model=net)
    steer = torch.nn.Parameter(torch.zeros(8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def run():
        with model.trace(x, target=y) as tr:
            model.layers[1].output = model.layers[1].output + steer
            with tr.loss.backward():
                pass

    expect_error(run, NotImplementedError, "nn.Parameter of shape [8]")
    assert steer.grad is None, "the backward ran into the vector before the error"
