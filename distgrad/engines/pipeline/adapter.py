"""What a traced pipeline step (``schedule_run.py``) asks of the engine that runs the pipeline:
``PipelineAdapter``, the base of both pipeline engines (``engine.py``: a
torch.distributed.pipelining schedule; ``deepspeed_pipe.py``: DeepSpeed's pipeline engine).

The run and the objects it builds read the engine only through what this class declares, so
data flows one way: an engine builds a ``ScheduleRun`` and hands it itself, as an adapter.
Here too is what both engines share: the placement of stages on ranks, learned from every rank
when the engine is built, and the whole model's modules found on this rank's stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...torch_internals import pytree
from ..ranks import DistributedEngine
from ..ranks.beside import label, params_beside
from .placement import Placement


class PipelineAdapter(DistributedEngine):
    """A pipeline runtime as distgrad's schedule run uses it. A subclass sets up its runtime,
    then calls ``PipelineAdapter.__init__`` with its stages' modules and indices; it defines
    ``microbatches``, ``run_step`` and ``instrument``, and may define ``can_piggyback`` and
    ``piggyback`` (by default no bundle rides on the runtime's messages).

    Attributes the run reads: ``placement`` (``placement.py``); ``channel``, distgrad's own gloo
    group for the bundles; ``device``, where this rank's stages compute (received values go
    there); ``piggyback_buffers``, receive buffers kept across steps (``messages.py``); and from
    ``DistributedEngine``: ``job_rank``, ``job_world``, ``store``, ``running`` (the trace's
    number, in the keys of the job's store), ``answering`` (what the failure watcher asks where
    the rank is) and ``check_failure()``."""

    captures_body = True  # the trace body runs once per microbatch

    def __init__(
        self, full_model: torch.nn.Module, submods: list, stage_indices: list, num_stages: int
    ):
        if full_model is None:
            raise TypeError(
                "distgrad.wrap(pipeline, full_model=net): pass the whole model (it "
                "may be on the meta device) so that the body can use its paths."
            )
        super().__init__(full_model, group=dist.group.WORLD, gather=False)
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
        table = [None] * self.job_world
        dist.all_gather_object(table, (names_of, self.can_piggyback()))
        self.stage_of_name = {n: s for ns, _ in table for s, names in ns.items() for n in names}
        stages_of_rank = {r: sorted(ns) for r, (ns, _) in enumerate(table)}
        can_piggyback = {r: can for r, (_, can) in enumerate(table)}
        self.placement = Placement(self.job_rank, stages_of_rank, num_stages, can_piggyback)
        # The placement is checked here, from the table every rank holds, so that every rank
        # raises alike: a rank refusing before the all_gather would leave the others in it.
        refusal = self.placement.refusal()
        if refusal is not None:
            self.failure_watcher.stop()  # nothing left behind: the failure watcher's thread ends
            raise NotImplementedError(refusal)
        # (action, stage, microbatch) -> a receive buffer with room for a bundle (messages.py)
        self.piggyback_buffers: dict = {}
        self.names = {id(m): n for n, m in full_model.named_modules()}
        self.channel = dist.new_group(backend="gloo")  # distgrad's own sends and receives
        self.submods = submods  # (engine_params: the stages' parameters)

    # -- what each runtime defines ----------------------------------------------------------
    def microbatches(self) -> int:
        """The number of microbatches one step runs."""
        raise NotImplementedError

    def run_step(self, args: tuple, kwargs: dict):
        """Run one step of the runtime on the trace's inputs (``model.trace(*args, **kwargs)``)."""
        raise NotImplementedError

    def instrument(self, on_action, on_loss):
        """Wrap each action of this rank's stages in ``with on_action(phase, stage,
        microbatch):`` (``phase`` "F" or "B": the forward or backward of ``microbatch`` on
        ``stage``), and call ``on_loss(microbatch, loss)`` once the last stage has a
        microbatch's loss. Returns a function that undoes it."""
        raise NotImplementedError

    def can_piggyback(self) -> bool:
        """Whether this rank's schedule messages can carry bundles (asked once, when the engine
        is built; a link piggybacks only where both of its ranks can)."""
        return False

    def piggyback(self, messages):
        """Make the schedule's messages on the links ``placement`` names carry ``messages``'s
        bundles (``Messages.outgoing``, ``Messages.incoming``). Returns the undo, or None where
        no link piggybacks (the default: none does)."""

    def refuse_beside(self, output, stage: int) -> None:
        """After a forward action of ``stage``: raise where the body brought a parameter beside
        the model into it (``ranks/beside.py``). Its gradient would be this stage's rank's
        alone, summed over the microbatches, where the stages' are averaged over them."""
        roots = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        found = params_beside(roots, self.owned)
        if found:
            raise NotImplementedError(
                f"a trace body brought a parameter beside the model ({label(found[0])}) into "
                f"stage {stage}'s forward under a pipeline schedule: its gradient would be "
                f"this rank's alone, summed over the microbatches (the schedule scales only "
                f"the stages' own gradients), and distgrad does not combine it across stages. "
                f"Register it on a module of the stage that uses it (the schedule then treats "
                f"it as the stage's own), or mark it with distgrad.keep_rank_local(param) and "
                f"divide and share its gradient yourself."
            )

    def engine_params(self) -> list:
        # the stages' parameters too: copies of the whole model's under the pipeline() frontend
        return super().engine_params() + [p for sub in self.submods for p in sub.parameters()]

    # -- the whole model's modules on this rank's stages ------------------------------------
    @property
    def root(self):
        return self.full

    def stage_of(self, module) -> int | None:
        """The stage that runs ``module`` (of the whole model), or None: no stage runs it
        itself (a container, or the whole model)."""
        return self.stage_of_name.get(self.names.get(id(module)))

    def owns(self, module) -> bool:
        return self.stage_of(module) in self.placement.my_stages

    def module_here(self, module):
        return self.local.get(id(module)) if self.owns(module) else None

    def stage_module(self, module):
        """The module a stage of this rank runs for ``module`` of the whole model, which it
        owns: the same object, or its copy under the same path (the ``pipeline()`` frontend)."""
        return self.local[id(module)]

    def grad_pieces(self, module):
        # one stage runs a module: its gradients are on that rank alone
        return [(p.grad, 1) for p in module.parameters() if p.grad is not None]
