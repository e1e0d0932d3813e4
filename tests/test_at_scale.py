"""Beyond 2-4 ranks: 8 ranks of DDP and FSDP2, and two nodes on one machine (gloo, CPU), each
running tests/dist/job.py's "at_scale" cases: parity of reads, edits and saves with a
one-process oracle on the global batch (rank 0 holds all 8 ranks' rows), uneven batches,
``tracer.result`` on every rank, and a failure on one rank reaching every rank in seconds.

The two nodes are two ``torchrun`` agents (``--nnodes 2 --node_rank 0|1``, 2 processes each)
meeting at a local rendezvous, as on two machines: ranks 2 and 3 live on the second node, and
rank 3 is the one that fails. Both tests start 8 or 4 processes on a 2-core machine: slow.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, free_port, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "job.py")
CASES = ["case_read_edit", "case_saves", "case_uneven", "case_generate_result", "case_failure"]


def check(procs, results, what: str) -> None:
    for case in CASES:
        report = case_report(procs, results, case)
        assert not report, f"{what} {case}:\n{report}"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_eight_ranks(engine, tmp_path):
    procs = run_ranks(
        [JOB, "--engine", engine, "--cases", "at_scale", "--out", str(tmp_path)], 8, timeout=600
    )
    check(procs, read_results(tmp_path, 8), f"{engine}, 8 ranks:")


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTGRAD_FAILING_RANK="3")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # torchrun sets them for its workers
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                JOB,
                "--engine",
                "ddp",
                "--cases",
                "at_scale",
                "--out",
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    done = []
    for node in nodes:
        try:
            out, _ = node.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            out, _ = node.communicate()
            out += "\n[test] killed after 420 s"
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out))
    # each node's agent reports for its two ranks
    per_rank = [done[rank // 2] for rank in range(4)]
    check(per_rank, read_results(tmp_path, 4), "2 nodes x 2 ranks:")
    for node, proc in enumerate(done):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
