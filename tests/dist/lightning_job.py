"""Lightning's Trainer and Fabric traced by distgrad, and plain modules traced in a multi-process
job, against one process running the global batch with plain PyTorch hooks.

Started by tests/test_lightning.py on 1 process and on 2 ranks (gloo, CPU; Lightning's
``strategy="ddp"`` and Fabric's). Each training run is 3 SGD steps of the tiny GPT-2 (dropout
off, so that one process can repeat the ranks' arithmetic) on 2 rows a rank. The oracle
(``oracle``) runs the same steps on one process, on the ranks' rows joined in rank order, with
a forward hook saving the first block's output and a tensor hook saving its gradient and
doubling it. Compared: the saved activations and gradients (rank 0: every rank's rows), the
parameters after the steps, and that the edit moved them (so the comparison could fail).
DDP averages the ranks' parameter gradients, so each rank's loss is the mean over its own rows:
the gradient a rank sees at an activation is ``world`` x that of the global mean loss.
Tolerance: fp32, relative 1e-5 (``rel_close``: max abs difference over the largest value).
Fabric's cases and the plain-module cases live in ``fabric_cases.py`` and ``in_job_cases.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

import distgrad
from cases import expect_error, run_cases  # noqa: E402  (tests/dist is the script's folder)
from distgrad.demo.models import build_gpt2
from distgrad.trace import engine_of

warnings.filterwarnings("ignore")  # Lightning's advice on workers and loggers
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
torch.set_num_threads(1)
STEPS, ROWS, LR, REL = 3, 2, 0.1, 1e-5


def build_net() -> torch.nn.Module:
    net = build_gpt2()
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return net


def dataset(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 384, (2 * STEPS * ROWS * world, 8), generator=g)  # (accumulation 2)


def rows(world: int, rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step``: every ``world``-th row from ``rank`` on."""
    indices = [rank + world * (ROWS * step + j) for j in range(ROWS)]
    return dataset(world)[indices]


def rank_rows(world: int, rank: int, accumulate: int = 1) -> torch.Tensor:
    """Every row rank ``rank`` trains on, in order (its data loader's dataset)."""
    return torch.cat([rows(world, rank, batch) for batch in range(STEPS * accumulate)])


def global_rows(world: int, step: int) -> torch.Tensor:
    return torch.cat([rows(world, r, step) for r in range(world)])


def rel_close(a, b, what: str, rel: float = REL) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != {list(b.shape)}")
    diff = (a.detach() - b.detach()).abs().max().item()
    scale = b.detach().abs().max().item()
    if diff > rel * scale:
        raise AssertionError(f"{what}: max abs diff {diff:.3g} > {rel} x {scale:.3g}")


def oracle(world: int, edit: float = 2.0, accumulate: int = 1) -> dict:
    """One process, plain autograd, the global batch of every step (of every micro-batch,
    each loss divided by ``accumulate``, as Lightning does)."""
    net = build_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    seen = {"h0": [], "g0": [], "weight_grad": []}

    def on_output(module, args, out):
        seen["h0"].append(out.detach().clone())

        def on_grad(grad):
            seen["g0"].append(grad.detach().clone())
            return grad * edit

        out.register_hook(on_grad)

    handle = net.transformer.h[0].register_forward_hook(on_output)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulate):
            ids = global_rows(world, step * accumulate + micro)
            (net(input_ids=ids, labels=ids).loss / accumulate).backward()
        seen["weight_grad"].append(net.transformer.h[1].mlp.c_fc.weight.grad.clone())
        opt.step()
    handle.remove()
    seen["params"] = dict(net.named_parameters())
    return seen


