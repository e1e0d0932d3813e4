"""The shipped launch scripts: the main job under torchrun, accelerate launch and the deepspeed
launcher, each checking its numbers against one process on rank 0 (see distgrad/demo/).
A separate module from test_distributed.py so that xdist runs the two on different workers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import ENGINES, free_port  # noqa: E402


@pytest.mark.parametrize(
    "engine", ENGINES + ["tp", "pp-gpipe", "pp-1f1b", "pp-interleaved", "deepspeed-pipe"]
)
def test_demo_under_torchrun_matches_one_process(engine):
    """The shipped launch script: a few SGD steps with an edit, checked on rank 0."""
    import subprocess

    script = Path(__file__).parent.parent / "launch" / "torchrun.sh"
    proc = subprocess.run(
        ["bash", str(script), engine],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "NPROC": "2"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(
        line.startswith("check against one process") and line.endswith(": OK")
        for line in proc.stdout.splitlines()
    ), proc.stdout[-3000:]


def test_demo_under_accelerate_launch():
    """launch/accelerate.sh: `accelerate launch` with the shipped CPU config, 2 processes."""
    import subprocess

    script = Path(__file__).parent.parent / "launch" / "accelerate.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engine accelerate, 2 ranks" in proc.stdout
    assert "check against one process, plain autograd, global batch: OK" in proc.stdout


def test_demo_under_the_deepspeed_launcher():
    """launch/deepspeed.sh: the deepspeed launcher (it adds --local_rank) with launch/zero3.json."""
    import os
    import subprocess

    script = Path(__file__).parent.parent / "launch" / "deepspeed.sh"
    proc = subprocess.run(
        ["bash", str(script), "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MASTER_PORT": str(free_port())},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check against one process, plain autograd, global batch: OK" in proc.stdout


def test_deepspeed_pipeline_under_the_deepspeed_launcher():
    """launch/deepspeed.sh pipe: DeepSpeed's pipeline engine under its own launcher."""
    import os
    import subprocess

    script = Path(__file__).parent.parent / "launch" / "deepspeed.sh"
    proc = subprocess.run(
        ["bash", str(script), "pipe"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MASTER_PORT": str(free_port())},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check against one process, unsplit, plain autograd: OK" in proc.stdout
