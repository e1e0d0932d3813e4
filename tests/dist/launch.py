"""Start one process per rank on this machine, gloo over loopback, like torchrun would but
without its agent (which would kill the survivors when a rank dies, hiding what we test).

The ranks are watched together: once one exits with an error, the others get ``grace`` seconds
to finish (long enough to report a lost rank) and are then stopped, so that a rank left waiting
in a collective costs seconds, not the whole ``timeout``. A stopped rank first prints every
thread's Python stack (cases.py registers faulthandler on SIGTERM), which says where it waited.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

# every engine the jobs and launch scripts cover
ENGINES = ["ddp", "fsdp1", "fsdp2", "accelerate", "zero1", "zero2", "zero3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (the rank prints its stacks), then SIGKILL whatever is still running."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    ends = time.monotonic() + 5
    while time.monotonic() < ends and any(p.poll() is None for p in running):
        time.sleep(0.05)
    for p in running:
        if p.poll() is None:
            p.kill()
        p.wait()


RESTART = 3  # a rank's exit code asking for a fresh start from where it stopped (cases.py)


def run_ranks(argv: list[str], world: int, timeout: float = 300,
              grace: float = 30) -> list[subprocess.CompletedProcess]:
    """Run ``argv`` on ``world`` ranks; each rank's output (stdout and stderr) comes back in its
    CompletedProcess, with a line from the launcher appended where it stopped the rank. Where
    every rank exits with RESTART (a case destroyed the process group and cases remain), the
    ranks are started again, on a new port; their outputs are joined."""
    start = time.monotonic()
    earlier = [""] * world
    while True:
        left = max(timeout - (time.monotonic() - start), 1.0)
        done = _run_once(argv, world, left, grace)
        if any(p.returncode != RESTART for p in done):
            break
        earlier = [e + p.stdout + "\n[launcher] restarted the ranks\n" for e, p in zip(earlier, done)]
    return [subprocess.CompletedProcess(p.args, p.returncode, e + p.stdout)
            for e, p in zip(earlier, done)]


def _run_once(argv: list[str], world: int, timeout: float,
              grace: float) -> list[subprocess.CompletedProcess]:
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        procs, paths = [], []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       DS_ACCELERATOR="cpu")
            paths.append(os.path.join(logs, f"rank{rank}.log"))
            with open(paths[-1], "w") as log:  # a file, not a pipe: no rank blocks on a full pipe
                procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=log,
                                              stderr=subprocess.STDOUT, text=True))
        start = time.monotonic()
        why, first_error, stopped = "", None, [False] * world
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_error is None:
                failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    first_error = (now, failed[0], procs[failed[0]].returncode)
            if first_error is not None and now > first_error[0] + grace:
                why = (f"rank {first_error[1]} exited with code {first_error[2]} and this rank "
                       f"was still running {grace:.0f} s later")
            elif now > start + timeout:
                why = f"the job was still running after {timeout:.0f} s"
            if why:
                stopped = [p.poll() is None for p in procs]
                _stop(procs)
                break
            time.sleep(0.05)
        done = []
        for rank, (p, path) in enumerate(zip(procs, paths)):
            with open(path, errors="replace") as log:
                out = log.read()
            if stopped[rank]:
                out += f"\n[launcher] stopped rank {rank}: {why}\n"
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return done


def read_results(out, world: int) -> list[dict]:
    """Each rank's ``rank<r>.json`` (cases.run_cases): case -> "ok" or what went wrong."""
    results = []
    for rank in range(world):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({})
    return results


def case_report(procs: list[subprocess.CompletedProcess], results: list[dict], case: str) -> str:
    """What went wrong with ``case``, rank by rank ("" where every rank says "ok"): the
    traceback each failing rank recorded, or, where a rank recorded nothing of the case, its
    exit code and the end of its output (where a stopped rank printed its stacks)."""
    lines = []
    for rank, (proc, result) in enumerate(zip(procs, results)):
        said = result.get(case, "nothing recorded")
        if said == "ok":
            continue
        if said == "nothing recorded" or said.startswith("running:"):
            said += f"; exit code {proc.returncode}; output ends:\n{proc.stdout[-3000:]}"
        lines.append(f"--- rank {rank}: {said}")
    return "\n".join(lines)
