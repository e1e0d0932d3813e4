"""Lightning's Trainer (automatic and manual optimization, ``strategy="ddp"``) and Fabric's
loop traced by distgrad, and plain modules traced in a multi-process job, on one process and on
2 ranks (gloo, CPU): tests/dist/lightning_job.py (with ``fabric_cases.py`` and
``in_job_cases.py``).

* 3 SGD steps of the tiny GPT-2, the first block's output and gradient saved and the gradient
  doubled: the saved values (rank 0: every rank's rows) and the parameters after the steps
  equal one process running the global batch with plain hooks (fp32, rel 1e-5), and the edit
  moved the parameters; under manual optimization also a weight's reduced ``.grad``; under
  ``TraceSteps`` also with ``accumulate_grad_batches=2`` (one record per micro-batch);
* ``self.manual_backward(loss)`` called in a trace's body runs; a ``with loss.backward():``
  block or a plain ``.backward()`` that bypasses Lightning's or Fabric's backward raises on
  every rank, on one process too (under automatic optimization a block in ``training_step``
  would be a second backward);
* a plain module on 2 ranks: saves gathered to rank 0; a submodule of a ``fully_shard``
  parent gives FSDP2's whole weight gradient; a trace on rank 0 alone keeps
  ``gather="none"`` saves and raises (no hang) for a gathered one; an unreduced parameter
  ``.grad`` raises on every rank, and so does a backward block on a module inside a DDP
  module whose forward the trace bypassed.

Lightning's ``strategy="fsdp"`` and ``"deepspeed"`` refuse the CPU accelerator (their errors are
shown in docs/recipes.rst): a case checks FSDP's, and nothing further of them runs here.
"""

import sys
from pathlib import Path

import lightning  # noqa: F401 (a test dependency: missing, it fails here, not skips)
import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "lightning_job.py")
EVERYWHERE = [
    "case_lightning_automatic",
    "case_lightning_automatic_accumulation",
    "case_lightning_manual",
    "case_lightning_manual_backward_in_body_runs",
    "case_fabric_loop",
    "case_fabric_steering_vector",
    "case_fabric_block_raises",
    "case_lightning_manual_block_raises",
    "case_lightning_manual_plain_backward_raises",
]
# (each failure on 2 ranks restarts them: these raise through the same code there)
ONE_PROCESS = ["case_fabric_plain_backward_raises", "case_lightning_automatic_block_raises"]
TWO_RANKS = [
    "case_plain_module_saves_reach_rank0",
    "case_trace_on_rank0_only",
    "case_submodule_of_a_fully_sharded_parent",
    "case_lightning_fsdp_refuses_the_cpu",
    "case_block_bypassing_a_ddp_parent_raises",
    "case_unreduced_parameter_grad_raises",
]


@pytest.fixture(scope="module", params=[1, 2], ids=["one_process", "two_ranks"])
def job(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"lightning-{world}")
    procs = run_ranks([JOB, "--out", str(out)], world)
    return world, procs, read_results(out, world)


@pytest.mark.parametrize("case", EVERYWHERE + ONE_PROCESS + TWO_RANKS)
def test_lightning_case(job, case):
    world, procs, results = job
    if case in TWO_RANKS and world == 1:
        pytest.skip("a plain module in a job of several processes: runs on 2 ranks")
    if case in ONE_PROCESS and world > 1:
        pytest.skip("the same refusal as on one process; a failure case on 2 ranks costs a restart")
    report = case_report(procs, results, case)
    assert not report, f"{case}:\n{report}"
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
