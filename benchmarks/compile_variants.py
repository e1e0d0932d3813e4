"""The variants, counting backend and checks of compile_step.py: each compiled model's own
backend that counts its compiles and graph runs, the steps a variant runs, its check against the
eager oracle, and the table of results."""

from __future__ import annotations

import gc
import logging
import os
import statistics
import sys

import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from distgrad.demo.models import build_gpt2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import fresh, raw_step, timed  # noqa: E402  (the same programs)

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
