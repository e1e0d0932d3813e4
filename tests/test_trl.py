"""TRL's SFTTrainer and DPOTrainer traced by ``distgrad.trainer.TraceSteps`` on 2 DDP ranks
(gloo, CPU): the recipe ``examples/trl_trainers.py`` run on 2 ranks (tests/test_examples.py
runs it on one process). Each rank pads its batch to its own length, so the saved activations
and gradients are ragged: the script checks each rank's part of rank 0's records against what
a raw hook saw on that rank in plain TRL (plain autograd on that rank's rows), the NaN padding
through ``distgrad.rank_parts``, and the parameters after 2 steps against plain TRL whose raw
hook makes the same gradient edit (fp32, relative 1e-5); it prints one ``ok:`` line a trainer
only after its checks pass, and exits non-zero if no record was ragged."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import run_ranks  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parent.parent / "examples" / "trl_trainers.py")
WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    return run_ranks([SCRIPT], WORLD, timeout=400)


@pytest.mark.parametrize("trainer", ["SFT", "DPO"])
def test_trl_trainer_on_two_ranks(ranks, trainer):
    for rank, proc in enumerate(ranks):
        ok = f"ok: TRL {trainer}Trainer on {WORLD} rank(s)"
        assert ok in proc.stdout, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    assert "0 ragged values" not in ranks[0].stdout, ranks[0].stdout[-3000:]


def test_trl_ranks_exit_cleanly(ranks):
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
