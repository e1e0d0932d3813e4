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
import importlib.metadata as md
import json
import os
import platform
import sys

import torch
import torch._dynamo
import transformers

import distgrad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_variants import (  # noqa: E402  (beside this script)
    EDITED,
    PLAIN,
    Counted,
    Variant,
    build,
    first_steps,
    forced_eager_raw_step,
    grads,
    graph_breaks,
    hook_once,
    hooked_step,
    max_diff,
    plain_step,
    table,
    timed_variants,
)
from overhead import raw_step, traced_step  # noqa: E402  (the same programs)


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
