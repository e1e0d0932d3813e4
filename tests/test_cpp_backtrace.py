"""A PyTorch C++ error on one of distgrad's greenlets raises, not crashes
(distgrad/cpp_backtrace.py).

torch records a C++ backtrace for every error with glibc's ``backtrace()``, whose walk can run
off a greenlet's stack into stale memory and crash the process; which runs crash depends on
what ran before, so the tests check the guard itself, in fresh processes: glibc's walk returns
nothing once distgrad has started a greenlet (and not with ``DISTGRAD_CPP_BACKTRACES=1``), and a
torch error in the second invoke body of many traces, at many stack depths, is a RuntimeError."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the guard is for glibc on x86-64 Linux",
)

SCRIPT = r"""
import json, torch, distgrad
walk = lambda: len(torch._C._get_cpp_backtrace(0, 16))
before = walk()
net = torch.nn.Sequential(torch.nn.Linear(8, 8))
model = distgrad.wrap(net)
errors = []

def traced():
    with model.trace() as tr:
        with tr.invoke(torch.randn(2, 8)):
            model.output.sum()
        with tr.invoke(torch.randn(3, 8)):
            model.output
            torch.ones(3) @ torch.ones(4)   # a C++ error on the body's greenlet

def deep(n):
    return traced() if n == 0 else deep(n - 1)

for depth in (0, 40, 3, 120, 0, 7):
    try:
        deep(depth)
    except RuntimeError as e:
        errors.append("inconsistent tensor size" in str(e))
print(json.dumps({"before": before, "after": walk(), "errors": errors}))
"""


def run(tmp_path, env_extra: dict) -> dict:
    script = tmp_path / "greenlet_error.py"  # (a file: distgrad reads an invoke body's lines)
    script.write_text(SCRIPT)
    env = {**os.environ, **env_extra}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_torch_error_on_a_greenlet_raises_and_the_walk_is_guarded(tmp_path):
    seen = run(tmp_path, {})
    assert seen["before"] > 0  # glibc's walk works before distgrad starts a greenlet
    assert seen["after"] == 0  # ...and returns no frames after
    assert seen["errors"] == [True] * 6


def test_the_guard_can_be_left_off(tmp_path):
    seen = run(tmp_path, {"DISTGRAD_CPP_BACKTRACES": "1"})
    assert seen["after"] > 0
