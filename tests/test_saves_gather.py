"""The end-of-trace gather of saves (SavesGather) on 2 and 3 ranks (tests/dist/gather_job.py):
exact values for every mode, dtype and join dim, an uneven step, ragged steps (NaN-padded,
each rank's part), streamed in chunks or not."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "gather_job.py")


@pytest.mark.parametrize("world", [2, 3])
def test_saves_gather_values_with_and_without_chunks(world):
    procs = run_ranks([JOB], world, timeout=120)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        assert "bound 8, small None:" in proc.stdout, proc.stdout[-3000:]
