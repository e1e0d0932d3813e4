"""The Recorder: per-layer gradient norms of each step, on every rank, joined by one collective.

Activation gradients are recorded by raw hooks on the chosen modules rather than through the
trace body: the body's reads follow the ordering rule, and a recorder that read every layer's
``.output`` would take the body's place in that order (and keep it from running as a
generator). A raw tensor hook sees exactly what autograd hands the module's output, on every
engine that runs the user's modules unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..trace import engine_of
from .run import FlowRun

# engines whose user modules run as written, with parameter gradients a plain tensor (the
# reduced gradient) or a DTensor (its shard): what the norms below are exact for
SUPPORTED = {"local", "ddp", "fsdp2", "accelerate"}
# what an accelerate engine may have prepared: the module itself (one process) or DDP
ACCELERATE_ROOTS = {"DistributedDataParallel"}


def layer_paths(tree: torch.nn.Module, layers) -> list[str]:
    """``layers``: the path of a ModuleList or Sequential (each of its children is a layer), or a
    list of module paths; paths as in ``named_modules()`` (``transformer.h.0``)."""
    if isinstance(layers, str):
        container = tree.get_submodule(layers)
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise TypeError(f"layers={layers!r} is a {type(container).__name__}; give the path of "
                            "a ModuleList or Sequential, or a list of module paths")
        return [f"{layers}.{name}" for name, _ in container.named_children()]
    paths = list(layers)
    for path in paths:
        tree.get_submodule(path)  # AttributeError naming the missing part
    if not paths:
        raise ValueError("layers: no module paths given")
    return paths


def check_engine(engine) -> None:
    if engine.captures_body:
        raise NotImplementedError(
            f"distgrad.flow does not support pipeline parallelism yet (the {engine.name} engine): "
            "a pipeline stage holds only some of the layers.")
    inner = type(engine.root).__name__
    if engine.name not in SUPPORTED or (engine.name == "accelerate" and engine.root is not engine.model
                                        and inner not in ACCELERATE_ROOTS):
        raise NotImplementedError(
            f"distgrad.flow supports one process, DDP, FSDP2 (fully_shard) and accelerate's DDP; "
            f"not yet the {engine.name} engine ({inner}), whose parameter gradients are not the "
            "module's own .grad, or whose activations are shards.")
    if engine.world_size > 1 and engine.world_size != dist.get_world_size():
        raise NotImplementedError(
            "distgrad.flow gathers over the whole job; this engine's group is a part of it "
            f"({engine.world_size} of {dist.get_world_size()} ranks).")


def first_tensor(output):
    """The tensor a block passes on: its output, or the first element of a tuple output."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def param_squares(module: torch.nn.Module, world: int):
    """(sum of squares this rank holds, this rank's share of the global sum of squares) over the
    gradients of ``module``'s parameters. A plain gradient is the reduced gradient, the same on
    every rank: each holds 1/world of it. A DTensor gradient is this rank's part of it: its
    squares count once per shard and are divided among the ranks that replicate it."""
    held, share = [], []
    for param in module.parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise NotImplementedError("distgrad.flow: a partial (unreduced) DTensor gradient")
            mesh = grad.device_mesh
            if mesh.size() != world:
                raise NotImplementedError("distgrad.flow: a DTensor gradient on a mesh smaller "
                                          "than the job")
            replicas = math.prod(mesh.size(d) for d, p in enumerate(grad.placements)
                                 if p.is_replicate())
            squares = grad.to_local().detach().float().pow(2).sum()
            held.append(squares)
            share.append(squares / replicas)
        else:
            squares = grad.detach().float().pow(2).sum()
            held.append(squares)
            share.append(squares / world)
    if not held:
        return None, None
    return torch.stack(held).sum(), torch.stack(share).sum()


class Recorder:
    """Records, per step, the norm of the gradient reaching each layer's output (summed over the
    step's backward passes) and of each layer's parameter gradients, per rank and global.

    ``step()`` closes a step with one all_gather of a small vector (3 x layers + 1 floats) and
    appends it to ``run`` (a :class:`~distgrad.flow.FlowRun`) on every rank. Every rank must call
    it, after the step's backward and before the gradients are zeroed. The hooks stay on the
    modules until ``close()`` (or the end of a ``with`` block over the recorder)."""

    def __init__(self, model, layers):
        engine = engine_of(model)
        check_engine(engine)
        self.paths = layer_paths(engine.model, layers)
        self.modules = [engine.unwrap(engine.model.get_submodule(p)) for p in self.paths]
        self.rank, self.world = engine.rank, engine.world_size
        self.run = FlowRun(self.paths, self.world, engine.name)
        first = next(engine.model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.squares: list = [None] * len(self.paths)   # activation gradients of this step
        self.handles = [m.register_forward_hook(self.watcher(i))
                        for i, m in enumerate(self.modules)]

    def watcher(self, layer: int):
        def on_output(module, args, output):
            tensor = first_tensor(output)
            if tensor is None:
                raise TypeError(f"distgrad.flow: {self.paths[layer]} returned a "
                                f"{type(output).__name__}, not a tensor or a tuple starting with one")
            if tensor.requires_grad:  # (not under no_grad, nor a reentrant checkpoint's forward)
                tensor.register_hook(self.adder(layer))

        return on_output

    def adder(self, layer: int):
        def on_grad(grad):
            squares = grad.detach().float().pow(2).sum()  # stays on the device: no sync here
            before = self.squares[layer]
            self.squares[layer] = squares if before is None else before + squares

        return on_grad

    def step(self) -> dict:
        """End the step: gather every rank's squares (one collective) and record the norms.
        Returns the step's record (see :class:`FlowRun`)."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        acts = [zero if s is None else s.to(self.device) for s in self.squares]
        held, share = [], []
        for module in self.modules:
            h, s = param_squares(module, self.world)
            held.append(zero if h is None else h)
            share.append(zero if s is None else s)
        counter = torch.tensor(float(len(self.run.steps)), device=self.device)
        vector = torch.stack(acts + held + share + [counter]).double()
        if self.world > 1:
            parts = [torch.empty_like(vector) for _ in range(self.world)]
            dist.all_gather(parts, vector)
            rows = torch.stack(parts).cpu()
        else:
            rows = vector.cpu()[None]
        self.squares = [None] * len(self.paths)
        if not torch.all(rows[:, -1] == rows[0, -1]):
            raise RuntimeError(f"distgrad.flow: the ranks are at different steps "
                               f"({rows[:, -1].long().tolist()}): every rank must call step() once per step")
        n = len(self.paths)
        return self.run.add(activation=rows[:, :n].sqrt().tolist(),
                            activation_global=rows[:, :n].sum(0).sqrt().tolist(),
                            param=rows[:, n:2 * n].sqrt().tolist(),
                            param_global=rows[:, 2 * n:3 * n].sum(0).sqrt().tolist())

    def save(self, path: str) -> None:
        """Write the run as JSON (rank 0 only; other ranks write nothing)."""
        if self.rank == 0:
            self.run.save(path)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
