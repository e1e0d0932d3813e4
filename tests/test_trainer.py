"""Hugging Face Trainer traced by ``distgrad.trainer.TracedTrainer``, on one process and on 2
DDP ranks (gloo, CPU): tests/dist/trainer_job.py.

* 3 optimizer steps, gradient accumulation 1 and 2 (with the loss normalised over the
  accumulated tokens, and with label smoothing), bf16 autocast, gradient checkpointing with a
  forward edit inside the checkpointed block; an intervention
  that saves and doubles the gradient reaching the first block: the parameters equal those of
  a plain Trainer whose raw hook doubles that gradient, the saved gradients and ``tr.loss``
  equal what the hook saw and what ``training_step`` returned (rank 0: every rank's rows),
  one record per micro-batch with its step and micro-batch index (atol 1e-5);
* an intervention with a forward edit and no backward block: the Trainer's backward still
  runs once per step (parameters equal the raw-hook run's); ``on_step`` gets the records;
* on 2 ranks, Trainer's DeepSpeed integration (ZeRO-1 and ZeRO-3, accumulation 2): the same
  parity (ZeRO-3's parameters gathered to compare);
* a backward block on another tensor raises, naming ``tr.loss``, on every rank, and leaves
  accelerate's ``backward`` unpatched.
"""

import sys
from pathlib import Path

import pytest
import transformers  # noqa: F401 (a test dependency: missing, it fails here, not skips)

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from launch import case_report, read_results, run_ranks  # noqa: E402

JOB = str(Path(__file__).parent / "dist" / "trainer_job.py")
CASES = [
    "case_gradient_edit_without_accumulation",
    "case_gradient_edit_with_accumulation",
    "case_gradient_edit_with_accumulation_and_label_smoothing",
    "case_bf16_autocast",
    "case_gradient_checkpointing",
    "case_lora_adapters",
    "case_forward_edit_without_block",
    "case_block_on_another_tensor_raises",
]
DEEPSPEED_CASES = ["case_deepspeed_zero1", "case_deepspeed_zero3"]


@pytest.fixture(scope="module", params=[1, 2], ids=["one_process", "two_ranks"])
def job(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"trainer-{world}")
    procs = run_ranks([JOB, "--out", str(out)], world)
    return world, procs, read_results(out, world)


@pytest.mark.parametrize("case", CASES + DEEPSPEED_CASES)
def test_traced_trainer_case(job, case):
    world, procs, results = job
    if case in DEEPSPEED_CASES and world == 1:
        pytest.skip("DeepSpeed's engine needs a process group: its cases run on 2 ranks")
    report = case_report(procs, results, case)
    assert not report, f"{case}:\n{report}"
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