def check_run(world, rank, net, h0s, g0s, accumulate: int = 1) -> None:
    """The saved activations and gradients of every micro-batch and the parameters after the
    steps."""
    want, unedited = oracle(world, 2.0, accumulate), oracle(world, 1.0, accumulate)
    moved = max((p - unedited["params"][n]).abs().max().item() for n, p in want["params"].items())
    assert moved > 1e-5, "the edit moved no parameter: the comparison would prove nothing"
    assert len(h0s) == len(g0s) == STEPS * accumulate, (len(h0s), len(g0s))
    for step in range(STEPS * accumulate):
        mine = slice(None) if rank == 0 else slice(rank * ROWS, (rank + 1) * ROWS)
        rel_close(h0s[step], want["h0"][step][mine], f"h[0]'s output at step {step}")
        rel_close(g0s[step], world * want["g0"][step][mine], f"h[0]'s gradient at step {step}")
    for name, p in net.named_parameters():
        rel_close(p, want["params"][name], f"parameter {name} after {STEPS} steps")


# -- Lightning ---------------------------------------------------------------------------------
def trainer_for(world: int, callbacks=(), accumulate: int = 1):
    import lightning.pytorch as L

    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=STEPS,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        use_distributed_sampler=False,
        accumulate_grad_batches=accumulate,
    )  # each rank's rows are given: the oracle knows them


def fit(world: int, module, callbacks=(), accumulate: int = 1):
    trainer = trainer_for(world, callbacks, accumulate)
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = torch.utils.data.DataLoader(rank_rows(world, rank, accumulate), batch_size=ROWS)
    trainer.fit(module, data)
    return trainer


def make_module(manual: bool = False, step=None):
    """A LightningModule of the user's: ``self.net``, wrapped in ``__init__`` (before Lightning
    starts the process group); ``step(self, batch)`` is its manual-optimization step."""
    import lightning.pytorch as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_net()
            self.traced = distgrad.wrap(self.net)
            self.automatic_optimization = not manual
            self.h0s, self.g0s, self.weight_grads = [], [], []

        def training_step(self, batch, batch_idx):
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                step(self, batch)
                opt.step()
                return None
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return Tiny()


def double_first_block(model, tr):
    """The intervention of the recipe: save the first block's output and its gradient, and
    double the gradient."""
    hidden = model.net.transformer.h[0].output
    with tr.loss.backward():  # Lightning's own zero_grad and strategy backward
        grad = hidden.grad
        hidden.grad = grad * 2
    return {"h0": hidden, "grad": grad}


def case_lightning_automatic(world, rank):
    from distgrad.lightning import TraceSteps  # (Lightning: imported by the cases that use it)

    tracer = TraceSteps(double_first_block)
    module = make_module()
    trainer = fit(world, module, [tracer])
    assert engine_of(tracer.traced_model).name == ("ddp" if world > 1 else "local")
    assert [r.step for r in tracer.saved] == list(range(STEPS)), tracer.saved
    check_run(
        world,
        rank,
        module.net,
        [r.value["h0"] for r in tracer.saved],
        [r.value["grad"] for r in tracer.saved],
    )
    assert "_make_closure" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)


def case_lightning_automatic_accumulation(world, rank):
    """accumulate_grad_batches=2: tr.loss is the loss over 2 (the saved gradients show it), DDP
    reduces on the second micro-batch only, one record per micro-batch."""
    from distgrad.lightning import TraceSteps

    tracer = TraceSteps(double_first_block)
    module = make_module()
    fit(world, module, [tracer], accumulate=2)
    assert [(r.step, r.micro_batch) for r in tracer.saved] == [
        (i // 2, i % 2) for i in range(2 * STEPS)
    ], [r[:2] for r in tracer.saved]
    check_run(
        world,
        rank,
        module.net,
        [r.value["h0"] for r in tracer.saved],
        [r.value["grad"] for r in tracer.saved],
        accumulate=2,
    )


def case_lightning_fsdp_refuses_the_cpu(world, rank):
    """What docs/recipes.rst says of it: Lightning itself refuses FSDP on the CPU. (DeepSpeed's
    refusal, also there, is left out: importing deepspeed costs seconds a rank.)"""
    import lightning.pytorch as L

    def run():
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy="fsdp", max_steps=1)
        trainer.fit(make_module(), torch.utils.data.DataLoader(rank_rows(world, rank)))

    expect_error(run, ValueError, "The strategy `fsdp` requires a GPU accelerator", heard=False)


