"""Start one process per rank on this machine, gloo over loopback, like torchrun would but
without its agent (which would kill the survivors when a rank dies, hiding what we test)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

# every engine the jobs and launch scripts cover
ENGINES = ["ddp", "fsdp1", "fsdp2", "accelerate", "zero1", "zero2", "zero3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], world: int, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   DS_ACCELERATOR="cpu")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    done = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return done
