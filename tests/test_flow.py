"""distgrad.flow on one process: the recorded norms against raw hooks, the odd-rank finder, the
JSON file, the table and the picture. The 2-rank DDP job is dist/flow_job.py.

Tolerance: norms are fp32 sums of squares, compared relatively (rtol 1e-5)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distgrad
import distgrad.flow
from distgrad.demo.models import build_gpt2

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from flow_job import raw_norms  # noqa: E402

from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "flow_job.py")
WORLD = 2

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5
SCALE = 1e-3  # gradients of order 1 (as in dist/job.py)


def batches(n: int, rows: int = 2):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 384, (rows, 8), generator=g) for _ in range(n)]


def test_norms_match_raw_hooks(gpt2, backward_mode):
    """Two steps, the second of two micro-batches (the norms add their squares), with a body
    that edits h[1]'s gradient: each layer's norm is what a raw tensor hook on its output sees
    (h[1]: before the edit; h[0]: the doubled gradient the edit sends upstream), each layer's
    parameter norm is that of plain autograd's accumulated gradients."""
    oracle = build_gpt2()
    oracle.load_state_dict(gpt2.state_dict())  # the weights the recorded steps ran with
    model = distgrad.wrap(gpt2)
    steps = [batches(1), batches(3)[1:]]
    with distgrad.flow.Recorder(model, layers="transformer.h") as flow:
        for micro in steps:
            for ids in micro:
                with model.trace(ids):
                    h1 = model.transformer.h[1].output
                    with (model.output.logits.sum() * SCALE).backward():
                        h1.grad = h1.grad * 2
            flow.step()
            gpt2.zero_grad(set_to_none=True)
    for record, micro in zip(flow.run.steps, steps):
        acts, params = raw_norms(oracle, micro, edit=2.0, scale=SCALE)
        torch.testing.assert_close(torch.tensor(record["activation"][0]), acts, rtol=RTOL, atol=0)
        torch.testing.assert_close(
            torch.tensor(record["activation_global"]), acts, rtol=RTOL, atol=0
        )
        torch.testing.assert_close(torch.tensor(record["param_global"]), params, rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(record["param"][0]), params, rtol=RTOL, atol=0)
        oracle.zero_grad(set_to_none=True)
    assert flow.run.steps[0] != flow.run.steps[1]  # (the two steps are not the same numbers)


def test_layers_as_paths_and_hooks_removed(gpt2):
    before = [len(m._forward_hooks) for m in gpt2.modules()]
    model = distgrad.wrap(gpt2)
    flow = distgrad.flow.Recorder(model, layers=["transformer.wte", "transformer.h.1"])
    with model.trace(batches(1)[0]):
        with model.output.logits.sum().backward():
            pass
    record = flow.step()
    assert len(record["activation_global"]) == 2 and all(v > 0 for v in record["activation_global"])
    flow.close()
    assert [len(m._forward_hooks) for m in gpt2.modules()] == before


def test_a_step_without_backward_records_zeros(gpt2):
    model = distgrad.wrap(gpt2)
    flow = distgrad.flow.Recorder(model, layers="transformer.h")
    with model.trace(batches(1)[0]):
        model.output.logits.save()
    assert flow.step()["activation_global"] == [0.0, 0.0]
    flow.close()


def test_wrong_layers_are_refused(gpt2):
    model = distgrad.wrap(gpt2)
    with pytest.raises(TypeError, match="ModuleList or Sequential"):
        distgrad.flow.Recorder(model, layers="transformer.wte")
    with pytest.raises(AttributeError):
        distgrad.flow.Recorder(model, layers=["transformer.nothing"])


def synthetic(ranks: int, scales: list[float]) -> distgrad.flow.FlowRun:
    run = distgrad.flow.FlowRun(["h.0", "h.1"], ranks, "ddp")
    for step in range(3):
        acts = [
            [scales[r] * (1 + 0.1 * step) * (layer + 1) for layer in range(2)] for r in range(ranks)
        ]
        run.add(
            activation=acts,
            activation_global=[math.sqrt(sum(a[i] ** 2 for a in acts)) for i in range(2)],
            param=[[1.0, 2.0]] * ranks,
            param_global=[1.0, 2.0],
        )
    return run


def test_odd_ranks():
    assert synthetic(3, [1, 1, 1]).odd_ranks() == {}
    assert list(synthetic(3, [1, 100, 1.2]).odd_ranks()) == [1]
    assert "smaller" in synthetic(4, [1, 1, 1e-3, 1]).odd_ranks()[2]
    two = synthetic(2, [1, 100]).odd_ranks()
    assert list(two) == [1] and "100x larger" in two[1]
    assert list(synthetic(2, [300, 1]).odd_ranks()) == [0]
    assert synthetic(2, [1, 5]).odd_ranks() == {}  # within the factor
    nan = synthetic(3, [1, 1, 1])
    nan.steps[1]["activation"][2][0] = math.nan
    assert "non-finite" in nan.odd_ranks()[2]


def test_json_keeps_non_finite_values(tmp_path):
    run = synthetic(3, [1, 1, 1])
    run.steps[0]["activation"][1][1] = math.inf
    run.save(tmp_path / "run.json")
    back = distgrad.flow.load(tmp_path / "run.json")
    assert back.steps == run.steps  # inf survives the file
    assert (back.layers, back.ranks, back.engine) == (run.layers, run.ranks, run.engine)
    (tmp_path / "other.json").write_text(json.dumps({"steps": []}))
    with pytest.raises(ValueError, match="not a distgrad.flow run"):
        distgrad.flow.load(tmp_path / "other.json")


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "distgrad.flow", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def flow_job(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"flow-{request.param}")
    procs = run_ranks([JOB, "--engine", request.param, "--out", str(out)], WORLD)
    return request.param, procs, read_results(out, WORLD), out


@pytest.mark.parametrize("case", ["case_norms_match_raw_hooks", "case_odd_rank"])
def test_on_two_ranks(flow_job, case):
    engine, procs, results, _ = flow_job
    report = case_report(procs, results, case)
    assert not report, f"{engine} {case}:\n{report}"
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, (
            f"{engine} rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        )


def test_cli_prints_a_table_and_draws_a_png(flow_job, tmp_path):
    """On the 2-rank run whose rank 1 had its loss x 100."""
    import matplotlib  # noqa: F401 (a test dependency: missing, it fails here, not skips)

    engine, _, results, out = flow_job
    assert all(result.get("case_odd_rank") == "ok" for result in results), results
    run = distgrad.flow.load(out / "run0.json")
    table = cli(str(out / "run0.json"))
    assert table.returncode == 0, table.stderr
    assert "transformer.h.1" in table.stdout and "odd rank 1" in table.stdout, table.stdout
    assert f"{run.steps[-1]['activation_global'][0]:.3e}" in table.stdout, table.stdout
    drawn = cli(str(out / "run0.json"), "-o", str(tmp_path / "flow.png"))
    assert drawn.returncode == 0, drawn.stderr
    png = (tmp_path / "flow.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, len(png)
