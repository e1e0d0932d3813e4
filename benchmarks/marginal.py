"""What each further read+edit costs, measured where the model's own time hides it less.

    python benchmarks/marginal.py [--layers 40] [--steps 200] [--no-nnsight]
                                  [--backward-mode greenlet|thread]

overhead.py's part B fits a slope over k = 1..6 hooked layers of a tiny GPT-2. A GPT-2 step
takes 16 ms here and drifts by a few hundred microseconds, so that slope carries a standard error
of 10-30 us: too coarse to tell 60 us from 90 us. Here the model is a stack of ``--layers``
``Linear(16, 16)`` layers (about 0.1 ms of compute each), and each variant runs with every layer
read and edited (k = layers) and with none (k = 0), in turns. Per read+edit:

    cost(variant) = (median(k = layers) - median(k = 0)) / layers
    overhead      = cost(distgrad or nnsight) - cost(raw hooks)

Two programs: "read" reads ``model[i].output`` only (a forward pause each); "read+edit" is the
README program per layer (forward read, then in the backward block ``a.grad.save()`` and
``a.grad = a.grad * 2``). Raw hooks do the same with a forward hook and a tensor hook.

``--backward-mode thread`` runs distgrad's backward blocks in a worker thread, the path a CUDA
backward takes (``distgrad.config.backward_mode``). The floors below are the least a design
with the body as a coroutine of the run can cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import OrderedDict

import greenlet
import torch
from overhead import bench
from torch.utils.hooks import RemovableHandle

import distgrad


def make_mlp(layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])


def raw_read(net, x, k):
    kept = []

    def on_output(module, args, out):
        kept.append(out)

    handles = [net[i].register_forward_hook(on_output) for i in range(k)]
    try:
        torch.autograd.backward(net(x).sum())
    finally:
        for h in handles:
            h.remove()


def raw_edit(net, x, k):
    saved, handles = [], []

    def on_grad(g):
        saved.append(g.clone())
        return g * 2

    def on_output(module, args, out):
        out.register_hook(on_grad)

    for i in range(k):
        handles.append(net[i].register_forward_hook(on_output))
    try:
        torch.autograd.backward(net(x).sum())
    finally:
        for h in handles:
            h.remove()
    return saved[::-1]


# One source for distgrad and nnsight, as in overhead.py.
def traced_read(model, x, k):
    with model.trace(x):
        [model[i].output for i in range(k)]
        loss = model.output.sum()
        with loss.backward():
            pass


def traced_edit(model, x, k):
    gs = []
    with model.trace(x):
        acts = [model[i].output for i in range(k)]
        loss = model.output.sum()
        with loss.backward():
            for a in reversed(acts):
                gs.append(a.grad.save())
                a.grad = a.grad * 2
    return gs[::-1]


def _add_hook(hooks: dict, fn) -> int:
    """An entry in one of PyTorch's hook dicts, as ``register_*_hook`` makes it."""
    hid = RemovableHandle.next_id
    RemovableHandle.next_id = hid + 1
    hooks[hid] = fn
    return hid


def _tensor_hooks(tensor) -> dict:
    """A non-leaf tensor's dict of gradient hooks, made as ``Tensor.register_hook`` does."""
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = OrderedDict()
        tensor.grad_fn._register_hook_dict(tensor)
    return hooks


def _doubled(g):
    reply = g * 2
    if not (reply.shape == g.shape and reply.dtype == g.dtype and reply.device == g.device):
        raise ValueError("replacement does not match")
    return reply


def floor_edit(net, x, k):
    """The leanest body-as-coroutine read+edit I could write (greenlets, hook dict entries, one
    closure per hook, the replacement's shape/dtype/device check; no bodies, points, labels,
    saves or errors): what a design like distgrad's costs before any bookkeeping."""
    getcurrent = greenlet.getcurrent

    def run(fn):
        glet = greenlet.greenlet(lambda _: fn())
        glet.want = None
        return glet

    def resume(glet, reply):
        glet.parent = getcurrent()
        return glet.switch(reply)

    out = []
    fwd = run(lambda: out.append(net(x)))
    added, acts, gs = [], [], []
    for i in range(k):

        def hook(module, args, output):
            return fwd.parent.switch(output) if fwd.want is hook else None

        hooks = net[i]._forward_hooks
        added.append((hooks, _add_hook(hooks, hook)))
        fwd.want = hook
        acts.append(resume(fwd, None))
    fwd.want = None
    resume(fwd, None)
    for hooks, hid in added:
        del hooks[hid]
    loss = out[0].sum()
    bwd = run(lambda: torch.autograd.backward(loss))
    reply = None
    for a in reversed(acts):

        def on_grad(grad):
            return bwd.parent.switch(grad) if bwd.want is on_grad else None

        _add_hook(_tensor_hooks(a), on_grad)
        bwd.want = on_grad
        g = resume(bwd, reply).clone()
        gs.append(g)
        reply = _doubled(g)
    bwd.want = None
    resume(bwd, reply)
    return gs[::-1]


def nocoroutine_edit(net, x, k):
    """floor_edit's bookkeeping (hook dict entries, the tensor's hook dict, the clone and the
    replacement's check) with the body's work done inside the hooks: no coroutine, so no body
    could be written this way. What floor_edit costs beyond it is the greenlet round trips."""
    added, gs = [], []

    def on_grad(grad):
        g = grad.clone()
        gs.append(g)
        return _doubled(g)

    def hook(module, args, output):
        _add_hook(_tensor_hooks(output), on_grad)

    for i in range(k):
        hooks = net[i]._forward_hooks
        added.append((hooks, _add_hook(hooks, hook)))
    out = net(x)
    for hooks, hid in added:
        del hooks[hid]
    torch.autograd.backward(out.sum())
    return gs[::-1]


