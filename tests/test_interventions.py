"""Interventions trained beside the model (a steering vector, a low-rank ReFT-style module
applied in the body): their gradients averaged over the data-parallel ranks as the engine
averages the model's.

* On 2 ranks (tests/dist/intervention_job.py, one job for the module): 3 SGD steps under DDP
  (a backward block, a plain ``loss.backward()`` in the body, and two invokes), FSDP2, FSDP1,
  DeepSpeed ZeRO-2 and ZeRO-3, accelerate with gradient_accumulation_steps=2, leave the
  model's and the interventions' parameters those of one process on the global batch (fp32,
  rel 1e-5), the same on every rank; inside accelerate's no_sync the vector's gradient stays
  each rank's own; ``TracedTrainer`` (DDP, accumulation 2) equals a plain ``Trainer`` that
  averages the vector's gradient by hand; ``distgrad.keep_rank_local`` keeps a marked
  vector's gradient this rank's own; a plain leaf (``inputs_embeds``) keeps its own; a trace
  with no backward in its body, tensor parallelism and a pipeline schedule raise naming the
  tensor, and the pipeline's way out (the vector on the stage's module) equals one process.
* On one process: which leaves count as beside the model, and nothing changes (no
  collective) for a plain module.
"""

import sys
from pathlib import Path

import pytest
import torch
from conftest import PARAM_ATOL

import distgrad
from distgrad.demo.models import build_gpt2
from distgrad.engines.ranks.beside import OwnedLeaves, params_beside

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "intervention_job.py")
CASES = [
    "case_ddp",
    "case_ddp_plain_backward",
    "case_ddp_invokes",
    "case_fsdp2",
    "case_fsdp1",
    "case_zero2",
    "case_zero3",
    "case_accelerate_accumulation",
    "case_traced_trainer",
    "case_keep_rank_local",
    "case_plain_leaf_stays_rank_local",
    "case_pipeline_vector_on_the_stage",
    "case_backward_after_the_trace_raises",
    "case_tensor_parallel_raises",
    "case_pipeline_raises",
]
WORLD = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    import accelerate  # noqa: F401 (a test dependency: missing, it fails here, not skips)
    import deepspeed  # noqa: F401 (a test dependency: missing, it fails here, not skips)

    out = tmp_path_factory.mktemp("interventions")
    procs = run_ranks([JOB, "--out", str(out)], WORLD, timeout=400)
    return procs, read_results(out, WORLD)


@pytest.mark.parametrize("case", CASES)
def test_intervention_case_on_every_rank(job, case):
    procs, results = job
    report = case_report(procs, results, case)
    assert not report, f"{case}:\n{report}"


def test_intervention_job_exits_cleanly(job):
    procs, _ = job
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"


# -- one process ------------------------------------------------------------------------------
def test_params_beside_finds_the_users_parameters_only():
    net = build_gpt2()
    steer = torch.nn.Parameter(torch.zeros(64))
    marked = distgrad.keep_rank_local(torch.nn.Parameter(torch.zeros(64)))
    low = torch.nn.Linear(64, 64)
    embeds = net.transformer.wte(torch.zeros(1, 4, dtype=torch.long)).detach().requires_grad_()
    hidden = net(inputs_embeds=embeds + steer + marked).logits
    loss = low(hidden[..., :64]).sum()
    owned = OwnedLeaves(net.parameters)
    found = params_beside([loss], owned)
    assert {id(p) for p in found} == {id(steer), id(low.weight), id(low.bias)}
    assert params_beside([loss.detach()], owned) == []
    # known by a weak reference, not by id alone: a dead parameter's id reused is not owned
    assert steer not in owned and all(p in owned for p in net.parameters())


def test_keep_rank_local_refuses_what_is_not_a_tensor():
    with pytest.raises(TypeError, match=r"keep_rank_local\(\.\.\.\) takes tensors"):
        distgrad.keep_rank_local(torch.nn.Linear(2, 2))


def test_one_process_steering_vector_gets_plain_autograds_gradient():
    net = build_gpt2()
    steer = torch.nn.Parameter(torch.randn(64) * 0.01)
    ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(1))
    model = distgrad.wrap(net)
    with model.trace(ids):
        model.transformer.h[0].output = model.transformer.h[0].output + steer
        with model.output.logits.sum().backward():
            pass
    got = steer.grad.clone()
    steer.grad = None
    handle = net.transformer.h[0].register_forward_hook(lambda m, a, out: out + steer)
    try:
        net(ids).logits.sum().backward()
    finally:
        handle.remove()
    torch.testing.assert_close(got, steer.grad, atol=PARAM_ATOL, rtol=0)
