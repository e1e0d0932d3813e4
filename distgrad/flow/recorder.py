"""The Recorder: per-layer gradient norms of each step, on every rank, joined by one collective.

Activation gradients are recorded by raw hooks on the chosen modules rather than through the
trace body: the body's reads follow the ordering rule, and a recorder that read every layer's
``.output`` would take the body's place in that order (and keep it from running as a
generator). A raw tensor hook sees exactly what autograd hands the module's output, on every
engine that runs the user's modules unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..trace import engine_of
from .flow_run import FlowRun
from .squares import (
    Activation,
    Params,
    check_copies,
    check_partial_layout,
    partial_layout,
    partial_squares,
)


def layer_paths(tree: torch.nn.Module, layers) -> list[str]:
    """``layers``: the path of a ModuleList or Sequential (each of its children is a layer), or a
    list of module paths; paths as in ``named_modules()`` (``transformer.h.0``)."""
    if isinstance(layers, str):
        container = tree.get_submodule(layers)
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise TypeError(
                f"layers={layers!r} is a {type(container).__name__}; give the path of "
                "a ModuleList or Sequential, or a list of module paths"
            )
        return [f"{layers}.{name}" for name, _ in container.named_children()]
    paths = list(layers)
    for path in paths:
        tree.get_submodule(path)  # AttributeError naming the missing part
    if not paths:
        raise ValueError("layers: no module paths given")
    return paths


def index_of(module):
    """``grad -> the index of its parameter in module.parameters()`` (-1: not a ``.grad``)."""
    found = (
        {}
        if module is None
        else {id(p.grad): i for i, p in enumerate(module.parameters()) if p.grad is not None}
    )
    return lambda grad: found.get(id(grad), -1)


def first_tensor(output):
    """The tensor a block passes on: its output, or the first element of a tuple output."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