def manual_step(self, batch):
    """The manual-optimization recipe: Lightning's backward (``self.manual_backward``) as the
    block's; the reduced gradient of a weight read after it."""
    model = self.traced
    with model.trace_step(
        lambda: self.net(input_ids=batch, labels=batch).loss, self.manual_backward
    ) as tr:
        hidden = model.transformer.h[0].output.save()
        with tr.loss.backward():
            grad = hidden.grad.save()
            hidden.grad = grad * 2
        weight_grad = model.transformer.h[1].mlp.c_fc.weight.grad.clone()
    self.h0s.append(hidden)
    self.g0s.append(grad)
    self.weight_grads.append(weight_grad)


def case_lightning_manual(world, rank):
    module = make_module(manual=True, step=manual_step)
    fit(world, module)
    check_run(world, rank, module.net, module.h0s, module.g0s)
    want = oracle(world)
    for step, grad in enumerate(module.weight_grads):  # reduced: the global gradient
        rel_close(grad, want["weight_grad"][step], f"h[1]'s c_fc weight .grad at step {step}")


def slip_with_block(self, batch):
    with self.traced.trace(input_ids=batch, labels=batch):
        with self.traced.output.loss.backward():
            pass


def slip_with_plain_backward(self, batch):
    with self.traced.trace(input_ids=batch, labels=batch):
        self.traced.output.loss.backward()


def case_lightning_manual_block_raises(world, rank):
    module = make_module(manual=True, step=slip_with_block)
    expect_error(lambda: fit(world, module), distgrad.TraceStateError, "self.manual_backward")


def case_lightning_manual_plain_backward_raises(world, rank):
    module = make_module(manual=True, step=slip_with_plain_backward)
    expect_error(lambda: fit(world, module), distgrad.TraceStateError, "self.manual_backward")


def case_lightning_automatic_block_raises(world, rank):
    """Under automatic optimization a block in training_step would be a second backward."""
    import lightning.pytorch as L

    class Slip(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_net()
            self.traced = distgrad.wrap(self.net)

        def training_step(self, batch, batch_idx):
            with self.traced.trace(input_ids=batch, labels=batch):
                loss = self.traced.output.loss
                with loss.backward():
                    pass
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    expect_error(lambda: fit(world, Slip()), distgrad.TraceStateError, "TraceSteps")


def case_lightning_manual_backward_in_body_runs(world, rank):
    """``self.manual_backward(loss)`` called in a trace's body is Lightning's own backward."""

    def step(self, batch):
        with self.traced.trace(input_ids=batch, labels=batch):
            hidden = self.traced.transformer.h[0].output
            hidden.register_hook(lambda g: g * 2)  # the oracle's edit, by the user's own hook
            self.h0s.append(hidden.save())
            self.manual_backward(self.traced.output.loss)

    module = make_module(manual=True, step=step)
    fit(world, module)
    want = oracle(world)
    for name, p in module.net.named_parameters():
        rel_close(p, want["params"][name], f"parameter {name} after {STEPS} steps")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distgrad.config.failure_timeout = 10.0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:  # (Lightning and Fabric join a group that exists; a restart needs one)
        dist.init_process_group("gloo")
    from fabric_cases import FABRIC_CASES, FABRIC_FAILURES
    from in_job_cases import IN_JOB_CASES, IN_JOB_FAILURES

    cases = [
        case_lightning_automatic,
        case_lightning_automatic_accumulation,
        case_lightning_manual,
        case_lightning_manual_backward_in_body_runs,
        *FABRIC_CASES,
    ]
    if world > 1:
        cases += [*IN_JOB_CASES, case_lightning_fsdp_refuses_the_cpu]
    # each failure on 2 ranks ends the process group (distgrad's failure protocol), and the
    # ranks start again for the next case (cases.py): on one process every slip runs, on 2
    # ranks one of each kind
    cases += [case_lightning_manual_block_raises, case_lightning_manual_plain_backward_raises]
    if world == 1:
        cases += [case_lightning_automatic_block_raises]
    else:
        cases += IN_JOB_FAILURES
    cases += FABRIC_FAILURES if world == 1 else FABRIC_FAILURES[:1]
    run_cases(cases, args.out, rank, world, rank)


if __name__ == "__main__":
    sys.exit(main())
