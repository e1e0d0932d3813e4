"""Per-step cost of reading + editing a gradient on a tiny GPT-2: raw hooks vs distgrad vs nnsight.

    python benchmarks/overhead.py [--steps 300] [--json out.json] [--no-nnsight]
                                  [--backward-mode greenlet|thread]

One process. Part A: one read+edit of model.transformer.h[0].output.grad (n_layer=2).
Part B: the same for k = 1..6 layers of a 6-layer model; the slope is the cost of each extra one.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata as md
import json
import platform
import statistics
import sys
import time

import torch
import transformers

import distgrad  # patches Tensor.backward (with-form only) and adds Tensor.save at import
from distgrad.demo.models import build_gpt2 as make_net  # the tiny GPT-2 at n_layer layers


# -- the three programs; each runs one traced step over layers 0..k-1 and returns the saved grads --
def raw_step(net, ids, k):
    saved, handles = [], []

    def grad_hook(g):
        saved.append(g.clone())
        return g * 2

    def fwd_hook(module, args, out):
        out.register_hook(grad_hook)

    # Hooks are registered and removed every step, as distgrad does: the variants share one
    # module, and a hook left behind would fire in the other variants' steps.
    for i in range(k):
        handles.append(net.transformer.h[i].register_forward_hook(fwd_hook))
    try:
        loss = net(ids).logits.sum()
        # torch.autograd.backward rather than loss.backward(): both distgrad and nnsight replace
        # Tensor.backward at import; this keeps the baseline free of either library's wrapper.
        torch.autograd.backward(loss)
    finally:
        for h in handles:
            h.remove()
    return saved  # gradient order: h[k-1] first ... h[0] last


# distgrad and nnsight 0.8 take the very same program, so one source serves both libraries.
def traced_step(model, ids):
    """Part A: exactly the program under test."""
    with model.trace(ids):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum()
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    return [g]


def traced_step_k(model, ids, k):
    """Part B: the same for h[0..k-1]; forward reads in forward order, grads in reverse."""
    gs = []
    with model.trace(ids):
        acts = [model.transformer.h[i].output for i in range(k)]
        loss = model.output.logits.sum()
        with loss.backward():
            for a in reversed(acts):
                gs.append(a.grad.save())
                a.grad = a.grad * 2
    return gs


def timed(step, net, *args) -> int:
    fresh(net)  # outside the timed region: the same for every variant
    t0 = time.perf_counter_ns()
    step(*args)
    return time.perf_counter_ns() - t0


def bench(
    variants: dict, steps: int, rounds: int = 30, warmup: int = 20, stat=statistics.median
) -> dict:
    """variants: name -> (step, net, args) -> ``stat`` of the step times in us (``stat=None``:
    the list of times). The variants take turns in short blocks (rounds x steps/rounds) so that
    machine drift and noise hit all of them alike."""
    for step, net, args in variants.values():
        for _ in range(warmup):
            timed(step, net, *args)
    per_round = -(-steps // rounds)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        gc.collect()  # no collector pass left over from the previous round
        for name, (step, net, args) in variants.items():
            times[name] += [timed(step, net, *args) for _ in range(per_round)]
    if stat is None:
        return {name: [ns / 1e3 for ns in t] for name, t in times.items()}  # us
    return {name: stat(t) / 1e3 for name, t in times.items()}  # us


def slope(ks, us) -> tuple[float, float]:
    """Least-squares slope of us over ks, and its standard error (how much to trust it)."""
    mk, mu = statistics.fmean(ks), statistics.fmean(us)
    sxx = sum((k - mk) ** 2 for k in ks)
    b = sum((k - mk) * (u - mu) for k, u in zip(ks, us)) / sxx
    res = sum((u - mu - b * (k - mk)) ** 2 for k, u in zip(ks, us))
    return b, (res / (len(ks) - 2) / sxx) ** 0.5


def compare(name, base, raw_nets, nets, models, ids, ks, steps) -> tuple[dict, dict]:
    """Part A and part B for one library, interleaved with raw hooks: ({variant: us},
    {variant: [us at k for k in ks]})."""
    one = bench(
        {
            base: (raw_step, raw_nets[0], (raw_nets[0], ids, 1)),
            name: (traced_step, nets[0], (models[0], ids)),
        },
        steps,
    )
    # All k in one interleaved run, so that drift cannot masquerade as a slope.
    r = bench(
        {(base, k): (raw_step, raw_nets[1], (raw_nets[1], ids, k)) for k in ks}
        | {(name, k): (traced_step_k, nets[1], (models[1], ids, k)) for k in ks},
        steps,
        warmup=10,
    )
    return one, {n: [r[n, k] for k in ks] for n in (base, name)}


def fresh(net) -> None:
    net.zero_grad(set_to_none=True)


def check(name, net_a, net_b, gs_b) -> bool:
    """net_a ran raw_step (its saved grads in net_a.saved); net_b ran the variant's step."""
    gs_a = net_a.saved
    ok = len(gs_a) == len(gs_b) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(gs_a, gs_b))
    for (pn, pa), (_, pb) in zip(net_a.named_parameters(), net_b.named_parameters()):
        if (pa.grad is None) != (pb.grad is None) or (
            pa.grad is not None and not torch.allclose(pa.grad, pb.grad, atol=1e-6)
        ):
            print(f"  mismatch in parameter grad {pn}")
            ok = False
    print(f"numerics {name} vs raw hooks: {'OK' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=300, help="timed steps per variant (>= 300 advised)"
    )
    p.add_argument("--json", help="write the results here")
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
    torch.manual_seed(0)
    ids = torch.randint(0, 384, (2, 8))
    ks = list(range(1, 7))
    print(f"command: {' '.join([sys.executable] + sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, distgrad {distgrad.__version__}, nnsight "
        f"{md.version('nnsight') if not a.no_nnsight else '(skipped)'}, "
        f"threads {torch.get_num_threads()}, "
        f"backward_mode {a.backward_mode}"
    )

    net2, net6 = make_net(2), make_net(6)
    dg2, dg6 = distgrad.wrap(net2, tokenizer=None), distgrad.wrap(net6, tokenizer=None)

    # Numerics, once per model: the saved grads, and the parameter grads after the step (which
    # show the edit reached upstream), of distgrad must match raw hooks.
    refs = {}
    for net, k in ((net2, 1), (net6, 6)):
        ref_net = refs[k] = copy.deepcopy(net)
        fresh(ref_net)
        ref_net.saved = raw_step(ref_net, ids, k)
    # k=1 checks the exact part-A program, k=6 the multi-layer one (and the request order).
    run = lambda m, k: traced_step(m, ids) if k == 1 else traced_step_k(m, ids, k)
    ok = all(
        [
            check(f"distgrad k={k}", refs[k], n, fresh(n) or run(m, k))
            for n, m, k in ((net2, dg2, 1), (net6, dg6, 6))
        ]
    )

    one, multi = compare(
        "distgrad", "raw hooks", (net2, net6), (net2, net6), (dg2, dg6), ids, ks, a.steps
    )
    nn_ok = None
    if not a.no_nnsight:
        # nnsight last: importing it replaces torch.Tensor.backward and mounts .save() on every
        # object for the rest of the process. First undo distgrad's import-time patches (distgrad
        # is done): they would defer to nnsight's outside distgrad's traces, but each deferral is
        # one more call on nnsight's path (its backward would call distgrad's as "the original",
        # its .save() would be reached through distgrad's Tensor.save), which is not nnsight's cost.
        torch.Tensor.backward = getattr(torch.Tensor.backward, "__wrapped__", torch.Tensor.backward)
        for patched in ("save", "grad"):  # torch itself defines neither on torch.Tensor
            if patched in torch.Tensor.__dict__:
                delattr(torch.Tensor, patched)
        from nnsight import NNsight

        # Own copies: NNsight(net) instruments every submodule for good, which would slow the
        # raw-hook steps that are re-timed alongside it (a fresh baseline for this phase).
        nn2, nn6 = copy.deepcopy(net2), copy.deepcopy(net6)
        ns2, ns6 = NNsight(nn2), NNsight(nn6)
        nn_ok = all(
            [
                check(f"nnsight k={k}", refs[k], n, fresh(n) or run(m, k))
                for n, m, k in ((nn2, ns2, 1), (nn6, ns6, 6))
            ]
        )  # informational
        r1, rk = compare(
            "nnsight",
            "raw hooks (nnsight phase)",
            (net2, net6),
            (nn2, nn6),
            (ns2, ns6),
            ids,
            ks,
            a.steps,
        )
        one, multi = one | r1, multi | rk

    # Ratios against the raw-hook baseline timed in the same phase.
    base = lambda name: (
        "raw hooks (nnsight phase)" if name.startswith(("nnsight", "raw hooks (")) else "raw hooks"
    )
    print(
        "\n## One read+edit of h[0].output.grad "
        f"(n_layer=2, batch 2x8, median of {a.steps} steps)\n"
    )
    print("| variant | median us/step | ratio vs raw hooks |\n|---|---:|---:|")
    for name, us in one.items():
        print(f"| {name} | {us:.1f} | {us / one[base(name)]:.2f}x |")

    slopes = {name: slope(ks, us) for name, us in multi.items()}
    print("\n## Each further read+edit (n_layer=6, k = 1..6 layers, least-squares slope)\n")
    print(
        "| variant | " + " | ".join(f"k={k} us" for k in ks) + " | slope us/read+edit (± s.e.) "
        "| slope ratio |"
    )
    print("|---|" + "---:|" * (len(ks) + 2))
    for name, us in multi.items():
        print(
            f"| {name} | "
            + " | ".join(f"{u:.1f}" for u in us)
            + f" | {slopes[name][0]:.1f} ± {slopes[name][1]:.1f} | "
            f"{slopes[name][0] / slopes[base(name)][0]:.2f}x |"
        )
    if not a.no_nnsight:
        print(
            "\n(raw hooks (nnsight phase): the baseline re-timed alongside nnsight, which runs "
            "after distgrad in the same process; nnsight's ratios are against it.)"
        )

    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "argv": sys.argv,
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "distgrad": distgrad.__version__,
                    "nnsight": None if a.no_nnsight else md.version("nnsight"),
                    "steps": a.steps,
                    "median_us": one,
                    "k": ks,
                    "median_us_by_k": multi,
                    "slope_us": {n: v[0] for n, v in slopes.items()},
                    "slope_se_us": {n: v[1] for n, v in slopes.items()},
                    "numerics_ok": ok,
                    "nnsight_numerics_ok": nn_ok,
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
