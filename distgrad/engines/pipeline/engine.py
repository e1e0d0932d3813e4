"""Pipeline parallel: a ``torch.distributed.pipelining`` schedule, one or more stages per rank.

    stage = PipelineStage(my_blocks, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    model = distgrad.wrap(schedule, full_model=net)      # net: the whole model, for its paths
    with model.trace(x, target=y) as tr:
        h = model.layers[1].output.save()                # whichever stage runs layers[1]
        with tr.loss.backward():                         # this microbatch's backward
            g = h.grad.save()
            h.grad = h.grad * 2

The trace runs ``schedule.step`` (inputs on the first stage, target and losses on the last), and
the body runs once per microbatch on every rank, like an invoke: its source is captured
(``capture.py``) and each microbatch's copy runs as a coroutine of the step
(``schedule_run.py``). Saved names are the microbatches' values concatenated on dim 0, on every
rank.

A value of a module another stage runs is the real value, sent by its owner: every rank runs the
same body, so the owner serves the same request and sends what it got to every other rank, in one
bundle per receiving rank and action (``messages.py``), taken by the receiver at an action of its
own that the owner's sending certainly came before (``placement.py``). ``with
tr.loss.backward():`` uses the loss only to open the block, so there no rank waits for it and
none sends it (``body_requests.only_opens_block``).

An assignment to another stage's value is applied by its owner (which runs the same line); other
ranks keep it in their copy only. A value read back after an assignment is what the owner's read
returns, sent again; a value read again with no assignment is the same tensor on every rank, so
in-place edits show alike (``BodyRequests.module_value``). ``.input`` sends the call's first
argument; ``.inputs`` (args and kwargs) cannot cross stages and raises on every rank. A received
value is a tensor of its own: an edit on one stage built from an earlier stage's value would
need a gradient sent back to that stage, which is not done; the receiving stage detects that its
backward reached the copy and raises (``ValueStages.check_reach``), so no stage is left with
gradients unlike one process's.

Requests go in pipeline order - forward values by non-decreasing stage, gradients by
non-increasing stage - and a request against that order raises ``OutOfOrderError`` on the ranks
whose body reaches it; within one stage, only the owner can tell, when its forward of the
microbatch ends. Every other rank learns of it as of any failure: a receive waits at most
``config.failure_timeout`` seconds between checks of the job's failure key, and raises
``RankFailedError`` once the owner has posted it.

Gradients: torch's schedules backpropagate each microbatch's loss unscaled and divide the
parameter gradients by the number of microbatches afterwards (``scale_grads``), so the body sees
the gradient of its own microbatch's loss, as a data-parallel rank sees its own rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...torch_internals import (
    replace_schedule_loss_step,
    restore_schedule_loss_step,
    schedule_last_loss,
    schedule_loss_step,
    schedule_microbatches,
    schedule_stages,
)
from .adapter import PipelineAdapter
from .schedule_run import ScheduleRun


class PipelineEngine(PipelineAdapter):
    """A ``torch.distributed.pipelining`` schedule, wrapped with the whole model
    (``full_model``) for its paths: the trace body runs once per microbatch on every rank
    (see the module text and docs/engines/pipeline.md)."""

    name = "pipeline"

    def __init__(self, schedule, full_model: torch.nn.Module):
        stages = schedule_stages(schedule)
        if not stages:
            raise NotImplementedError(
                f"distgrad.wrap({type(schedule).__name__}): a schedule "
                f"with no pipeline stage is not supported."
            )
        _refuse_split_backward(schedule, stages)
        self.schedule, self.stages = schedule, list(stages)
        self.stage = self.stages[0]
        super().__init__(
            full_model,
            [st.submod for st in stages],
            [st.stage_index for st in stages],
            stages[0].num_stages,
        )

    def microbatches(self) -> int:
        return schedule_microbatches(self.schedule)

    def run_step(self, args: tuple, kwargs: dict):
        """One step of the schedule: inputs on the first stage, target and losses on the last."""
        stages, schedule = self.stages, self.schedule
        kwargs = dict(kwargs)
        target, losses = kwargs.pop("target", None), kwargs.pop("losses", None)
        step_args = args if any(st.is_first for st in stages) else ()
        if any(st.is_last for st in stages):
            return schedule.step(*step_args, target=target, losses=losses, **kwargs)
        return schedule.step(*step_args, **kwargs)

    def instrument(self, on_action, on_loss):
        """Wrap each stage's ``forward_one_chunk`` and ``backward_one_chunk`` (one action, its
        ``chunk_id`` the microbatch) in ``on_action``, and the schedule's loss step in a call of
        ``on_loss`` on the last stage."""
        schedule, loss = self.schedule, schedule_loss_step(self.schedule)

        def wrapped(phase, index, real):
            def run(chunk_id, *args, **kwargs):
                with on_action(phase, index, chunk_id):
                    output = real(chunk_id, *args, **kwargs)
                    if phase == "F":
                        self.refuse_beside(output, index)
                    return output

            return run

        def compute_loss(st, output, target_mbs, mb_index, *args, **kwargs):
            loss(st, output, target_mbs, mb_index, *args, **kwargs)
            if st.is_last:
                on_loss(mb_index, schedule_last_loss(schedule))

        for stage in self.stages:
            stage.forward_one_chunk = wrapped("F", stage.stage_index, stage.forward_one_chunk)
            stage.backward_one_chunk = wrapped("B", stage.stage_index, stage.backward_one_chunk)
        replace_schedule_loss_step(schedule, compute_loss)

        def restore():
            for stage in self.stages:
                for name in ("forward_one_chunk", "backward_one_chunk"):
                    stage.__dict__.pop(name, None)
            restore_schedule_loss_step(schedule)

        return restore

    def can_piggyback(self) -> bool:
        """Host tensors on a gloo group: the bundles are packed in host memory."""
        group = self.stage.group or dist.group.WORLD
        return self.device.type == "cpu" and dist.get_backend(group) == "gloo"

    def piggyback(self, messages):
        """Activations to the next stage carry that stage's bundles, input gradients to the
        previous stage carry its bundles (``messages.outgoing``), and the matching receives get
        room for them (``messages.incoming``). A value then costs no message of its own, and a
        piggybacked bundle always arrives."""
        placement = self.placement
        if not placement.piggyback_to and not placement.piggyback_from:
            return None
        patched = []

        def sends(stage, name, phase):
            real, index = getattr(stage, name), stage.stage_index
            setattr(stage, name, lambda chunk: messages.outgoing(phase, index, chunk, real(chunk)))
            patched.append((stage, name))

        def receives(stage, name, phase, records):  # records: the stage's {chunk: receive records}
            real, index = getattr(stage, name), stage.stage_index
            setattr(
                stage,
                name,
                lambda chunk: messages.incoming(
                    phase, index, chunk, real(chunk), getattr(stage, records).get(chunk, ())
                ),
            )
            patched.append((stage, name))

        for stage in self.stages:
            if stage.stage_index in placement.piggyback_to:  # activations out, gradients in
                sends(stage, "get_fwd_send_ops", "F")
                receives(stage, "get_bwd_recv_ops", "B", "grad_recv_info")
            if stage.stage_index in placement.piggyback_from:  # activations in, gradients out
                receives(stage, "get_fwd_recv_ops", "F", "args_recv_info")
                sends(stage, "get_bwd_send_ops", "B")

        def restore():
            messages.give_back()
            for stage, name in patched:
                stage.__dict__.pop(name, None)

        return restore

    def run_captured(self, trace, code, names, frame) -> None:
        ScheduleRun(self, trace).run(code, names, frame)


def _refuse_split_backward(schedule, stages) -> None:
    """Zero-bubble schedules split each backward in two (input, then weights), which the
    action events here do not model."""
    order = getattr(schedule, "pipeline_order", None) or {}
    kinds = {
        getattr(a.computation_type, "value", a.computation_type)
        for actions in order.values()
        for a in actions or ()
        if a is not None
    }
    if kinds & {"I", "W"}:
        raise NotImplementedError(
            f"distgrad.wrap({type(schedule).__name__}): schedules that split the backward into "
            f"input and weight parts (zero-bubble) are not supported; use ScheduleGPipe, "
            f"Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS."
        )
