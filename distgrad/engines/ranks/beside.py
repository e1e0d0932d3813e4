"""Parameters beside the model: tensors a trace body brings into the graph that no engine
reduces - a steering vector added to a module's output, the weights of a user's own module
applied in the body (ReFT-style interventions) - whose gradients would otherwise stay each
rank's own while the model's are averaged.

Which tensors: every ``nn.Parameter`` leaf the backward reached (an ``AccumulateGrad`` node of
its graph) that the engine does not hold itself: not a parameter of the wrapped model, nor one
of the engine's own leaves (FSDP2's unsharded parameters, FSDP1's flat parameters). A plain
leaf tensor with ``requires_grad`` (``inputs_embeds`` a user made) is per-rank data, as the
batch is, and keeps its own gradient; so does a parameter marked with ``keep_rank_local``.

When: after each real backward of a trace's body on every rank (``Engine.after_backward``),
in the same order on every rank, since every rank runs the same body over the same model: the
graphs are alike, and so are the lists found in them. Their gradients go in one all-reduce per
dtype (the mean over the data-parallel group, as DDP and FSDP average the model's). A backward
after the trace is PyTorch's alone, with nothing after it: a trace whose forward reached such
a parameter and whose body ran no backward raises as it ends (``refuse_unreduced``). Under
tensor parallelism (``engine.py``) and pipeline schedules (``pipeline/adapter.py``) the ranks
hold parts of the gradient that no mean makes whole: they raise, naming the tensor.

Gradient accumulation: averaging the whole ``.grad`` is right whatever it held before, because
the mean is linear: a part accumulated earlier and already averaged is the same on every rank
and stays what it is; a part accumulated under ``no_sync()`` (each rank's own) is averaged
together with this backward's, as DDP averages the model's accumulated gradients at the
synchronising backward. An engine whose backward skipped its own reduction (DDP's
``no_sync()``) skips this one too, so the tensors keep rank-local sums exactly as the
model's parameters do until the synchronising backward.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ...torch_internals import pytree

# the mark keep_rank_local puts on a tensor (an attribute: a WeakSet would compare tensors with
# ==, and a copy of a marked parameter stays marked)
_MARK = "_distgrad_rank_local"


def keep_rank_local(*tensors: torch.Tensor):
    """Mark parameters beside the model whose gradients each rank keeps as its own: distgrad
    then reduces nothing for them after a backward (by default it averages them over the
    data-parallel group, as the engine averages the model's). Returns the tensor (or the tuple
    of them), so that ``v = distgrad.keep_rank_local(nn.Parameter(...))`` reads as one line."""
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"distgrad.keep_rank_local(...) takes tensors (the parameters to keep rank-local), "
                f"not {type(tensor).__name__}; for a module, pass *module.parameters()."
            )
        setattr(tensor, _MARK, True)
    return tensors[0] if len(tensors) == 1 else tensors


class OwnedLeaves:
    """The leaves an engine reduces itself (``source()`` lists them: the model's parameters and
    the engine's internal leaves), known by id with a weak reference each: a bare id could be a
    dead parameter's, reused by a new tensor of the user's. Listing them walks every module,
    so they are listed again only when a walk meets a parameter not known (a new one, or one
    beside the model)."""

    def __init__(self, source):
        self.source = source
        self.known: dict = {}

    def refresh(self) -> None:
        self.known = {id(p): weakref.ref(p) for p in self.source()}

    def __contains__(self, leaf) -> bool:
        ref = self.known.get(id(leaf))
        return ref is not None and ref() is leaf


def params_beside(roots: list, owned: OwnedLeaves) -> list:
    """The parameters reached by the backward graph of the tensors ``roots`` (its
    ``AccumulateGrad`` leaves) that are not ``owned`` and not kept rank-local, in the order a
    depth-first walk meets them (the same on every rank for the same graph). The graph's
    shape outlives its backward, so this runs after it."""
    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    found, seen = [], set(todo)
    while todo:
        for node, _ in todo.pop().next_functions:
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node holds its leaf
            if leaf is None:
                todo.append(node)
            elif (
                isinstance(leaf, torch.nn.Parameter)
                and leaf not in owned
                and not getattr(leaf, _MARK, False)
            ):
                found.append(leaf)
    if found:  # parameters the engine may have made since it last listed its own
        owned.refresh()
        found = [leaf for leaf in found if leaf not in owned]
    return found


def label(param: torch.Tensor) -> str:
    """How an error names a parameter beside the model: its shape and dtype (it has no path)."""
    return f"nn.Parameter of shape {list(param.shape)} ({str(param.dtype).replace('torch.', '')})"


def mean_over(params: list, group, wait) -> None:
    """Replace each parameter's ``.grad`` by its mean over ``group``: one all-reduce per dtype
    and device, each waited for with ``wait(work, group)`` (a peer's failure raises there)."""
    world = dist.get_world_size(group)
    buckets: dict = {}
    for param in params:
        grad = param.grad
        if grad is None:  # reached but given no gradient on any rank alike (a zero path)
            continue
        buckets.setdefault((grad.dtype, grad.device), []).append(grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        wait(dist.all_reduce(flat, group=group, async_op=True), group)
        flat.div_(world)
        offset = 0
        for grad in grads:
            n = grad.numel()
            grad.copy_(flat[offset : offset + n].view_as(grad))
            offset += n


def refuse_unreduced(output, owned: OwnedLeaves):
    """The error for a trace whose forward a parameter beside the model entered (its
    ``output`` reaches it) and whose body ran no backward, or None: a backward run after the
    trace would leave that parameter's gradient each rank's own."""
    roots = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    found = params_beside(roots, owned)
    if not found:
        return None
    return NotImplementedError(
        f"a trace body brought a parameter beside the model ({label(found[0])}) into the "
        f"forward, and the body ran no backward: a backward run after the trace would leave its "
        f"gradient each rank's own (only a backward in the body is followed by its mean over "
        f"the ranks). Run the backward in the body (`with loss.backward():`, or "
        f"`loss.backward()` inside the trace), or mark it with distgrad.keep_rank_local(param)."
    )
