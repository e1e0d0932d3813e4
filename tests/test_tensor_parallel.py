"""Tensor parallelism on real multi-process jobs (gloo on CPU): a tiny Llama split with
parallelize_module, the body written as for one process, every number compared with the unsplit
model on one process (tests/dist/tp_job.py; atol 1e-5).

* tp: Colwise/Rowwise projections over 2 ranks;
* sp: the same with sequence parallelism (norms return DTensors, the residual stream is split);
* fsdp-tp: a (dp, tp) = (2, 2) mesh on 4 ranks, fully_shard over dp after tensor parallelism.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "tp_job.py")
CASES = [
    "case_read_edit",
    "case_read_edit_thread",
    "case_collectives",
    "case_flow",
    "case_failure",
    "case_two_forms",
]


@pytest.mark.parametrize("layout, world", [("tp", 2), ("sp", 2), ("fsdp-tp", 4)])
def test_tensor_parallel_job(layout, world, tmp_path):
    procs = run_ranks([JOB, "--layout", layout, "--out", str(tmp_path)], world)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, (
            f"{layout} rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        )
        path = tmp_path / f"rank{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else {}
        for case in CASES:
            assert result.get(case) == "ok", (
                f"{layout} rank {rank} {case}:\n{result.get(case, proc.stdout[-3000:])}"
            )


@pytest.mark.parametrize("case", ["rank_dependent", "rank_dependent_value"])
def test_rank_dependent_requests_raise_instead_of_hanging(case, tmp_path):
    """A sharded value read on rank 0 only (rank 0 would wait to gather it while rank 1 waits in
    the model's next all-reduce), and different values of one shape read at the same moment:
    every rank raises TraceStateError, or RankFailedError naming it, and exits normally."""
    procs = run_ranks([JOB, "--layout", "tp", "--cases", case, "--out", str(tmp_path)], 2)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result.get(f"case_{case}") == "ok", f"rank {rank}:\n{result}"


@pytest.mark.slow
def test_killed_rank_is_reported(tmp_path):
    """Rank 1 of a tensor-parallel pair is SIGKILLed inside the body; rank 0 raises
    RankFailedError and exits normally."""
    procs = run_ranks([JOB, "--layout", "tp", "--cases", "killed", "--out", str(tmp_path)], 2)
    assert procs[1].returncode == -9  # the rank really died
    assert procs[0].returncode == 0, procs[0].stdout[-3000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result.get("case_killed") == "ok", result


def test_cases_after_a_failure_run_on_a_fresh_group(tmp_path):
    """An assertion fails inside the body on rank 1: that case reports it on every rank (rank
    0 hears of it), and the cases after it pass - they are not failed by the process group the
    failure tore down ("Could not resolve the process group")."""
    procs = run_ranks([JOB, "--layout", "tp", "--cases", "fails_first", "--out", str(tmp_path)], 2)
    results = read_results(tmp_path, 2)
    failed = case_report(procs, results, "case_fails_in_body_on_rank1")
    assert "AssertionError: deliberate failure on rank 1" in failed.split("--- rank 1:")[1], failed
    assert "rank 0 stopped because rank 1: AssertionError" in failed.split("--- rank 1:")[0], failed
    for case in ["case_read_edit", "case_collectives"]:
        assert not case_report(procs, results, case), case_report(procs, results, case)
    assert [proc.returncode for proc in procs] == [0, 0], procs[0].stdout[-3000:]
