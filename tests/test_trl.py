"""TRL's SFTTrainer and DPOTrainer traced by ``distgrad.trainer.TraceSteps`` on 2 DDP ranks
(gloo, CPU): tests/dist/trl_job.py. Each rank pads its batch to its own length, so the saved
activations and gradients are ragged; each rank's part of rank 0's records equals what a raw
hook saw on that rank in plain TRL, the padding is NaN, and the parameters after 2 steps equal
plain TRL's with the same gradient edit made by a raw hook (fp32, rtol 1e-5, atol 1e-6)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "trl_job.py")
WORLD = 2


@pytest.fixture(scope="module")
def trl_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl")
    procs = run_ranks([JOB, "--out", str(out)], WORLD, timeout=400)
    return procs, read_results(out, WORLD)


@pytest.mark.parametrize("case", ["case_sft", "case_dpo"])
def test_trl_trainer_on_two_ranks(trl_job, case):
    procs, results = trl_job
    report = case_report(procs, results, case)
    assert not report, f"{case}:\n{report}"


def test_trl_job_ends_cleanly(trl_job):
    procs, results = trl_job
    for rank, (proc, result) in enumerate(zip(procs, results)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        assert "teardown" not in result, result.get("teardown")
