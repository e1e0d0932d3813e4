"""What a traced step of a torch.compile'd GPT-2 costs, against the compiled model without and
with raw hooks, the eager model with raw hooks, and nnsight 0.8.1 on the compiled model.

    python benchmarks/compile_step.py [--backend aot_eager|inductor] [--size toy|user]
                                      [--steps N] [--no-nnsight] [--json out.json]

One process, one thread, the model in eval mode (dropout off, so that every variant computes the
same function; gradients flow as in training). Each step is the README program: forward, read
h[0]'s output, backward of logits.sum() with h[0]'s gradient saved and doubled (the variants
without hooks run the same forward and backward with no edit).

Sizes: ``toy`` is the tiny GPT-2 of distgrad/demo/models.py (2 layers, d_model 64, vocabulary
384) on 2 x 8 ids; ``user`` is a GPT-2 of 6 layers, d_model 768, 12 heads, vocabulary 8192 on
2 x 128 ids.

Recompiles and graph breaks are read from dynamo: every compiled model gets its own backend,
which wraps the named one and counts its compiles (one per dynamo graph) and the runs of the
graphs it compiled; graph breaks are ``torch._dynamo.utils.counters["graph_break"]`` (dynamo
counts one each time it splits a frame while compiling), read before and after each phase.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata as md
import json
import logging
import os
import platform
import statistics
import sys

import torch
import torch._dynamo
import transformers
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

import distgrad
from distgrad.demo.models import build_gpt2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import fresh, raw_step, timed, traced_step  # noqa: E402  (the same programs)

# variant -> the oracle its parameter gradients must equal
EDITED, PLAIN = "edited", "plain"


class Counted:
    """A torch.compile backend: ``name``'s compiler, with its compiles and graph runs counted."""

    def __init__(self, name: str):
        self.inner = lookup_backend(name)
        self.compiles = 0
        self.runs = 0

    def __call__(self, graph, example_inputs):
        self.compiles += 1
        compiled = self.inner(graph, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


def bench(variants: dict, steps: int, rounds: int, warmup: int) -> dict:
    """overhead.py's interleaved rounds, with the order turned by one each round: the variant that
    runs first after the round's collector pass is slower by several percent on CI, so each
    takes that place as often as the others. Returns name -> (median, fastest) step in us."""
    for step, net, args in variants.values():
        for _ in range(warmup):
            timed(step, net, *args)
    names, per_round = list(variants), -(-steps // rounds)
    times = {name: [] for name in names}
    for r in range(rounds):
        gc.collect()
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, net, args = variants[name]
            times[name] += [timed(step, net, *args) for _ in range(per_round)]
    return {name: (statistics.median(t) / 1e3, min(t) / 1e3) for name, t in times.items()}


def forced_eager_raw_step(model, ids) -> list:
    """Raw hooks on the compiled model with its eager code forced, as distgrad forces it while
    a trace is open: the baseline a traced step adds its own cost to."""
    with torch.compiler.set_stance("force_eager"):
        return raw_step(model, ids, 1)


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def build(size: str):
    if size == "toy":
        torch.manual_seed(0)
        return build_gpt2(2), torch.randint(0, 384, (2, 8))
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    net = GPT2LMHeadModel(
        GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=8192, n_positions=128)
    ).eval()
    return net, torch.randint(0, 8192, (2, 128))


def plain_step(model, ids) -> None:
    torch.autograd.backward(model(ids).logits.sum())


def hook_once(net):
    """Raw hooks that stay on h[0] (registered before the model's first compile, so that dynamo
    traces them): the forward hook puts a tensor hook on the output that saves and doubles its
    gradient. Returns the list the gradients are saved into."""
    saved = []

    def grad_hook(g):
        saved.append(g.clone())
        return g * 2

    def fwd_hook(module, args, out):
        out.register_hook(grad_hook)

    net.transformer.h[0].register_forward_hook(fwd_hook)
    return saved


def hooked_step(model, saved, ids) -> list:
    saved.clear()
    torch.autograd.backward(model(ids).logits.sum())
    return saved


def grads(net) -> dict:
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def max_diff(got: dict, want: dict) -> tuple[float, float]:
    """(largest absolute difference, the same relative to the largest reference value)."""
    if got.keys() != want.keys():
        return float("inf"), float("inf")
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    scale = max(want[n].abs().max().item() for n in want)
    return diff, diff / scale


class Variant:
    def __init__(
        self, name, step, net, args, oracle, compiled: Counted | None, eager_numbers: bool
    ):
        self.name, self.step, self.net, self.args = name, step, net, args
        self.oracle, self.counted, self.eager_numbers = oracle, compiled, eager_numbers
        self.first_compiles = self.first_breaks = self.timed_compiles = None
        self.graphs_per_step = None
        self.ok = None
        self.compiles = self.runs = self.steps = 0  # this variant's own, while counting

    def __call__(self, *args):
        """One step, with the compiles and graph runs it caused added to this variant's counts
        (two variants may share one compiled model, and so one backend)."""
        c = self.counted
        if c is None:
            return self.step(*args)
        compiles, runs = c.compiles, c.runs
        out = self.step(*args)
        self.compiles += c.compiles - compiles
        self.runs += c.runs - runs
        self.steps += 1
        return out


def first_steps(v: Variant, oracles: dict, n: int, atol: float, rtol: float) -> bool:
    """Run ``n`` steps of ``v`` alone (the first compiles), counting compiles and graph breaks,
    and check its parameter gradients after the last against the oracle: eager-based numbers to
    ``atol`` absolute, compiled ones to ``rtol`` of the largest gradient (a compiler may fuse and
    reorder sums)."""
    v.compiles = 0
    breaks0, graphs0 = graph_breaks(), counters["stats"]["unique_graphs"]
    for _ in range(n):
        fresh(v.net)
        v(*v.args)
    diff, rel = max_diff(grads(v.net), oracles[v.oracle])
    v.ok = diff <= atol if v.eager_numbers else rel <= rtol
    v.first_compiles = v.compiles if v.counted else counters["stats"]["unique_graphs"] - graphs0
    v.first_breaks = graph_breaks() - breaks0
    bound = f"atol {atol:g}" if v.eager_numbers else f"{rtol:g} of the largest gradient"
    print(
        f"numerics {v.name}: {'OK' if v.ok else 'MISMATCH'} against the {v.oracle} eager "
        f"oracle (max |diff| {diff:.2e}, relative {rel:.2e}; bound {bound}); first {n} steps: "
        f"{v.first_compiles} graphs compiled, {v.first_breaks} graph breaks"
    )
    return v.ok


def timed_variants(
    variants: list[Variant], steps: int, rounds: int, warmup: int
) -> tuple[dict, int]:
    """Median and fastest ms per step of each variant (rounds interleaved), counting compiles and
    graph runs over the warm-up and timed steps; returns ({name: (median, fastest)}, graph
    breaks over the whole run)."""
    for v in variants:
        v.compiles = v.runs = v.steps = 0
    breaks0 = graph_breaks()
    us = bench({v.name: (v, v.net, v.args) for v in variants}, steps, rounds=rounds, warmup=warmup)
    for v in variants:
        if v.counted:
            v.timed_compiles = v.compiles
            v.graphs_per_step = v.runs / v.steps
    return {name: (m / 1e3, f / 1e3) for name, (m, f) in us.items()}, graph_breaks() - breaks0


def table(variants: list[Variant], ms: dict, compiled_name: str, eager_name: str) -> list[dict]:
    """The printed table; ratios by the median step, then by the fastest (on a shared machine
    the fastest step is the one least slowed by other jobs)."""
    print(
        "| variant | median / fastest ms per step | vs compiled | vs eager raw hooks | graphs "
        "compiled (first steps / timed) | graph breaks (first steps) | compiled graphs run per "
        "step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for v in variants:
        (med, fast), (c_med, c_fast), (e_med, e_fast) = (
            ms[v.name],
            ms[compiled_name],
            ms[eager_name],
        )
        per_step = "-" if v.graphs_per_step is None else f"{v.graphs_per_step:g}"
        timed_c = "-" if v.timed_compiles is None else v.timed_compiles
        print(
            f"| {v.name} | {med:.2f} / {fast:.2f} | {med / c_med:.2f}x / {fast / c_fast:.2f}x | "
            f"{med / e_med:.2f}x / {fast / e_fast:.2f}x | {v.first_compiles} / {timed_c} | "
            f"{v.first_breaks} | {per_step} |"
        )
        rows.append(
            {
                "variant": v.name,
                "median_ms": med,
                "fastest_ms": fast,
                "vs_compiled": med / c_med,
                "vs_eager_raw_hooks": med / e_med,
                "fastest_vs_compiled": fast / c_fast,
                "fastest_vs_eager_raw_hooks": fast / e_fast,
                "compiles_first_steps": v.first_compiles,
                "compiles_timed": v.timed_compiles,
                "graph_breaks_first_steps": v.first_breaks,
                "compiled_graphs_per_step": v.graphs_per_step,
                "numerics_ok": v.ok,
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    p.add_argument("--size", default="toy", choices=("toy", "user"))
    p.add_argument("--steps", type=int, help="timed steps per variant (toy 200, user 20)")
    p.add_argument("--no-nnsight", action="store_true")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    toy = a.size == "toy"
    steps = a.steps or (200 if toy else 20)
    rounds, warmup = (20, 10) if toy else (5, 1)
    torch.set_num_threads(1)
    print(f"command: {' '.join([sys.executable] + sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, distgrad {distgrad.__version__}, nnsight "
        f"{'(skipped)' if a.no_nnsight else md.version('nnsight')}, threads "
        f"{torch.get_num_threads()}, backend {a.backend}, size {a.size}, eval mode"
    )

    base, ids = build(a.size)
    copies = lambda: copy.deepcopy(base)

    # The oracles: eager, with the README edit made by raw hooks, and without any edit.
    oracles = {}
    net = copies()
    raw_step(net, ids, 1)
    oracles[EDITED] = grads(net)
    net = copies()
    plain_step(net, ids)
    oracles[PLAIN] = grads(net)

    def compiled_copy():
        net, counted = copies(), Counted(a.backend)
        return net, torch.compile(net, backend=counted), counted

    eager_net, eager_hooked = copies(), copies()
    c_net, c_model, c_counted = compiled_copy()
    h_net = copies()
    h_saved = hook_once(h_net)  # before the compile: dynamo traces hooks present when it runs
    h_counted = Counted(a.backend)
    h_model = torch.compile(h_net, backend=h_counted)
    f_net, f_model, f_counted = compiled_copy()
    d_net, d_compiled, d_counted = compiled_copy()
    d_model = distgrad.wrap(d_compiled, tokenizer=None)

    variants = [
        Variant("eager, no hooks", plain_step, eager_net, (eager_net, ids), PLAIN, None, True),
        Variant(
            "eager, raw hooks", raw_step, eager_hooked, (eager_hooked, ids, 1), EDITED, None, True
        ),
        Variant("compiled, no hooks", plain_step, c_net, (c_model, ids), PLAIN, c_counted, False),
        Variant(
            "compiled, raw hooks",
            hooked_step,
            h_net,
            (h_model, h_saved, ids),
            EDITED,
            h_counted,
            False,
        ),
        Variant(
            "compiled, forced eager, raw hooks",
            forced_eager_raw_step,
            f_net,
            (f_model, ids),
            EDITED,
            f_counted,
            True,
        ),
        Variant(
            "compiled, between distgrad traces",
            plain_step,
            d_net,
            (d_compiled, ids),
            PLAIN,
            d_counted,
            False,
        ),
        Variant(
            "distgrad trace of the compiled model",
            traced_step,
            d_net,
            (d_model, ids),
            EDITED,
            d_counted,
            True,
        ),
    ]
    atol, rtol = 1e-5, 1e-4
    n_first = 2
    # The compiled model distgrad wraps runs a compiled step first (its first compile), then
    # traced steps, then compiled steps again: what tracing adds to that model shows in the
    # counts of the last two.
    ok = all([first_steps(v, oracles, n_first, atol, rtol) for v in variants])
    compiles0, breaks0 = d_counted.compiles, graph_breaks()
    plain_step(d_compiled, ids)
    d_net.zero_grad(set_to_none=True)
    after_trace = (d_counted.compiles - compiles0, graph_breaks() - breaks0)
    print(
        f"the compiled step right after distgrad's traces: {after_trace[0]} graphs compiled, "
        f"{after_trace[1]} graph breaks"
    )

    # Raw hooks put on a model after its first compile: dynamo keeps the graph it traced without
    # them unless it guards on module hooks.
    l_net, l_model, l_counted = compiled_copy()
    plain_step(l_model, ids)
    l_net.zero_grad(set_to_none=True)
    compiles0 = l_counted.compiles
    late_saved = raw_step(l_model, ids, 1)
    late = {
        "hooks_ran": bool(late_saved),
        "grads_equal_edited_oracle": max_diff(grads(l_net), oracles[EDITED])[1] <= rtol,
        "graphs_compiled": l_counted.compiles - compiles0,
        "skip_nnmodule_hook_guards": torch._dynamo.config.skip_nnmodule_hook_guards,
    }
    print(
        f"raw hooks added after the model's first compile: hooks ran {late['hooks_ran']}, "
        f"parameter gradients equal the edited oracle {late['grads_equal_edited_oracle']}, "
        f"{late['graphs_compiled']} graphs compiled (torch._dynamo.config."
        f"skip_nnmodule_hook_guards = {late['skip_nnmodule_hook_guards']})"
    )

    ms, timed_breaks = timed_variants(variants, steps, rounds, warmup)
    print(
        f"\n## One step, {a.size} GPT-2, backend {a.backend}, {steps} steps "
        f"(graph breaks over all timed steps: {timed_breaks})\n"
    )
    rows = table(variants, ms, "compiled, no hooks", "eager, raw hooks")
    for v in variants:
        if v.counted and not v.eager_numbers and not v.graphs_per_step:
            print(f"WARNING: {v.name} ran no compiled graph (dynamo fell back to eager)")
            ok = False
    # The goal that does not drift with the machine: tracing compiles nothing, breaks no graph
    # and runs no compiled graph, and the compiled model's steps around it compile nothing more.
    traced, between = variants[-1], variants[-2]
    counts = {
        "traced steps: graphs compiled": traced.first_compiles + traced.timed_compiles,
        "traced steps: graph breaks": traced.first_breaks,
        "traced steps: compiled graphs run": traced.graphs_per_step,
        "compiled step after a trace: graphs compiled": after_trace[0] + between.timed_compiles,
        "graph breaks over the timed steps": timed_breaks,
    }
    for what, n in counts.items():
        if n:
            print(f"FAIL: {what}: {n}, expected 0")
            ok = False

    nn = None
    if not a.no_nnsight:
        nn = nnsight_phase(a, copies, ids, oracles, steps, rounds, warmup, atol, rtol)

    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "argv": sys.argv,
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "distgrad": distgrad.__version__,
                    "backend": a.backend,
                    "size": a.size,
                    "steps": steps,
                    "rows": rows,
                    "timed_graph_breaks": timed_breaks,
                    "step_after_trace": {
                        "graphs_compiled": after_trace[0],
                        "graph_breaks": after_trace[1],
                    },
                    "hooks_added_after_compile": late,
                    "nnsight": nn,
                    "numerics_ok": ok,
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


def nnsight_phase(a, copies, ids, oracles, steps, rounds, warmup, atol, rtol) -> dict | None:
    """nnsight on the compiled model, timed beside the two baselines re-timed in its phase.
    nnsight last: importing it replaces Tensor.backward for the rest of the process, so
    distgrad's import-time patches are undone first (as in overhead.py)."""
    torch.Tensor.backward = getattr(torch.Tensor.backward, "__wrapped__", torch.Tensor.backward)
    for patched in ("save", "grad"):
        if patched in torch.Tensor.__dict__:
            delattr(torch.Tensor, patched)
    from nnsight import NNsight

    print("\n## nnsight 0.8.1 on the compiled model\n")
    eager_hooked = copies()
    c_net, c_counted = copies(), Counted(a.backend)
    c_model = torch.compile(c_net, backend=c_counted)
    n_net, n_counted = copies(), Counted(a.backend)
    n_model = NNsight(torch.compile(n_net, backend=n_counted))
    variants = [
        Variant(
            "eager, raw hooks (nnsight phase)",
            raw_step,
            eager_hooked,
            (eager_hooked, ids, 1),
            EDITED,
            None,
            True,
        ),
        Variant(
            "compiled, no hooks (nnsight phase)",
            plain_step,
            c_net,
            (c_model, ids),
            PLAIN,
            c_counted,
            False,
        ),
        Variant(
            "nnsight trace of the compiled model",
            traced_step,
            n_net,
            (n_model, ids),
            EDITED,
            n_counted,
            False,
        ),
    ]
    try:
        for v in variants:
            first_steps(v, oracles, 2, atol, rtol)
        ms, timed_breaks = timed_variants(variants, steps, rounds, warmup)
    except Exception as e:  # nnsight's failure is a result here, not the benchmark's
        print(f"nnsight on the compiled model failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}
    print(f"(graph breaks over all timed steps: {timed_breaks})\n")
    rows = table(variants, ms, variants[1].name, variants[0].name)
    return {"rows": rows, "timed_graph_breaks": timed_breaks}


if __name__ == "__main__":
    sys.exit(main())
