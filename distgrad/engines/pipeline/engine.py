"""Pipeline parallel: a ``torch.distributed.pipelining`` schedule, one or more stages per rank.

    stage = PipelineStage(my_blocks, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    model = distgrad.wrap(schedule, full_model=net)      # net: the whole model, for its paths
    with model.trace(x, target=y) as tr:
        h = model.layers[1].output.save()                # whichever stage runs layers[1]
        with tr.loss.backward():                         # the schedule's backward of this microbatch
            g = h.grad.save()
            h.grad = h.grad * 2

The trace runs ``schedule.step`` (inputs on the first stage, target and losses on the last), and
the body runs once per microbatch on every rank, like an invoke: its source is captured
(``capture.py``) and each microbatch's copy runs as a coroutine of the step. Saved names are the
microbatches' values concatenated on dim 0, on every rank.

A value of a module another stage runs is the real value, sent by its owner: every rank runs the
same body, so the owner serves the same request and sends what it got to every other rank, in one
message per receiving rank and moment below (``messages.py``). The receiver takes it
only at a moment when the owner has certainly sent it, which makes waiting safe in every schedule:

* a forward value of an earlier stage: at the start of the forward of the microbatch on this
  rank's first stage after it (which needed the earlier stage's output, so its hooks had fired);
* a forward value or gradient of a later stage: at the start of the backward of the microbatch
  on this rank's last stage before it (which needed the later stage's gradient);
* a gradient of a stage after all of this rank's: when this rank's step has finished.

Batches are named by that moment of the receiver, ``(phase, receiving stage, microbatch)`` or
``"end"`` (``requests.moment``). With the round-robin placement of interleaved and looped
schedules each rank has one stage between any two of another rank's, so a batch has one
sending stage, and between neighbouring stages it rides on the schedule's own message.

``with tr.loss.backward():`` uses the loss only to open the block, so there no rank waits for it
and none sends it (``requests.only_opens_block``).

An assignment to another stage's value is applied by its owner (which runs the same line); other
ranks keep it in their copy only. A value read back after an assignment is what the owner's read
returns, sent again; a value read again with no assignment is the same tensor on every rank, so
in-place edits show alike (``BodyRequests.module_value``). ``.input`` sends the call's first
argument; ``.inputs`` (args and kwargs) cannot cross stages and raises on every rank. A received value is a tensor of its own: an edit on one stage
built from an earlier stage's value would need a gradient sent back to that stage, which is not
done; the receiving stage detects that its backward reached the copy and raises
(``PipelineRun._check_earlier``), so no stage is left with gradients unlike one process's.

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

from ...torch_internals import (replace_schedule_loss_step, restore_schedule_loss_step,
                               schedule_last_loss, schedule_loss_step, schedule_microbatches,
                               schedule_stages)
from ..ranks import DistributedEngine
from .run import PipelineRun


class PipelineEngine(DistributedEngine):
    """A ``torch.distributed.pipelining`` schedule, wrapped with the whole model
    (``full_model``) for its paths: the trace body runs once per microbatch on every rank
    (see the module text and docs/engines/pipeline.md)."""
    name = "pipeline"
    captures_body = True  # the trace body runs once per microbatch

    def __init__(self, schedule, full_model: torch.nn.Module):
        stages = schedule_stages(schedule)
        if not stages:
            raise NotImplementedError(f"distgrad.wrap({type(schedule).__name__}): a schedule "
                                      f"with no pipeline stage is not supported.")
        _refuse_split_backward(schedule, stages)
        self.schedule, self.stages = schedule, list(stages)
        self.stage = self.stages[0]
        self._setup(full_model, [st.submod for st in stages], [st.stage_index for st in stages],
                    stages[0].num_stages)

    def _setup(self, full_model, submods: list, stage_indices: list, num_stages: int) -> None:
        if full_model is None:
            raise TypeError("distgrad.wrap(pipeline, full_model=net): pass the whole model (it "
                            "may be on the meta device) so that the body can use its paths.")
        mine = sorted(stage_indices)
        super().__init__(full_model, group=dist.group.WORLD, gather=False)
        world = self.job_world
        self.full = full_model
        # values received from other stages are placed where this stage's parameters live
        first = next((p for m in submods for p in m.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        # This rank's modules, as the whole model names them: the very objects after a manual
        # split; copies under the same names after the pipeline() frontend (which traces the
        # model into new modules but keeps the paths)
        ids = {id(m) for sub in submods for m in sub.modules()}
        self.local = {id(m): m for m in full_model.modules() if id(m) in ids}
        names_of = {}  # stage -> the whole model's names of the modules it runs
        full = dict(full_model.named_modules())
        for sub, index in zip(submods, stage_indices):
            here = {id(m) for m in sub.modules()}
            found = [n for n, m in full.items() if id(m) in here]
            if not found:  # id(module of full_model) -> the module this stage runs
                by_name = dict(sub.named_modules())
                found = [n for n in by_name if n and n in full]
                self.local.update({id(full[n]): by_name[n] for n in found})
            names_of[index] = found
        table = [None] * world
        dist.all_gather_object(table, (names_of, self._can_carry()))
        self.stage_of_name = {n: s for ns, _ in table for s, names in ns.items() for n in names}
        self.rank_of_stage = {s: r for r, (ns, _) in enumerate(table) for s in ns}
        self.stages_of_rank = {r: sorted(ns) for r, (ns, _) in enumerate(table)}
        # The placement is checked here, from the table every rank holds, so that every rank
        # raises alike: a rank refusing before the all_gather would leave the others in it.
        refusal = _placement_refusal(self.stages_of_rank, num_stages)
        if refusal is not None:
            self._watch.stop()  # nothing left behind: the failure watcher's thread ends
            raise NotImplementedError(refusal)
        # Neighbours whose own activation messages also carry distgrad's values (carry()), per
        # stage of this rank; decided from every rank's answer, so both ends of a link agree.
        can = {r: c for r, (_, c) in enumerate(table)}
        rank = self.job_rank
        self.carry_to, self.carry_from = {}, {}
        for s in mine:
            for other, links in ((s + 1, self.carry_to), (s - 1, self.carry_from)):
                peer = self.rank_of_stage.get(other)
                if peer is not None and can[rank] and can[peer]:
                    links[s] = peer
        self.carry_room: dict = {}  # (phase, stage, microbatch) -> a receive buffer with room
        # (microbatch, forward, stage) -> {rank: batch key}: fixed by the placement, so kept
        # across traces (PipelineRun._keys)
        self.batch_keys: dict = {}
        self.my_moments: dict = {}  # (stage, microbatch, forward) -> moment(), for receiving
        self.names = {id(m): n for n, m in full_model.named_modules()}
        self.my_stages = tuple(mine)
        self.last_stage = num_stages - 1
        self.channel = dist.new_group(backend="gloo")  # distgrad's own sends and receives

    # -- what differs between pipeline runtimes ---------------------------------------------
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

    def instrument(self, on_chunk, on_loss):
        """Call ``on_chunk(phase, stage, microbatch)`` as each chunk starts ("F"/"B") and
        ``on_loss(microbatch, loss)`` when the last stage has a microbatch's loss. Returns
        a function that undoes it."""
        schedule, loss = self.schedule, schedule_loss_step(self.schedule)

        def chunk(phase, index, real):
            def run(chunk_id, *args, **kwargs):
                with on_chunk(phase, index, chunk_id):
                    return real(chunk_id, *args, **kwargs)
            return run

        def compute_loss(st, output, target_mbs, mb_index, *args, **kwargs):
            loss(st, output, target_mbs, mb_index, *args, **kwargs)
            if st.is_last:
                on_loss(mb_index, schedule_last_loss(schedule))

        for stage in self.stages:
            stage.forward_one_chunk = chunk("F", stage.stage_index, stage.forward_one_chunk)
            stage.backward_one_chunk = chunk("B", stage.stage_index, stage.backward_one_chunk)
        replace_schedule_loss_step(schedule, compute_loss)

        def restore():
            for stage in self.stages:
                for name in ("forward_one_chunk", "backward_one_chunk"):
                    stage.__dict__.pop(name, None)
            restore_schedule_loss_step(schedule)
        return restore

    def _can_carry(self) -> bool:
        """Whether this rank's activation messages can carry distgrad's bytes: host tensors on
        a gloo group (the values are packed in host memory)."""
        group = self.stage.group or dist.group.WORLD
        return self.device.type == "cpu" and dist.get_backend(group) == "gloo"

    def carry(self, messages):
        """Make the schedule's messages between neighbouring stages carry distgrad's values for
        the receiving stage and microbatch: activations to the next stage, input gradients to
        the previous one (``messages.outgoing``; receives get room for them,
        ``messages.incoming``). A value then costs no message of its own, and a batch always
        arrives. Returns the undo, or None where no link carries."""
        if not self.carry_to and not self.carry_from:
            return None
        patched = []

        def sends(stage, name, phase):
            real, index = getattr(stage, name), stage.stage_index
            setattr(stage, name, lambda chunk: messages.outgoing(phase, index, chunk, real(chunk)))
            patched.append((stage, name))

        def receives(stage, name, phase, records):  # records: the stage's {chunk: receive records}
            real, index = getattr(stage, name), stage.stage_index
            setattr(stage, name, lambda chunk: messages.incoming(
                phase, index, chunk, real(chunk), getattr(stage, records).get(chunk, ())))
            patched.append((stage, name))
        for stage in self.stages:
            if stage.stage_index in self.carry_to:  # activations out, gradients in
                sends(stage, "get_fwd_send_ops", "F")
                receives(stage, "get_bwd_recv_ops", "B", "grad_recv_info")
            if stage.stage_index in self.carry_from:  # activations in, gradients out
                receives(stage, "get_fwd_recv_ops", "F", "args_recv_info")
                sends(stage, "get_bwd_send_ops", "B")

        def restore():
            messages.give_back()
            for stage, name in patched:
                stage.__dict__.pop(name, None)
        return restore

    @property
    def root(self):
        return self.full

    def stage_of(self, module) -> int | None:
        return self.stage_of_name.get(self.names.get(id(module)))

    def owns(self, module) -> bool:
        return self.stage_of(module) in self.my_stages

    def module_here(self, module):
        return self.local.get(id(module)) if self.owns(module) else None

    def grad_pieces(self, module):
        # one stage runs a module: its gradients are on that rank alone
        return [(p.grad, 1) for p in module.parameters() if p.grad is not None]

    def run_captured(self, trace, code, names, frame) -> None:
        PipelineRun(self, trace).run(code, names, frame)


def _placement_refusal(stages_of_rank: dict, num_stages: int) -> str | None:
    """Why distgrad cannot run this placement of stages on ranks, or None."""
    world = len(stages_of_rank)
    counts = {len(s) for s in stages_of_rank.values()}
    if len(counts) > 1:
        return (f"distgrad.wrap: distgrad runs pipelines with the same number of stages on "
                f"every rank: {num_stages} stages on {world} ranks, placed {stages_of_rank} "
                f"(rank: its stages).")
    if counts.pop() * world != num_stages:
        return (f"distgrad.wrap: distgrad runs one pipeline over all the job's ranks, each stage "
                f"on one rank; here {world} ranks run {num_stages} stages, placed "
                f"{stages_of_rank} (rank: its stages). Pipelines replicated for data "
                f"parallelism are not supported.")
    for rank, mine in stages_of_rank.items():
        if any(b == a + 1 for a, b in zip(mine, mine[1:])):
            return (f"distgrad.wrap: stages {mine} run on rank {rank}, two of them neighbours "
                    f"(a V-shaped schedule); distgrad supports schedules whose neighbouring "
                    f"stages are on different ranks (GPipe, 1F1B, Interleaved1F1B, LoopedBFS).")
    if num_stages > world and any(r != s % world
                                  for r, mine in stages_of_rank.items() for s in mine):
        return (f"distgrad.wrap: with several stages per rank distgrad needs them placed round "
                f"robin (stage s on rank s % {world}, as ScheduleInterleaved1F1B and "
                f"ScheduleLoopedBFS do), so that one rank's stage lies between any two of "
                f"another's; here: {stages_of_rank} (rank: its stages).")
    return None


def _refuse_split_backward(schedule, stages) -> None:
    """Zero-bubble schedules split each backward in two (input, then weights), which the
    chunk events here do not model."""
    order = getattr(schedule, "pipeline_order", None) or {}
    kinds = {getattr(a.computation_type, "value", a.computation_type)
             for actions in order.values() for a in actions or () if a is not None}
    if kinds & {"I", "W"}:
        raise NotImplementedError(
            f"distgrad.wrap({type(schedule).__name__}): schedules that split the backward into "
            f"input and weight parts (zero-bubble) are not supported; use ScheduleGPipe, "
            f"Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS.")
