"""DeepSpeed's pipeline engine: a ``PipelineModule`` run by ``engine.train_batch()``.

    pipe = PipelineModule(layers=blocks, num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=opt, config=cfg)
    model = distgrad.wrap(engine, full_model=nn.Sequential(*blocks))
    with model.trace(microbatches) as tr:        # a list of (inputs, labels), one per microbatch
        h = model[1].output.save()
        with tr.loss.backward():
            g = h.grad.save()
            h.grad = h.grad * 2

Everything but how the step runs is ``engine.py``'s: the body runs once per microbatch on every
rank, values cross stages from their owner. Here:

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
* **Paths**: ``PipelineModule`` names its layers by index; pass as ``full_model`` a module that
  holds the same layer objects under the paths you want (``nn.Sequential(*blocks)``). Layers given
  as ``LayerSpec`` are built on their own stage only, so build them yourself and pass instances.
"""
from __future__ import annotations

from .engine import PipelineEngine


class DeepSpeedPipeEngine(PipelineEngine):
    """DeepSpeed's pipeline engine (a ``PipelineModule`` run by ``train_batch``), wrapped
    with the whole model for its paths; see the module text."""
    name = "deepspeed-pipe"

    def __init__(self, engine, full_model):
        self.ds = engine
        self.stages = []
        self._setup(full_model, [engine.module], [engine.stage_id], engine.num_stages)

    def refuse_flow(self):
        raise NotImplementedError(
            "distgrad.flow under DeepSpeed's pipeline engine: train_batch() steps the optimizer "
            "and clears the gradients before it returns, so no step() can read the parameter "
            "gradients. Use a torch.distributed.pipelining schedule (flow supports them), or "
            "record without a Recorder: read the gradients in the trace's backward block.")

    def grad_pieces(self, module):
        self.refuse_flow()

    def microbatches(self) -> int:
        return self.ds.micro_batches

    def _can_carry(self) -> bool:
        return False  # its messages are DeepSpeed's own: distgrad's batches go separately

    def run_step(self, args: tuple, kwargs: dict):
        if len(args) != 1 or kwargs:
            raise TypeError("model.trace(microbatches) under DeepSpeed's pipeline engine takes one "
                            "argument: a list of (inputs, labels), one per microbatch.")
        batches = list(args[0])
        if len(batches) != self.ds.micro_batches:
            raise ValueError(f"model.trace(microbatches): got {len(batches)} microbatches, the "
                             f"engine runs {self.ds.micro_batches} (gradient_accumulation_steps).")
        return self.ds.train_batch(data_iter=iter(batches))

    def instrument(self, on_chunk, on_loss):
        from deepspeed.runtime.pipe import schedule
        ds = self.ds
        table = type(ds)._INSTRUCTION_MAP
        forward, backward = table[schedule.ForwardPass], table[schedule.BackwardPass]
        count = {"F": 0, "B": 0}
        stage = ds.stage_id

        def counted(phase, real):
            def run(engine, *args, **kwargs):
                microbatch = count[phase]
                count[phase] += 1
                with on_chunk(phase, stage, microbatch):
                    real(engine, *args, **kwargs)
                if phase == "F" and engine.is_last_stage():
                    on_loss(microbatch, engine.loss)
            return run

        ds._INSTRUCTION_MAP = {**table, schedule.ForwardPass: counted("F", forward),
                               schedule.BackwardPass: counted("B", backward)}

        def restore():
            ds.__dict__.pop("_INSTRUCTION_MAP", None)
        return restore
