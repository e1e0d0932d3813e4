"""Lightning's Trainer with an intervention in every training step, under automatic
optimization (``training_step`` returns the loss) and under manual optimization
(``self.manual_backward``).

``distgrad.lightning.TraceSteps`` is a Lightning callback: each training step runs inside a
trace whose body is the intervention, with Lightning's own zero_grad and strategy backward as
the block's backward. Under manual optimization the step traces itself, with
``model.trace_step`` and ``self.manual_backward`` as the block's backward. Both save the
gradient reaching the first block's output and double it; at the end, the parameters are
checked against plain PyTorch whose raw tensor hook makes the same edit. The same script runs
on several processes (``strategy="ddp"``; tests/test_lightning.py does, on 2 ranks).

    python examples/lightning_module.py
"""

import logging
import sys
import warnings

import lightning.pytorch as L
import torch

import distgrad
from distgrad.demo.models import build_gpt2
from distgrad.lightning import TraceSteps

warnings.filterwarnings("ignore", module="lightning")  # advice on workers and loggers
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
TOLERANCE = 1e-5  # fp32: parameters after 3 SGD steps, gradients read


def build_net():
    net = build_gpt2()
    for module in net.modules():  # dropout off: the oracle below repeats the arithmetic
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return net


class Automatic(L.LightningModule):
    """The user's module, unchanged: training_step returns the loss."""

    def __init__(self):
        super().__init__()
        self.net = build_net()

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def double_first_block(model, tr):  # model: the LightningModule, wrapped
    hidden = model.net.transformer.h[0].output
    with tr.loss.backward():  # Lightning's own zero_grad and backward of its own loss
        grad = hidden.grad
        hidden.grad = grad * 2
    return {"grad": grad}  # kept once per training step in tracer.saved (rank 0: every rank's)


class Manual(L.LightningModule):
    """Manual optimization: the step traces itself; Lightning's backward runs the block."""

    def __init__(self):
        super().__init__()
        self.net = build_net()
        self.model = distgrad.wrap(self.net)  # before Lightning starts any process group
        self.automatic_optimization = False
        self.grads = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        forward = lambda: self.net(input_ids=batch, labels=batch).loss  # noqa: E731
        with self.model.trace_step(forward, self.manual_backward) as tr:
            hidden = self.model.transformer.h[0].output
            with tr.loss.backward():  # self.manual_backward(loss)
                grad = hidden.grad.save()
                hidden.grad = grad * 2
        self.grads.append(grad)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module, callbacks=()):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,  # or 2 with strategy="ddp": saved values reach rank 0 as the global batch
        max_steps=3,
        callbacks=list(callbacks),
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))


data = torch.randint(0, 384, (6, 8), generator=torch.Generator().manual_seed(0))
tracer = TraceSteps(double_first_block)
automatic = Automatic()
fit(automatic, [tracer])
manual = Manual()
fit(manual)
for record in tracer.saved:
    print(f"step {record.step}: h[0] gradient norm {record.value['grad'].norm():.3e}")

# The oracle: plain PyTorch, the edit made by a raw tensor hook.


def plain_run(factor):
    """Train as Lightning did, a raw hook multiplying h[0]'s gradient by factor."""
    net, seen = build_net(), []

    def on_gradient(grad):
        seen.append(grad)
        return grad * factor

    def on_output(module, args, out):
        out.register_hook(on_gradient)  # returns None: the output itself stays as it is

    net.transformer.h[0].register_forward_hook(on_output)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for ids in data.split(2):
        opt.zero_grad()
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return net, seen


def largest_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


oracle, seen = plain_run(2.0)
unedited, _ = plain_run(1.0)
edit_moved = largest_difference(oracle.parameters(), unedited.parameters())
saved = [record.value["grad"] for record in tracer.saved]
off = max(
    largest_difference(automatic.net.parameters(), oracle.parameters()),
    largest_difference(manual.net.parameters(), oracle.parameters()),
    largest_difference(saved, seen),
    largest_difference(manual.grads, seen),
)
if (
    len(saved) != len(seen)
    or len(manual.grads) != len(seen)
    or edit_moved < 1e-4
    or off > TOLERANCE
):
    sys.exit(
        f"mismatch: {len(saved)} and {len(manual.grads)} records for {len(seen)} steps; the "
        f"edit moved the parameters by {edit_moved:.1e}; against raw hooks the parameters and "
        f"saved gradients differ by {off:.1e} (tolerance {TOLERANCE})"
    )
print(
    f"ok: Lightning, automatic and manual optimization, {len(seen)} steps: saved gradients and "
    f"parameters equal the raw-hook run's (largest difference {off:.1e})"
)
