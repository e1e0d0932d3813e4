"""distgrad alongside other libraries that patch torch.Tensor (nnsight above all), in one process.

distgrad puts ``save``, ``grad`` and ``backward`` on ``torch.Tensor``; each serves distgrad's own
bodies only and hands every other call to what was there before, whichever library was imported
first. Import order is process-wide state, so each case runs in a fresh process
(``other_libraries_job.py``) in both orders, and compares with plain autograd there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ORDERS = ["other-first", "distgrad-first"]


def run_case(case: str, order: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(HERE / "other_libraries_job.py"), case, order],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )


@pytest.fixture
def nnsight_installed():
    # found, not imported: importing nnsight here would patch torch.Tensor for every later test
    # of this process
    if importlib.util.find_spec("nnsight") is None:
        pytest.skip("nnsight is not installed (it is in the test extra)")


@pytest.mark.parametrize("order", ORDERS)
def test_nnsight_save_beside_distgrad(nnsight_installed, order):
    """``h = model.transformer.h[0].output.save()`` in an nnsight trace is nnsight's: the output
    the forward hook sees, before and after a distgrad trace of the same model."""
    run_case("nnsight_save", order)


@pytest.mark.parametrize("order", ORDERS)
def test_nnsight_backward_block_beside_distgrad(nnsight_installed, order):
    """nnsight's ``with loss.backward():`` (``.grad`` read and saved, then doubled) and distgrad's
    take turns on one model: both give the gradients and parameter gradients of tensor hooks,
    and distgrad's trace opens distgrad's block though nnsight replaced Tensor.backward."""
    run_case("nnsight_backward", order)


@pytest.mark.parametrize("order", ORDERS)
def test_outside_any_trace_nnsight_save_is_nnsights(nnsight_installed, order):
    """``t.save()`` with no trace open raises nnsight's own error, not distgrad's; a plain
    backward and ``.grad`` are PyTorch's."""
    run_case("nnsight_outside", order)


@pytest.mark.parametrize("order", ORDERS)
def test_a_library_patching_tensor_before_or_after(order):
    """A library with its own ``Tensor.save``, ``grad`` property and ``backward`` (not deferring
    to anyone): distgrad's traces keep plain autograd's numbers and its saves, and every call
    outside them reaches the library."""
    run_case("library_numbers", order)
