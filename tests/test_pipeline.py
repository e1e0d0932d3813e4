"""Pipeline parallelism on real multi-process jobs (gloo on CPU): torch.distributed.pipelining
schedules over one stage per rank, the body written against the whole model's paths, every
number compared with the unsplit model on one process (tests/dist/pp_job.py; atol 1e-5)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "pp_job.py")


# what pp_job.py runs with --cases all, each checked on every rank
_ALL = (
    "case_read_edit",
    "case_read_edit_thread",
    "case_edits_read_back",
    "case_edits_read_back_thread",
    "case_body_without_source",
    "case_nothing_left_behind",
    "case_flow",
    "case_out_of_order",
)


def _job(tmp_path, schedule, microbatches, world, cases="all", split="manual", width=8):
    procs = run_ranks(
        [
            JOB,
            "--schedule",
            schedule,
            "--microbatches",
            str(microbatches),
            "--cases",
            cases,
            "--split",
            split,
            "--width",
            str(width),
            "--out",
            str(tmp_path),
        ],
        world,
    )
    results = []
    for rank, proc in enumerate(procs):
        path = tmp_path / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    return results


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("microbatches", [2, 4])
def test_two_stages(schedule, microbatches, tmp_path):
    for rank, result in enumerate(_job(tmp_path, schedule, microbatches, 2)):
        for case in _ALL:
            assert result.get(case) == "ok", f"rank {rank} {case}:\n{result.get(case)}"


@pytest.mark.parametrize("schedule", ["interleaved", "looped"])
def test_two_stages_per_rank(schedule, tmp_path):
    """ScheduleInterleaved1F1B and ScheduleLoopedBFS: 4 stages on 2 ranks (rank 0 runs layers
    0 and 2, rank 1 layers 1 and 3), the same body and oracle as one stage per rank."""
    for rank, result in enumerate(_job(tmp_path, schedule, 4, 2)):
        for case in _ALL:
            assert result.get(case) == "ok", f"rank {rank} {case}:\n{result.get(case)}"


def test_edit_across_stages_of_one_rank_raises(tmp_path):
    """Interleaved: layers[0] and layers[2] run on rank 0 (stages 0 and 2). An edit of layers[2]
    built from layers[0]'s value would send stage 2's gradient into stage 0's graph, which the
    schedule then backpropagates a second time; distgrad refuses it with its own message on
    every rank (as for a value received from another rank)."""
    for rank, result in enumerate(_job(tmp_path, "interleaved", 4, 2, cases="cross_grad")):
        assert result.get("case_cross_grad") == "ok", f"rank {rank}:\n{result}"


def test_unsupported_schedules_and_placements_are_refused_at_wrap(tmp_path):
    for rank, result in enumerate(_job(tmp_path, "interleaved", 4, 2, cases="refused")):
        assert result.get("case_refused") == "ok", f"rank {rank}:\n{result}"


def test_values_larger_than_one_message(tmp_path):
    """[4, 2048] fp32 values (32 KiB): a bundle of two of them (stage 0's outputs for stage 1)
    is longer than a first message carries and sends the rest in a second one."""
    for rank, result in enumerate(_job(tmp_path, "1f1b", 2, 2, width=2048)):
        for case in _ALL:
            assert result.get(case) == "ok", f"rank {rank} {case}:\n{result.get(case)}"


def test_stages_from_the_pipeline_frontend(tmp_path):
    """Stages built by pipeline() are traced copies of the model's modules, found by path."""
    for rank, result in enumerate(_job(tmp_path, "gpipe", 2, 2, split="frontend")):
        for case in _ALL:
            assert result.get(case) == "ok", f"rank {rank} {case}:\n{result.get(case)}"


@pytest.mark.slow
def test_two_stages_per_rank_on_four_ranks(tmp_path):
    """ScheduleInterleaved1F1B over 8 one-block stages on 4 ranks: values of stages that are
    not neighbours (rank 3 takes stage 0's layers[0] at its stage 3) travel in messages of their
    own, not on the schedule's."""
    for rank, result in enumerate(_job(tmp_path, "interleaved", 4, 4)):
        for case in _ALL:
            assert result.get(case) == "ok", f"rank {rank} {case}:\n{result.get(case)}"


@pytest.mark.slow
def test_four_stages_on_four_ranks(tmp_path):
    for rank, result in enumerate(_job(tmp_path, "1f1b", 4, 4)):
        for case in _ALL:
            assert result.get(case) == "ok", f"rank {rank} {case}:\n{result.get(case)}"


@pytest.mark.slow
def test_rank_dependent_request_to_a_far_stage_raises(tmp_path):
    """Four stages; only rank 2 asks for a value of stage 0, which is not its neighbour, so the
    bundle would be a message of its own (not on the schedule's). Stage 0 never sends it and
    waits in the schedule; rank 2 asks where stage 0 is after one failure timeout, learns the
    bundle went without the value and raises; every other rank hears of it."""
    for rank, result in enumerate(_job(tmp_path, "1f1b", 4, 4, cases="rank_dependent_far")):
        assert result.get("case_rank_dependent_far") == "ok", (
            f"rank {rank}:\n{result.get('case_rank_dependent_far')}"
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_late_forward_read_raises_instead_of_hanging(schedule, tmp_path):
    for rank, result in enumerate(_job(tmp_path, schedule, 2, 2, cases="late_read")):
        assert result.get("case_late_read") == "ok", f"rank {rank}:\n{result.get('case_late_read')}"


@pytest.mark.parametrize(
    "case",
    [
        "after_loss",
        "grad_order",
        "cross_grad",
        "rank_dependent",
        "rank_dependent_grad",
        "inputs_refused",
    ],
)
def test_order_errors_raise_instead_of_hanging(case, tmp_path):
    """A forward value after tr.loss (every rank raises); gradients of one stage in forward order
    (the rank missing the second raises, its owner hears of it); an edit whose gradient would
    have to flow back to an earlier stage (that stage raises, the other hears of it); bodies
    that ask for different values on different ranks (a value sent that nobody receives, a
    gradient waited for that its owner never asked for); `.inputs`, (args, kwargs), which
    cannot cross stages (every rank raises, pointing to `.input`)."""
    for rank, result in enumerate(_job(tmp_path, "1f1b", 2, 2, cases=case)):
        assert result.get(f"case_{case}") == "ok", f"rank {rank}:\n{result.get(f'case_{case}')}"


def test_slow_stage_is_waited_for(tmp_path):
    """Stage 0 ends its step 1.5 failure timeouts after the last stage, which waits for stage
    0's gradient all that time: the wait goes on (it is not a failure) and the value is right.
    A timed gloo receive would have closed the group's connections when it expired."""
    for rank, result in enumerate(_job(tmp_path, "1f1b", 2, 2, cases="slow_owner")):
        assert result.get("case_slow_owner") == "ok", (
            f"rank {rank}:\n{result.get('case_slow_owner')}"
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_killed_stage_is_reported(schedule, tmp_path):
    """The last stage is SIGKILLed inside its body; the first stage raises RankFailedError
    ("stopped answering") instead of hanging, and exits normally."""
    procs = run_ranks(
        [
            JOB,
            "--schedule",
            schedule,
            "--microbatches",
            "2",
            "--cases",
            "killed",
            "--out",
            str(tmp_path),
        ],
        2,
    )
    assert procs[1].returncode == -9  # the rank really died
    assert procs[0].returncode == 0, procs[0].stdout[-3000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result.get("case_killed") == "ok", result


def test_failure_on_one_stage_reaches_all(tmp_path):
    for rank, result in enumerate(_job(tmp_path, "1f1b", 2, 2, cases="failure")):
        assert result.get("case_failure") == "ok", f"rank {rank}:\n{result.get('case_failure')}"


@pytest.mark.parametrize("microbatches", [2, 4])
def test_deepspeed_pipeline_engine(microbatches, tmp_path, mode="auto"):
    """DeepSpeed's PipelineModule under engine.train_batch(): the same body, the same numbers,
    and train_batch's optimizer step applied to the edited gradients; distgrad.flow's norms
    over two train_batch steps against plain autograd (rtol 1e-5), nothing left behind; its
    refusal under bf16 on every rank."""
    job = str(Path(__file__).parent / "dist" / "ds_pipe_job.py")
    procs = run_ranks(
        [job, "--microbatches", str(microbatches), "--out", str(tmp_path), "--backward-mode", mode],
        2,
    )
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result.get("case_train_batch") == "ok", f"rank {rank}:\n{result}"
        assert result.get("case_flow") == "ok", f"rank {rank}:\n{result}"
        assert result.get("case_flow_refused_in_bf16") == "ok", f"rank {rank}:\n{result}"


def test_deepspeed_pipeline_engine_under_zero1(tmp_path):
    """The same under ZeRO-1, whose optimizer keeps the reduced gradients in its flat partition
    (each parameter's .grad is None): distgrad.flow reads them there."""
    job = str(Path(__file__).parent / "dist" / "ds_pipe_job.py")
    procs = run_ranks([job, "--microbatches", "2", "--out", str(tmp_path), "--zero", "1"], 2)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result.get("case_train_batch") == "ok", f"rank {rank}:\n{result}"
        assert result.get("case_flow") == "ok", f"rank {rank}:\n{result}"


def test_deepspeed_pipeline_engine_in_a_worker_thread(tmp_path):
    """The same with train_batch in a worker thread, as when CUDA is in use."""
    test_deepspeed_pipeline_engine(2, tmp_path, mode="thread")


def test_deepspeed_pipeline_rank_dependent_request_raises(tmp_path):
    """Only the last stage asks for a stage-0 value, and DeepSpeed's messages carry no bundle of
    distgrad's: the last stage waits for one that never comes while stage 0 waits in
    train_batch for it. It asks where stage 0 is after one failure timeout (3 s), learns that
    the bundle went without the value, and raises TraceStateError; stage 0 hears of it. (Before,
    both waited for gloo's 30-minute timeout.)"""
    job = str(Path(__file__).parent / "dist" / "ds_pipe_job.py")
    procs = run_ranks(
        [job, "--microbatches", "2", "--out", str(tmp_path), "--cases", "rank_dependent"],
        2,
        timeout=120,
    )
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result.get("case_rank_dependent") == "ok", f"rank {rank}:\n{result}"


def test_values_keep_dtype_shape_and_bytes_between_stages():
    """The byte format values cross stages in (engines/pipeline/messages.py), one process: each
    value comes back with its dtype, shape, bytes and requires_grad, whichever path it took
    (contiguous host tensors: their bytes where they lie, a storage offset included; strided
    ones: numpy's; conjugate and negative views: the general one), and as a tensor of its own,
    not a view of the bundle's reused buffer."""
    import torch

    from distgrad.engines.pipeline.messages import _entry, _pack, _values

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    cplx = torch.randn(2, 3, dtype=torch.complex64, generator=g)
    sent = [
        base,
        base[1:],
        base.t(),
        base[:, ::2],
        torch.tensor(2.5),
        torch.zeros(0, 4),
        base.to(torch.bfloat16),
        base.to(torch.float16),
        base > 0,
        torch.arange(7),
        cplx.conj(),
        cplx.conj().imag,  # conjugate and negative views
        (base * 1).requires_grad_(True),
    ]
    assert sent[11].is_neg() and sent[1].storage_offset() > 0
    bundle = _pack([_entry(t, tag) for tag, t in enumerate(sent)])
    view = memoryview(bundle)
    got = _values(view, len(sent), torch.device("cpu"))
    assert [tag for tag, _ in got] == list(range(len(sent)))
    for (_, value), original in zip(got, sent):
        assert value.dtype == original.dtype and value.shape == original.shape
        assert torch.equal(value.detach(), original.detach().resolve_conj())
        assert value.requires_grad == original.requires_grad
        if value.requires_grad:
            assert value.grad_fn is not None  # a non-leaf: the body may edit it in place
    bundle[:] = bytes(len(bundle))  # the receive buffer is reused for the next bundle
    for (_, value), original in zip(got, sent):
        assert torch.equal(value.detach(), original.detach().resolve_conj())
