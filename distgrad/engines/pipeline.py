"""Pipeline parallel: a ``torch.distributed.pipelining`` schedule over one stage per rank.

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
message per receiving rank and moment below (``pipeline_messages.py``). The receiver takes it
only at a moment when the owner has certainly sent it, which makes waiting safe in every schedule:

* a forward value of an earlier stage: at the start of this rank's forward of the microbatch
  (it needed the earlier stage's output, so the earlier stage's hooks had fired);
* a forward value or gradient of a later stage: at the start of this rank's backward of the
  microbatch (it needed the later stage's gradient);
* a gradient of an earlier stage: when this rank's step has finished.

``with tr.loss.backward():`` uses the loss only to open the block, so there no rank waits for it
and none sends it (``only_opens_block``).

An assignment to another stage's value is applied by its owner (which runs the same line); other
ranks keep it in their copy only. A received value is a tensor of its own: an edit on one stage
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

import dis

import torch
import torch.distributed as dist

from ..capture import NotSaved
from .distributed import DistributedEngine


class LossPoint:
    """Where the last stage hands over a microbatch's loss (a point with nothing to remove)."""
    kind = "output"

    def remove(self):
        pass


class PipelineEngine(DistributedEngine):
    name = "pipeline"
    captures_body = True  # the trace body runs once per microbatch

    def __init__(self, schedule, full_model: torch.nn.Module):
        stage = getattr(schedule, "_stage", None)
        if stage is None:
            raise NotImplementedError(
                f"distgrad.wrap({type(schedule).__name__}): only schedules with one stage per "
                "rank (ScheduleGPipe, Schedule1F1B) are supported so far.")
        self.schedule, self.stage = schedule, stage
        self._setup(full_model, stage.submod, stage.stage_index, stage.num_stages)

    def _setup(self, full_model, submod, stage_index: int, num_stages: int) -> None:
        if full_model is None:
            raise TypeError("distgrad.wrap(pipeline, full_model=net): pass the whole model (it "
                            "may be on the meta device) so that the body can use its paths.")
        if dist.is_initialized() and dist.get_world_size() != num_stages:
            raise NotImplementedError(f"distgrad runs pipelines of one stage per rank: {num_stages} "
                                      f"stages on {dist.get_world_size()} ranks.")
        super().__init__(full_model, group=dist.group.WORLD, gather=False)
        self.full = full_model
        # values received from other stages are placed where this stage's parameters live
        first = next(submod.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        # This stage's modules, as the whole model names them: the very objects after a manual
        # split; copies under the same names after the pipeline() frontend (which traces the
        # model into new modules but keeps the paths)
        mine = {id(m) for m in submod.modules()}
        by_name = dict(submod.named_modules())
        self.local = {id(m): m for m in full_model.modules() if id(m) in mine}
        if not self.local:  # id(module of full_model) -> the module this stage runs
            self.local = {id(m): by_name[n] for n, m in full_model.named_modules()
                          if n and n in by_name}
        names = [n for n, m in full_model.named_modules() if id(m) in self.local]
        table = [None] * dist.get_world_size()
        dist.all_gather_object(table, (stage_index, names, self._can_carry()))
        self.stage_of_name = {n: s for s, ns, _ in table for n in ns}
        self.rank_of_stage = {s: r for r, (s, _, _) in enumerate(table)}
        # Neighbours whose own activation messages also carry distgrad's values (carry());
        # decided from every rank's answer, so both ends of a link agree.
        can = {s: c for s, _, c in table}
        self.carry_to = self.rank_of_stage[stage_index + 1] \
            if can[stage_index] and can.get(stage_index + 1) else None
        self.carry_from = self.rank_of_stage[stage_index - 1] \
            if can[stage_index] and can.get(stage_index - 1) else None
        self.carry_room: dict = {}  # (phase, microbatch) -> a receive buffer with room
        self.names = {id(m): n for n, m in full_model.named_modules()}
        self.my_stage = stage_index
        self.last_stage = num_stages - 1
        self.channel = dist.new_group(backend="gloo")  # distgrad's own sends and receives

    # -- what differs between pipeline runtimes ---------------------------------------------
    def microbatches(self) -> int:
        return self.schedule._n_microbatches

    def run_step(self, args: tuple, kwargs: dict):
        """One step of the schedule: inputs on the first stage, target and losses on the last."""
        stage, schedule = self.stage, self.schedule
        kwargs = dict(kwargs)
        target, losses = kwargs.pop("target", None), kwargs.pop("losses", None)
        step_args = args if stage.is_first else ()
        if stage.is_last:
            return schedule.step(*step_args, target=target, losses=losses, **kwargs)
        return schedule.step(*step_args, **kwargs)

    def instrument(self, on_chunk, on_loss):
        """Call ``on_chunk(phase, microbatch)`` as each chunk starts ("F"/"B") and
        ``on_loss(microbatch, loss)`` when the last stage has a microbatch's loss. Returns
        a function that undoes it."""
        stage, schedule = self.stage, self.schedule
        fwd, bwd, loss = stage.forward_one_chunk, stage.backward_one_chunk, schedule._maybe_compute_loss

        def chunk(phase, real):
            def run(chunk_id, *args, **kwargs):
                with on_chunk(phase, chunk_id):
                    return real(chunk_id, *args, **kwargs)
            return run

        def compute_loss(st, output, target_mbs, mb_index, *args, **kwargs):
            loss(st, output, target_mbs, mb_index, *args, **kwargs)
            if st.is_last:
                on_loss(mb_index, schedule._internal_losses[-1])

        stage.forward_one_chunk = chunk("F", fwd)
        stage.backward_one_chunk = chunk("B", bwd)
        schedule._maybe_compute_loss = compute_loss

        def restore():
            for obj, name in ((stage, "forward_one_chunk"), (stage, "backward_one_chunk"),
                              (schedule, "_maybe_compute_loss")):
                obj.__dict__.pop(name, None)
        return restore

    def _can_carry(self) -> bool:
        """Whether this stage's activation messages can carry distgrad's bytes: host tensors on
        a gloo group (the values are packed in host memory)."""
        group = self.stage.group or dist.group.WORLD
        return self.device.type == "cpu" and dist.get_backend(group) == "gloo"

    def carry(self, messages):
        """Make the schedule's messages between neighbouring stages carry distgrad's values for
        the receiving stage and microbatch: activations to the next stage, input gradients to
        the previous one (``messages.outgoing``; receives get room for them,
        ``messages.incoming``). A value then costs no message of its own, and a batch always
        arrives. Returns the undo, or None where no link carries."""
        if self.carry_to is None and self.carry_from is None:
            return None
        stage, names = self.stage, []

        def sends(name, phase):
            real = getattr(stage, name)
            setattr(stage, name, lambda chunk: messages.outgoing(phase, chunk, real(chunk)))
            names.append(name)

        def receives(name, phase, records):  # records: the stage's {chunk: receive records}
            real = getattr(stage, name)
            setattr(stage, name, lambda chunk: messages.incoming(
                phase, chunk, real(chunk), getattr(stage, records).get(chunk, ())))
            names.append(name)
        if self.carry_to is not None:  # activations out, gradients in
            sends("get_fwd_send_ops", "F")
            receives("get_bwd_recv_ops", "B", "grad_recv_info")
        if self.carry_from is not None:  # activations in, gradients out
            receives("get_fwd_recv_ops", "F", "args_recv_info")
            sends("get_bwd_send_ops", "B")

        def restore():
            messages.give_back()
            for name in names:
                stage.__dict__.pop(name, None)
        return restore

    @property
    def root(self):
        return self.full

    def stage_of(self, module) -> int | None:
        return self.stage_of_name.get(self.names.get(id(module)))

    def owns(self, module) -> bool:
        return self.stage_of(module) == self.my_stage

    def run_captured(self, trace, code, names, frame) -> None:
        from .pipeline_run import PipelineRun
        PipelineRun(self, trace).run(code, names, frame)


# -- what a trace's body needs, kept here so that the run reads as the schedule -----------
_SITES: dict = {}  # (code, offset) -> whether `tr.loss` read there only opens a block


def only_opens_block(frame) -> bool:
    """Whether the `.loss` read at ``frame``'s instruction is `with tr.loss.backward():`, with
    no `as`: the loss then goes only to the block, which the body cannot reach."""
    site = (frame.f_code, frame.f_lasti)
    known = _SITES.get(site)
    if known is None:
        ops = [(op.offset, op.opname, op.argval) for op in dis.get_instructions(frame.f_code)
               if op.opname not in ("CACHE", "EXTENDED_ARG", "PRECALL", "NOP")]
        at = [i for i, op in enumerate(ops) if op[0] <= frame.f_lasti][-1:]
        seen = [op[1:] for op in ops[at[0]: at[0] + 5]] if at else []
        known = _SITES[site] = len(seen) == 5 and seen[0] == ("LOAD_ATTR", "loss") and \
            seen[1][0] in ("LOAD_METHOD", "LOAD_ATTR") and seen[1][1] == "backward" and \
            seen[2] == ("CALL", 0) and seen[3][0] in ("BEFORE_WITH", "SETUP_WITH") and \
            seen[4][0] == "POP_TOP"
    return known


def joined(names: list[str], bodies: list, spaces: list[dict]) -> dict:
    """Each saved name: the microbatches' values concatenated on the save's ``dim`` (0 by
    default; 0-dim values are stacked); a list, tuple or dict of saved values comes back joined
    item by item."""
    saved = {id(entry[0]): entry[2] for body in bodies for entry in body.saves}
    out = {}
    for name in names:
        values = [space.get(name, _MISSING) for space in spaces]
        value = _join(values, saved)
        out[name] = value if value is not _MISSING else NotSaved(
            name, "in the body of a pipeline trace (it runs once per microbatch)")
    return out


_MISSING = object()


def _join(values: list, saved: dict):
    first = values[0]
    if isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) and id(v) in saved
                                               for v in values):
        dim = saved[id(first)]
        values = [v.detach() for v in values]
        return torch.stack(values) if first.dim() == 0 else torch.cat(values, dim=dim)
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) and len(v) == len(first)
                                                for v in values):
        items = [_join([v[i] for v in values], saved) for i in range(len(first))]
        return _MISSING if any(i is _MISSING for i in items) else type(first)(items)
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys()
                                       for v in values):
        if all(id(v) in saved for v in values):  # distgrad.save(a_dict): its tensors, joined
            saved = {**saved, **{id(t): saved[id(v)] for v in values for t in v.values()}}
        items = {k: _join([v[k] for v in values], saved) for k in first}
        return _MISSING if any(i is _MISSING for i in items.values()) else items
    return _MISSING
