"""TRL's SFTTrainer and DPOTrainer traced by ``distgrad.trainer.TraceSteps`` on 2 DDP ranks
(gloo, CPU): the recipe ``examples/trl_trainers.py`` run on 2 ranks (tests/test_examples.py
runs it on one process). Each rank pads its batch to its own length, so the saved activations
and gradients are ragged: the script checks each rank's part of rank 0's records against what
a raw hook saw on that rank in plain TRL (plain autograd on that rank's rows), the NaN padding
through ``distgrad.rank_parts``, and the parameters after 2 steps against plain TRL whose raw
hook makes the same gradient edit (fp32, relative 1e-5); it prints its ``ok:`` line only after
the checks of both trainers pass, and exits non-zero if no record was ragged."""

import sys
from pathlib import Path

import pytest
import trl  # noqa: F401 (a test dependency: missing, it fails here, not skips)

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import run_ranks  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parent.parent / "examples" / "trl_trainers.py")
WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    return run_ranks([SCRIPT], WORLD, timeout=400)


def test_sft_and_dpo_on_two_ranks(ranks):
    for rank, proc in enumerate(ranks):
        said = [line for line in proc.stdout.splitlines() if line.startswith("ok: ")]
        assert len(said) == 1 and f"on {WORLD} rank(s)" in said[0], (
            f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        )
        for trainer in ("SFT", "DPO"):
            assert f"{trainer}Trainer 2 steps" in said[0], said[0]
            if rank == 0:  # the records gathered there were ragged, and checked part by part
                assert f"{trainer}Trainer 2 steps, 0 ragged" not in said[0], said[0]


def test_trl_ranks_exit_cleanly(ranks):
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
