"""An accelerate loop with gradient accumulation on 2 ranks (gloo, CPU), its
``accelerator.backward(loss)`` replaced by a distgrad trace: tests/dist/accelerate_loop_job.py.

* the recipe of docs/recipes.rst (accumulation 2, 3 optimizer steps, a gradient saved and
  doubled) leaves the parameters the same accelerate loop with raw hooks leaves (atol 1e-5);
* ``accelerator.accumulate(model)`` and ``model.no_sync()`` on the object ``distgrad.wrap``
  returns reach DDP: inside them ``.grad`` is each rank's own (it differs between ranks and
  equals a plain copy's), after the sync step it is the average over ranks.
"""

import sys
from pathlib import Path

import accelerate  # noqa: F401 (a test dependency: missing, it fails here, not skips)
import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "accelerate_loop_job.py")
CASES = [
    "case_recipe_matches_raw_hooks",
    "case_accumulate_reaches_no_sync",
    "case_model_no_sync_is_ddps",
]
WORLD = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate-loop")
    procs = run_ranks([JOB, "--out", str(out)], WORLD)
    return procs, read_results(out, WORLD)


@pytest.mark.parametrize("case", CASES)
def test_accelerate_loop_case_on_every_rank(job, case):
    procs, results = job
    report = case_report(procs, results, case)
    assert not report, f"{case}:\n{report}"
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