ESTIMATORS = {"median": statistics.median, "min": min}


def per_layer(times: dict, layers: int) -> dict:
    """{estimator: {variant: us per layer}} from the step times of k = layers and k = 0. The
    minimum is the steadier estimate here: noise on this machine only ever adds time."""
    return {
        est: {name: (f(times[name, layers]) - f(times[name, 0])) / layers for name, _ in times}
        for est, f in ESTIMATORS.items()
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--steps", type=int, default=200, help="timed steps per variant and k")
    p.add_argument("--repeats", type=int, default=3, help="whole measurements; the median is kept")
    p.add_argument("--no-nnsight", action="store_true")
    p.add_argument(
        "--backward-mode",
        default="auto",
        choices=("auto", "greenlet", "thread"),
        help="distgrad.config.backward_mode (thread: what a CUDA backward uses)",
    )
    a = p.parse_args()
    distgrad.config.backward_mode = a.backward_mode
    torch.set_num_threads(1)
    n = a.layers
    x = torch.randn(2, 16)
    net = make_mlp(n)
    libs = {"distgrad": distgrad.wrap(net)}

    ref = raw_edit(net, x, n)
    ref_grads = [q.grad.clone() for q in net.parameters()]
    net.zero_grad(set_to_none=True)
    ok = all(
        torch.allclose(r, g, atol=1e-6) for r, g in zip(ref, traced_edit(libs["distgrad"], x, n))
    )
    ok = ok and all(
        torch.allclose(r, q.grad, atol=1e-6) for r, q in zip(ref_grads, net.parameters())
    )
    print(
        f"numerics distgrad vs raw hooks ({n} layers, saved and parameter gradients): "
        f"{'OK' if ok else 'MISMATCH'}"
    )

    net.zero_grad(set_to_none=True)
    floor_ok = all(torch.allclose(r, g, atol=1e-6) for r, g in zip(ref, floor_edit(net, x, n)))
    net.zero_grad(set_to_none=True)
    floor_ok = floor_ok and all(
        torch.allclose(r, g, atol=1e-6) for r, g in zip(ref, nocoroutine_edit(net, x, n))
    )
    print(f"numerics floor and no-coroutine vs raw hooks: {'OK' if floor_ok else 'MISMATCH'}")

    results = {"distgrad": [], "floor": [], "no coroutine": []}
    for _ in range(a.repeats):
        variants = {}
        for prog, raw, traced in (
            ("read", raw_read, traced_read),
            ("read+edit", raw_edit, traced_edit),
        ):
            for k in (0, n):
                variants[(f"raw {prog}", k)] = (raw, net, (net, x, k))
                variants[(f"distgrad {prog}", k)] = (traced, net, (libs["distgrad"], x, k))
        for k in (0, n):
            variants[("floor read+edit", k)] = (floor_edit, net, (net, x, k))
            variants[("no coroutine read+edit", k)] = (nocoroutine_edit, net, (net, x, k))
        found = per_layer(bench(variants, a.steps, rounds=10, warmup=10, stat=None), n)
        for lib in ("distgrad", "floor", "no coroutine"):
            results[lib].append(found)

    if not a.no_nnsight:
        # nnsight last, as in overhead.py: undo distgrad's import-time patches first.
        torch.Tensor.backward = getattr(torch.Tensor.backward, "__wrapped__", torch.Tensor.backward)
        for patched in ("save", "grad"):
            if patched in torch.Tensor.__dict__:
                delattr(torch.Tensor, patched)
        import copy

        from nnsight import NNsight

        nn_net = copy.deepcopy(net)
        nns = NNsight(nn_net)
        results["nnsight"] = []
        for _ in range(a.repeats):
            variants = {}
            for prog, raw, traced in (
                ("read", raw_read, traced_read),
                ("read+edit", raw_edit, traced_edit),
            ):
                for k in (0, n):
                    variants[(f"raw {prog}", k)] = (raw, net, (net, x, k))
                    variants[(f"nnsight {prog}", k)] = (traced, nn_net, (nns, x, k))
            results["nnsight"].append(
                per_layer(bench(variants, a.steps, rounds=10, warmup=10, stat=None), n)
            )

    print(
        f"\n## Per read on a {n}-layer Linear(16, 16) stack, batch 2 (median of {a.repeats} "
        f"measurements of {a.steps} steps each; per-layer costs from the median and from the "
        f"fastest step of each variant)\n"
    )
    print(
        "| library | program | raw hooks us (median) | library us (median) | overhead us (median) "
        "| overhead us (min) |\n|---|---|---:|---:|---:|---:|"
    )
    for lib, runs in results.items():
        for prog in ("read+edit",) if lib in ("floor", "no coroutine") else ("read", "read+edit"):
            raw = statistics.median(r["median"][f"raw {prog}"] for r in runs)
            own = statistics.median(r["median"][f"{lib} {prog}"] for r in runs)
            over = {
                est: statistics.median(
                    r[est][f"{lib} {prog}"] - r[est][f"raw {prog}"] for r in runs
                )
                for est in ESTIMATORS
            }
            print(
                f"| {lib} | {prog} | {raw:.1f} | {own:.1f} | {over['median']:.1f} "
                f"| {over['min']:.1f} |"
            )
    print(
        f"\n(distgrad: backward_mode {a.backward_mode}. floor: floor_edit, the leanest "
        "greenlet coroutine read+edit; no coroutine: its bookkeeping without the coroutine; "
        "both timed with distgrad imported.)"
    )
    return 0 if ok and floor_ok else 1


if __name__ == "__main__":
    sys.exit(main())
