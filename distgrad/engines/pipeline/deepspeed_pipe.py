"""DeepSpeed's pipeline engine: a ``PipelineModule`` run by ``engine.train_batch()``.

    pipe = PipelineModule(layers=blocks, num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=opt, config=cfg)
    model = distgrad.wrap(engine, full_model=nn.Sequential(*blocks))
    with model.trace(microbatches) as tr:        # a list of (inputs, labels), one per microbatch
        h = model[1].output.save()
        with tr.loss.backward():
            g = h.grad.save()
            h.grad = h.grad * 2

Everything but how the step runs is shared with ``engine.py`` (``adapter.py``): the body runs
once per microbatch on every rank, values cross stages from their owner. Here:

* **The step** is ``engine.train_batch(iter(microbatches))``; the list must hold
  ``gradient_accumulation_steps`` microbatches. ``train_batch`` also reduces gradients and
  **steps the optimizer**: an edit in the body changes this step's update, and after the trace
  the parameters are already updated and their gradients cleared - read or change parameter
  gradients in the body's backward block, not after it.
* **Microbatches** are numbered by counting the engine's forward and backward instructions
  (its schedule runs each stage's microbatches first in, first out); the loss is the engine's
  ``loss`` after the last stage's forward instruction.
* **Gradients**: the last stage backpropagates ``loss / gradient_accumulation_steps``, so the
  body sees gradients of the whole batch's mean loss (unlike torch's schedules, which scale
  parameter gradients afterwards).
* **distgrad.flow**: ``Recorder`` takes each stage's parameter gradients at train_batch's
  optimizer-step instruction (reduced, before the step, before any clipping), on every rank,
  with no collective; ``flow.step()`` after the trace (or after a plain ``train_batch``) sends
  them in its one collective. fp32 only (ZeRO stage 0 or 1: ZeRO-1's flat partition holds each
  parameter's gradient whole, there being no data parallelism): under fp16 or bf16 the
  optimizer keeps them scaled or in buffers of its own, and ``Recorder`` raises on every rank.
* **Paths**: ``PipelineModule`` names its layers by index; pass as ``full_model`` a module that
  holds the same layer objects under the paths you want (``nn.Sequential(*blocks)``). Layers given
  as ``LayerSpec`` are built on their own stage only, so build them yourself and pass instances.
"""

from __future__ import annotations

from ..deepspeed import local_grad
from .adapter import PipelineAdapter
from .schedule_run import ScheduleRun


class DeepSpeedPipeEngine(PipelineAdapter):
    """DeepSpeed's pipeline engine (a ``PipelineModule`` run by ``train_batch``), wrapped
    with the whole model for its paths; see the module text. Its messages are DeepSpeed's own,
    so no bundle piggybacks on them (``can_piggyback`` stays False): each is a message of its
    own on distgrad's channel."""

    name = "deepspeed-pipe"

    def __init__(self, engine, full_model):
        self.ds = engine
        self.action_wraps = {}  # the trace's instruction wraps, while one runs (instrument)
        self.grad_takers = []  # distgrad.flow Recorders' (watch_param_grads)
        super().__init__(full_model, [engine.module], [engine.stage_id], engine.num_stages)

    def refuse_flow(self):
        ds = self.ds
        scaled = getattr(ds, "torch_autocast_z0_gradscaler", None) is not None
        if ds.fp16_enabled() or ds.bfloat16_enabled() or scaled:
            raise NotImplementedError(
                "distgrad.flow under DeepSpeed's pipeline engine records the parameter "
                "gradients of fp32 training (ZeRO stage 0 or 1); this engine runs with fp16 "
                f"{ds.fp16_enabled()}, bf16 {ds.bfloat16_enabled()}, torch autocast's grad "
                f"scaler {scaled}, whose optimizers keep the gradients scaled or in buffers of "
                "their own. Train in fp32 to record, use a torch.distributed.pipelining "
                "schedule, or read the gradients in the trace's backward block."
            )

    def grad_pieces(self, module):
        # ZeRO-1 keeps the reduced gradient in its flat partition (p.grad is None); with one
        # pipeline over the job (no data parallelism, see engine.py) that partition holds
        # every parameter whole, on the one rank whose stage runs it
        pieces = []
        for param in module.parameters():
            grad = local_grad(param)
            grad = param.grad if grad is None else grad
            if grad is not None:
                pieces.append((grad, 1))
        return pieces

    def watch_param_grads(self, take):
        # train_batch reduces the gradients, steps the optimizer and clears them before it
        # returns: take them at its OptimizerStep instruction, which every stage runs once
        self.grad_takers.append(take)
        self._install()

        def unwatch():
            if take in self.grad_takers:
                self.grad_takers.remove(take)
                self._install()

        return unwatch

    def microbatches(self) -> int:
        return self.ds.micro_batches

    def run_step(self, args: tuple, kwargs: dict):
        if len(args) != 1 or kwargs:
            raise TypeError(
                "model.trace(microbatches) under DeepSpeed's pipeline engine takes one "
                "argument: a list of (inputs, labels), one per microbatch."
            )
        microbatches = list(args[0])
        if len(microbatches) != self.ds.micro_batches:
            raise ValueError(
                f"model.trace(microbatches): got {len(microbatches)} microbatches, "
                f"the engine runs {self.ds.micro_batches} "
                f"(gradient_accumulation_steps)."
            )
        return self.ds.train_batch(data_iter=iter(microbatches))

    def instrument(self, on_action, on_loss):
        """Wrap the engine's ForwardPass and BackwardPass instructions (one action each; its
        schedule runs each stage's microbatches first in, first out, so counting them numbers
        the microbatches), and read its ``loss`` after the last stage's forward."""
        from deepspeed.runtime.pipe import schedule

        table = type(self.ds)._INSTRUCTION_MAP
        forward, backward = table[schedule.ForwardPass], table[schedule.BackwardPass]
        count = {"F": 0, "B": 0}
        stage = self.ds.stage_id

        def counted(phase, real):
            def run(engine, *args, **kwargs):
                microbatch = count[phase]
                count[phase] += 1
                with on_action(phase, stage, microbatch):
                    real(engine, *args, **kwargs)
                    if phase == "F":  # (its outputs, kept for the backward, by buffer id)
                        buffer = kwargs.get("buffer_id", args[0] if args else None)
                        self.refuse_beside(engine.pipe_buffers["outputs"][buffer], stage)
                if phase == "F" and engine.is_last_stage():
                    on_loss(microbatch, engine.loss)

            return run

        self.action_wraps = {
            schedule.ForwardPass: counted("F", forward),
            schedule.BackwardPass: counted("B", backward),
        }
        self._install()

        def restore():
            self.action_wraps = {}
            self._install()

        return restore

    def run_captured(self, trace, code, names, frame) -> None:
        ScheduleRun(self, trace).run(code, names, frame)

    def _install(self):
        """Put the trace's instruction wraps and the Recorder's gradient takers on the engine
        (an instance attribute over the class's table), or take them all off."""
        from deepspeed.runtime.pipe import schedule

        ds = self.ds
        table = dict(type(ds)._INSTRUCTION_MAP)
        table.update(self.action_wraps)
        if self.grad_takers:
            step = table[schedule.OptimizerStep]

            def take_then_step(engine, *args, **kwargs):
                for take in list(self.grad_takers):
                    take()
                step(engine, *args, **kwargs)

            table[schedule.OptimizerStep] = take_then_step
        if self.action_wraps or self.grad_takers:
            ds._INSTRUCTION_MAP = table
        else:
            ds.__dict__.pop("_INSTRUCTION_MAP", None)