class Recorder:
    """Records, per step, the norm of the gradient reaching each layer's output (summed over the
    step's backward passes) and of each layer's parameter gradients, per rank and global.

    ``step()`` closes a step with one all_gather of a small vector (5 x layers + 2 floats, and
    the local pieces of any Partial DTensor gradient) and appends it to ``run`` (a
    :class:`~distgrad.flow.FlowRun`) on every rank. Every rank must call it, after the step's
    backward and before the gradients are zeroed (DeepSpeed: before ``engine.step()``; its
    pipeline engine: after ``train_batch``, which hands the gradients over before its own
    optimizer step). The
    hooks stay on the modules until ``close()`` (or the end of a ``with`` block over the
    recorder).

    Under pipeline parallelism ``layers`` names modules of the whole model (the ``full_model``
    given to ``distgrad.wrap``): each rank hooks the layers its stages run, and every rank's
    ``run`` holds all of them, in the model's order."""

    def __init__(self, model, layers):
        engine = engine_of(model)
        engine.refuse_flow()  # on every rank, before any hook goes on
        self.engine = engine
        self.paths = layer_paths(engine.model, layers)
        # this rank's module for each layer, None where another rank's stage runs it
        self.modules = [engine.module_here(engine.model.get_submodule(p)) for p in self.paths]
        self.holders = [None if m is None else engine.output_holders(m) for m in self.modules]
        # the whole job: a tensor-parallel or pipeline group may be all of it, a data-parallel
        # group part of it (the dp dimension of a 2-D mesh)
        spread = engine.world_size > 1 and dist.is_initialized()
        self.rank = dist.get_rank() if spread else 0
        self.world = dist.get_world_size() if spread else 1
        self.run = FlowRun(self.paths, self.world, engine.name)
        first = next((p for m in self.modules if m is not None for p in m.parameters()), None)
        first = first if first is not None else next(engine.model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        if self.device.type == "meta":  # a pipeline's full model: this rank owns no layer
            self.device = torch.device("cpu")
        self.acts = [Activation() for _ in self.paths]  # this step's activation gradients
        # Partial gradients come from DTensor parameters only (the same answer on every rank:
        # each holds the whole model's structure)
        self.partial_possible = any(
            isinstance(p, DTensor)
            for path in self.paths
            for p in engine.model.get_submodule(path).parameters()
        )
        self.handles = [
            m.register_forward_hook(self.watcher(i))
            for i, m in enumerate(self.modules)
            if m is not None
        ]
        # an engine whose own step uses up the parameter gradients (DeepSpeed's pipeline
        # engine) hands them over before it, once per step: ``take`` keeps their squares here
        self.taken, self.takes, self.unwatch = None, 0, None
        try:
            self.unwatch = engine.watch_param_grads(self.take)
        except BaseException:
            self.close()
            raise

    def watcher(self, layer: int):
        def on_output(module, args, output):
            tensor = first_tensor(output)
            if tensor is None:
                raise TypeError(
                    f"distgrad.flow: {self.paths[layer]} returned a "
                    f"{type(output).__name__}, not a tensor or a tuple starting with one"
                )
            if tensor.requires_grad:  # (not under no_grad, nor a reentrant checkpoint's forward)
                tensor.register_hook(self.adder(layer))

        return on_output

    def adder(self, layer: int):
        def on_grad(grad):
            self.acts[layer].add(grad, self.holders[layer], self.world, self.paths[layer])

        return on_grad

    def param_squares(self) -> list[Params]:
        """This rank's parameter-gradient squares of each layer, as the gradients are now."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        return [
            Params([] if m is None else self.engine.grad_pieces(m), self.world, zero, index_of(m))
            for m in self.modules
        ]

    def take(self) -> None:
        """Called by the engine inside its step, where the gradients exist (no collective)."""
        self.taken = self.param_squares()
        self.takes += 1

    def step(self) -> dict:
        """End the step: gather every rank's squares (one collective) and record the norms.
        Returns the step's record (see :class:`FlowRun`)."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        acts = [a.squares.to(self.device) if a.squares is not None else zero for a in self.acts]
        shares = [
            (a.squares.to(self.device) / a.copies) if a.squares is not None else zero
            for a in self.acts
        ]
        keys = [torch.tensor(a.key, device=self.device) for a in self.acts]
        self.acts = [Activation() for _ in self.paths]
        if self.unwatch is None:
            params, took = self.param_squares(), 1
        else:  # taken in the engine's step; none taken: zeros, and every rank raises below
            params = self.taken or [Params([], self.world, zero) for _ in self.modules]
            took, self.taken, self.takes = self.takes, None, 0
        if self.partial_possible and self.world > 1:
            check_partial_layout(partial_layout(params), self.world, self.device, self.paths)
        n = len(self.paths)
        head = (
            acts
            + shares
            + keys
            + [p.held.to(self.device) for p in params]
            + [p.share.to(self.device) for p in params]
        )
        entries, start, pieces = [], 5 * n, []
        for layer, p in enumerate(params):
            for _, piece in p.partial:
                entries.append((layer, start, piece.numel()))
                start += piece.numel()
                pieces.append(piece.to(self.device))
        tail = torch.tensor([float(took), float(len(self.run.steps))], device=self.device)
        vector = torch.cat([torch.stack(head)] + pieces + [tail]).double()
        if self.world > 1:
            parts = [torch.empty_like(vector) for _ in range(self.world)]
            dist.all_gather(parts, vector)
            rows = torch.stack(parts).cpu()
        else:
            rows = vector.cpu()[None]
        if not torch.all(rows[:, -1] == rows[0, -1]):
            raise RuntimeError(
                f"distgrad.flow: the ranks are at different steps "
                f"({rows[:, -1].long().tolist()}): every rank must call step() once per step"
            )
        if not torch.all(rows[:, -2] == 1):
            raise RuntimeError(
                f"distgrad.flow: step() reads the parameter gradients the engine handed over in "
                f"its own optimizer step, which ran {rows[:, -2].long().tolist()} times (per "
                f"rank) since the last step(): call step() once after each train_batch (each "
                f"trace), on every rank."
            )
        check_copies(rows[:, :n], rows[:, 2 * n : 3 * n], self.paths)
        param_global = rows[:, 4 * n : 5 * n].sum(0) + partial_squares(rows, entries, n)
        return self.run.add(
            activation=rows[:, :n].sqrt().tolist(),
            activation_global=rows[:, n : 2 * n].sum(0).sqrt().tolist(),
            param=rows[:, 3 * n : 4 * n].sqrt().tolist(),
            param_global=param_global.sqrt().tolist(),
        )

    def save(self, path: str) -> None:
        """Write the run as JSON (rank 0 only; other ranks write nothing)."""
        if self.rank == 0:
            self.run.save(path)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.unwatch is not None:
            self.unwatch()
            self.unwatch = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
