"""Ragged saves on 2 ranks (tests/dist/ragged_job.py): ranks whose batches have their own
sequence lengths, under DDP and FSDP2 in one job; each rank's part of the NaN-padded global
value against one process's plain autograd on that rank's rows (fp32, rtol 1e-5, atol 1e-6),
the opt-out, and the errors for what cannot be padded or joined."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "ragged_job.py")
WORLD = 2
CASES = [
    f"{case}[{engine}]"
    for engine in ("ddp", "fsdp2")
    for case in ("case_ragged_saves", "case_ragged_errors")
]


@pytest.fixture(scope="module")
def ragged_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ragged")
    procs = run_ranks([JOB, "--out", str(out)], WORLD, timeout=240)
    return procs, read_results(out, WORLD)


@pytest.mark.parametrize("case", CASES)
def test_ragged_case_on_every_rank(ragged_job, case):
    procs, results = ragged_job
    report = case_report(procs, results, case)
    assert not report, f"{case}:\n{report}"


def test_ragged_job_ends_cleanly(ragged_job):
    procs, results = ragged_job
    for rank, (proc, result) in enumerate(zip(procs, results)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        assert "teardown" not in result, result.get("teardown")
