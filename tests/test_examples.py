"""The fine-tuning recipes of docs/recipes.rst, run as a user runs them: each examples/*.py as
its own process, from the repository root. Each script checks its own numbers against plain
PyTorch with raw hooks and prints its "ok: ..." line only after those checks pass (a mismatch
exits non-zero with what differed), so a test here passes only where the script's check ran
and held. The accelerate loop also runs on 2 ranks (DDP over gloo, tests/dist/launch.py), and
so do the interventions trained beside the model (steering_vector.py under DDP, reft.py under
FSDP2).

All the runs start together, once per module (most of each one's time is importing
transformers, on one thread), and each test reads its own run's outcome (so selecting one
test still runs them all).
"""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
ACCELERATE_LOOP = ROOT / "examples" / "accelerate_loop.py"
# interventions trained beside the model: DDP (steering_vector.py) and FSDP2 (reft.py)
BESIDE = [ROOT / "examples" / "steering_vector.py", ROOT / "examples" / "reft.py"]


def ok_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("ok: ")]


@pytest.fixture(scope="module")
def outcomes():
    """Every example run as ``python examples/<name>.py``: name -> (exit code, stdout, stderr);
    and "2 ranks" -> the accelerate loop's ranks (CompletedProcess each)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = ThreadPoolExecutor(1)
    two_ranks = ranks.submit(run_ranks, [str(ACCELERATE_LOOP)], 2)
    beside = {path.name: ranks.submit(run_ranks, [str(path)], 2) for path in BESIDE}
    running = {
        path.name: subprocess.Popen(
            [sys.executable, str(path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in EXAMPLES
    }
    deadline = time.monotonic() + 300
    done = {}
    for name, proc in running.items():
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n[test] killed: still running after 300 s"
        done[name] = (proc.returncode, out, err)
    done["2 ranks"] = two_ranks.result()
    for name, future in beside.items():
        done[f"{name} on 2 ranks"] = future.result()
    ranks.shutdown()
    return done


@pytest.mark.parametrize("script", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_runs_and_its_check_passes(outcomes, script):
    code, out, err = outcomes[script.name]
    said = f"{script.name} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    assert code == 0, said
    assert len(ok_lines(out)) == 1, said


def test_accelerate_loop_on_two_ranks(outcomes):
    procs = outcomes["2 ranks"]
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    said = ok_lines(procs[0].stdout)
    assert len(said) == 1 and "on 2 process" in said[0], procs[0].stdout[-3000:]


@pytest.mark.parametrize("script", BESIDE, ids=[path.stem for path in BESIDE])
def test_intervention_example_on_two_ranks(outcomes, script):
    procs = outcomes[f"{script.name} on 2 ranks"]
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    said = ok_lines(procs[0].stdout)
    assert len(said) == 1 and "on 2 process" in said[0], procs[0].stdout[-3000:]


def test_every_example_is_shown_in_the_recipes_page():
    page = (ROOT / "docs" / "recipes.rst").read_text()
    assert EXAMPLES, "no examples/*.py found"
    missing = [
        path.name for path in EXAMPLES if f".. literalinclude:: ../examples/{path.name}" not in page
    ]
    assert not missing, f"docs/recipes.rst shows no literalinclude of {missing}"
