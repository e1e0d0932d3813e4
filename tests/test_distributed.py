"""Real multi-process jobs (2 ranks, gloo on CPU) for each data-parallel engine.

Each engine runs every case in one job and one process group (start-up is the expensive part),
tests/dist/job.py; this file starts the job once per engine and reports each case. The oracle
is one process with plain autograd on the global batch, computed inside the job.
"""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import ENGINES, case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "job.py")
CASES = [
    "case_wrapper_names",
    "case_generate_result",
    "case_read_edit",
    "case_saves",
    "case_steady_saves",
    "case_gather_memory",
    "case_uneven",
    "case_watch_only_in_traces",
    "case_param_write",
    "case_rank_dependent_save",
    "case_different_values_saved",
    "case_no_cycles",
    "case_param_grad_save",
    "case_flow",
    "case_invokes",
    "case_failure",
]
WORLD = 2
# one engine's own cases (job.py's ENGINE_CASES), run by its "all" job before case_failure
DDP_BACKWARDS = [
    "case_two_backward_blocks_in_no_sync",
    "case_two_backward_blocks_refused",
    "case_plain_backward_then_block_refused",
]
ENGINE_CASES = {
    "ddp": DDP_BACKWARDS,
    "accelerate": DDP_BACKWARDS,
    "fsdp1": ["case_flow_refuses_flat_params"],
}


def _job(engine, cases, tmp_path_factory, world=WORLD):
    out = tmp_path_factory.mktemp(f"{engine}-{cases}")
    procs = run_ranks([JOB, "--engine", engine, "--cases", cases, "--out", str(out)], world)
    return procs, read_results(out, world)


def check_case(engine, procs, results, case):
    """``case`` said "ok" on every rank, and the job ended cleanly - unless a failing case
    ended it early ("job ended"): then that case's own test shows the failure."""
    report = case_report(procs, results, case)
    assert not report, f"{engine} {case}:\n{report}"
    if not any("job ended" in result for result in results):
        for rank, (proc, result) in enumerate(zip(procs, results)):
            assert proc.returncode == 0, (
                f"{engine} rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
            )
            assert "teardown" not in result, result.get("teardown")


@pytest.fixture(scope="module", params=ENGINES)
def engine_job(request, tmp_path_factory):
    return request.param, _job(request.param, "all", tmp_path_factory)


@pytest.mark.parametrize("case", CASES)
def test_engine_case_on_every_rank(engine_job, case):
    engine, (procs, results) = engine_job
    check_case(engine, procs, results, case)


def test_engine_own_cases_on_every_rank(engine_job):
    """DDP and accelerate's DDP: two backward blocks over one forward (dist/ddp_backwards.py);
    FSDP1: distgrad.flow refusing use_orig_params=False on every rank (dist/flow_job.py)."""
    engine, (procs, results) = engine_job
    if engine not in ENGINE_CASES:
        pytest.skip(f"{engine} has no cases of its own")
    for case in ENGINE_CASES[engine]:
        check_case(engine, procs, results, case)


def test_failing_rank_ends_the_job_and_is_shown(tmp_path_factory):
    """Rank 1 fails an assertion while rank 0 waits for it in DDP's all-reduce: the job ends in
    seconds (not at the launcher's timeout), the failing case's report shows rank 1's assertion
    and traceback, and the case after it says it did not run and why."""
    start = time.monotonic()
    procs, results = _job("ddp", "fails_on_rank1", tmp_path_factory)
    took = time.monotonic() - start
    assert took < 60, f"the job took {took:.0f} s to end"
    with pytest.raises(AssertionError) as failed:
        check_case("ddp", procs, results, "case_fails_on_rank1")
    shown = str(failed.value)
    assert "AssertionError: deliberate failure on rank 1" in shown, shown
    assert 'job.py", line' in shown and "in case_fails_on_rank1" in shown, shown  # the traceback
    with pytest.raises(AssertionError) as later:
        check_case("ddp", procs, results, "case_saves")
    assert "not run: case_fails_on_rank1 failed on rank 1" in str(later.value), later.value


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_killed_rank_is_reported(engine, tmp_path_factory):
    """Rank 1 is SIGKILLed inside the body; rank 0 raises RankFailedError and exits normally."""
    procs, results = _job(engine, "killed", tmp_path_factory)
    assert procs[1].returncode == -9  # the rank really died
    assert procs[0].returncode == 0, procs[0].stdout[-3000:]
    assert results[0].get("case_killed") == "ok", results[0]


@pytest.mark.parametrize(
    "engine",
    [
        "ddp",
        "fsdp2",
        pytest.param("fsdp1", marks=pytest.mark.slow),
        pytest.param("zero3", marks=pytest.mark.slow),
    ],
)
def test_rank_dependent_param_grad(engine, tmp_path_factory):
    """`if rank == 0: model.<path>.weight.grad` inside the trace: under DDP a local read that
    works; under FSDP and ZeRO a collective rank 1 never makes, so rank 0 raises TraceStateError
    (instead of waiting until gloo's timeout, or gloo aborting rank 1) and rank 1 hears of it."""
    procs, results = _job(engine, "rank_dependent_param_grad", tmp_path_factory)
    for rank, (proc, result) in enumerate(zip(procs, results)):
        assert proc.returncode == 0, (
            f"{engine} rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        )
        assert result.get("case_rank_dependent_param_grad") == "ok", (
            f"{engine} rank {rank}:\n{result}"
        )


def test_a_collective_given_up_on_does_not_abort_the_exit(tmp_path_factory, monkeypatch):
    """The case above on FSDP2, with rank 0's process ending while rank 1 is shutting down
    (dist/exit_race.py): the end-of-trace gather rank 1 gave up on fails then,
    on a gloo worker thread, and rank 1 still exits with 0 - not with "terminate called
    without an active exception" (SIGABRT), as it did when that thread freed the gather's
    tensors itself."""
    monkeypatch.setenv("DISTGRAD_TEST_EXIT_RACE", "1")
    procs, results = _job("fsdp2", "rank_dependent_param_grad", tmp_path_factory)
    for rank, (proc, result) in enumerate(zip(procs, results)):
        assert result.get("case_rank_dependent_param_grad") == "ok", f"rank {rank}:\n{result}"
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"


def test_gather_memory_four_ranks(tmp_path_factory):
    """On 4 ranks as on 2: a rank other than 0 sends its own saved bytes and receives none of
    the gather="rank0" saves; rank 0 receives 4 ranks' bytes and the oracle's values."""
    procs, results = _job("ddp", "gather_memory", tmp_path_factory, world=4)
    check_case("ddp", procs, results, "case_gather_memory")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_four_ranks(engine, tmp_path_factory):
    """Every case on 4 ranks: uneven batches of 2,1,1,1 rows, gathers of 4 parts, rank 1 failing
    while three others wait."""
    procs, results = _job(engine, "all", tmp_path_factory, world=4)
    for case in CASES:
        check_case(engine, procs, results, case)
