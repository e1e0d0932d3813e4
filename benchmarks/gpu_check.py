"""The checks to run when a GPU is available: the core program on CUDA, where autograd calls
tensor hooks on its own device threads (so distgrad hands the backward to a worker thread).

    .venv/bin/python benchmarks/gpu_check.py                    # on a CUDA machine
    .venv/bin/python benchmarks/gpu_check.py --device cpu --backward-mode thread   # a dry run

1. Parity: the README program (read h[0].output, save and double its gradient) against plain
   autograd on the same device: the saved gradient, and every parameter gradient (atol 1e-5).
2. Invokes: two invokes in one batch, each reading and editing its own rows' gradient.
3. Threads: which threads the hooks fired on, and no growth in threads over 200 traces.
4. Cost: a traced step against the same step with raw hooks, median of --steps, in turns.

Prints one line per check and exits non-zero if any fails. Tested on the CPU only (dry run).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

import distgrad
from overhead import make_net, raw_step, traced_step

ATOL = 1e-5


def plain(net, ids):
    """One process, plain autograd: h[0]'s output gradient, then the parameter gradients with
    that gradient doubled on its way upstream."""
    kept = []

    def hook(module, args, out):
        out.retain_grad()
        kept.append(out)
        out.register_hook(lambda g: g * 2)

    handle = net.transformer.h[0].register_forward_hook(hook)
    try:
        net(ids).logits.sum().backward()
    finally:
        handle.remove()
    # retain_grad keeps the gradient after the doubling hook ran
    return kept[0].grad / 2, {n: p.grad.clone() for n, p in net.named_parameters()}


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backward-mode", default="auto", choices=("auto", "greenlet", "thread"))
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --backward-mode thread for a dry run")
        return 2
    device = torch.device(args.device)
    distgrad.config.backward_mode = args.backward_mode
    torch.manual_seed(0)
    ids = torch.randint(0, 384, (2, 8), device=device)
    net = make_net(2).to(device)
    model = distgrad.wrap(net)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    good = True

    # 1. parity
    ref_g, ref_params = plain(net, ids)
    net.zero_grad(set_to_none=True)
    fired_on = set()
    with model.trace(ids):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum()
        a1.register_hook(lambda g: fired_on.add(threading.current_thread().name))
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    diff = (g - ref_g).abs().max().item()
    good &= check("saved gradient equals plain autograd", diff <= ATOL, f"max diff {diff:.2e}")
    worst = max((p.grad - ref_params[n]).abs().max().item() for n, p in net.named_parameters())
    good &= check("parameter gradients equal plain autograd with the edit", worst <= ATOL,
                  f"max diff {worst:.2e}")
    print(f"     hooks fired on: {sorted(fired_on)}; body thread: "
          f"{threading.current_thread().name}")

    # 2. invokes: each edits its own row's gradient
    net.zero_grad(set_to_none=True)
    with model.trace() as tr:
        with tr.invoke(ids[:1]):
            a = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                ga = a.grad.save()
                a.grad = a.grad * 2
        with tr.invoke(ids[1:]):
            b = model.transformer.h[0].output
            with model.output.logits.sum().backward():
                gb = b.grad.save()
                b.grad = b.grad * 2
    diff = (torch.cat([ga, gb]) - ref_g).abs().max().item()
    good &= check("invokes: each row's gradient", diff <= ATOL, f"max diff {diff:.2e}")
    worst = max((p.grad - ref_params[n]).abs().max().item() for n, p in net.named_parameters())
    good &= check("invokes: parameter gradients", worst <= ATOL, f"max diff {worst:.2e}")

    # 3. no thread growth
    traced_step(model, ids)
    before = threading.active_count()
    for _ in range(200):
        traced_step(model, ids)
    good &= check("no thread growth over 200 traces", threading.active_count() == before,
                  f"{before} -> {threading.active_count()}")

    # 4. cost, in turns
    times = {"raw hooks": [], "distgrad": []}
    for _ in range(args.steps // 10):
        for name in times:
            for _ in range(10):
                net.zero_grad(set_to_none=True)
                sync()
                t0 = time.perf_counter_ns()
                raw_step(net, ids, 1) if name == "raw hooks" else traced_step(model, ids)
                sync()
                times[name].append(time.perf_counter_ns() - t0)
    raw_us, dg_us = (statistics.median(times[n]) / 1e3 for n in ("raw hooks", "distgrad"))
    print(f"     step: raw hooks {raw_us:.0f} us, distgrad {dg_us:.0f} us, ratio "
          f"{dg_us / raw_us:.2f}x (device {device}, backward_mode {args.backward_mode})")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
