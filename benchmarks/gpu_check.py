"""The checks to run when a GPU is available: every engine that runs on one rank, on CUDA,
where autograd calls tensor hooks on its own device threads (so distgrad hands the backward to
a worker thread under ``backward_mode="auto"``).

    .venv/bin/python benchmarks/gpu_check.py [--quick]          # on a CUDA machine
    .venv/bin/python benchmarks/gpu_check.py --device cpu --backward-mode thread   # a dry run

One process, one rank: the script starts a one-rank process group itself (nccl on CUDA, gloo on
the CPU; MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK are set where absent).

1. Engines: the plain module, DDP, FSDP1, FSDP2, DeepSpeed ZeRO-1/2/3 (skipped, with the reason,
   where ``import deepspeed`` fails) and accelerate, each on a fresh tiny GPT-2 built the way
   ``distgrad.demo.ranks.wrap_with_engine`` builds it. Each runs the README program (read
   ``h[0].output``, save its gradient and double it) against plain autograd on the same device:
   the saved gradient, and every parameter's gradient read through the model
   (``model.<path>.grad``: the full, reduced gradient on every engine). The loss is
   ``logits.sum() * 1e-3``, as in tests/dist/job.py, so that gradients are of order 1 and
   atol 1e-5 tests fp32 summation order rather than magnitude. Each line also names the threads
   the tensor hooks fired on (under ``--backward-mode auto`` on CUDA: distgrad's worker thread).
2. Invokes (plain module): two invokes in one batch, each reading and editing its own rows.
3. Threads (plain module): no growth in threads over --traces traces.
4. Cost (plain module): a traced step against the same step with raw hooks, medians of --steps
   steps taken in turns of 10; then nnsight 0.8.1 against raw hooks re-timed beside it
   (nnsight last: importing it patches torch for good, so distgrad's patches are undone first,
   as in overhead.py). nnsight's parity with raw hooks is checked before it is timed.

Prints one line per check and the total time; exits non-zero if any check fails, and with the
stacks of every thread if the run passes --budget seconds (a hang).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import logging
import os
import socket
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
from overhead import raw_step, traced_step

import distgrad
from distgrad.demo import ranks
from distgrad.demo.models import build_gpt2

ATOL = 1e-5
SCALE = 1e-3  # gradients of order 1 (see the docstring)
ENGINES = ("local", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3", "accelerate")


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def plain(ids, device):
    """Plain autograd on a fresh model: h[0]'s output gradient, and every parameter's gradient
    with that gradient doubled on its way upstream."""
    net = build_gpt2().to(device)
    seen = {}

    def on_output(module, args, out):
        def on_grad(g):
            seen["g0"] = g.detach().clone()
            return g * 2

        out.register_hook(on_grad)

    net.transformer.h[0].register_forward_hook(on_output)
    (net(ids).logits.sum() * SCALE).backward()
    return seen["g0"], {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def readme_step(model, ids):
    """The README program through distgrad; returns the saved gradient and the threads the
    tensor hooks fired on."""
    fired_on = set()
    with model.trace(ids):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum() * SCALE
        a1.register_hook(lambda g: fired_on.add(threading.current_thread().name))
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    return g, fired_on


def through_model(model, name):
    """``model.transformer.h[0].mlp.c_fc.weight`` for ``transformer.h.0.mlp.c_fc.weight``."""
    obj = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def worst_diff(got, want) -> float:
    if got is None:
        return float("inf")
    if hasattr(got, "full_tensor"):  # a DTensor, should an engine hand one back
        got = got.full_tensor()
    if got.shape != want.shape:
        return float("inf")
    return (got.detach().to(want.device, want.dtype) - want).abs().max().item()


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


_PORTS_SET: list[str] = []


def one_rank_group(device: torch.device) -> None:
    """A one-rank process group, started (again, after a failure destroyed it) as the demos
    start theirs."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if os.environ.get("MASTER_PORT") in (None, "", *_PORTS_SET):  # a fresh one on a restart
        _PORTS_SET.append(free_port())
        os.environ["MASTER_PORT"] = _PORTS_SET[-1]
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", str(device.index or 0))):
        os.environ.setdefault(key, value)
    if device.type == "cpu":
        os.environ["DISTGRAD_DEVICE"] = "cpu"  # ranks.device(): the CPU even where CUDA is
    if ranks.device() != device:
        raise SystemExit(
            f"--device {device}, but this rank's device is {ranks.device()} "
            "(LOCAL_RANK picks the GPU)"
        )
    ranks.start_process_group("ddp")
    if dist.get_world_size() != 1:
        raise SystemExit(f"one rank expected, WORLD_SIZE is {dist.get_world_size()}")


def build(engine: str, device: torch.device):
    """(the engine's wrapper, distgrad's model, a note for the line) for one engine."""
    net = build_gpt2()
    if engine == "local":
        net = net.to(device)
        return net, distgrad.wrap(net), ""
    one_rank_group(device)
    if engine.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend())
    wrapped, options = ranks.wrap_with_engine(engine, net, lr=0.0)
    note = ""
    if engine == "accelerate":
        acc = options["accelerator"]
        note = f" [{acc.distributed_type.value}, prepared {type(wrapped).__name__}]"
    return wrapped, distgrad.wrap(wrapped, accelerator=options.get("accelerator")), note


def deepspeed_missing() -> str | None:
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return None


def check_engines(device, ids, skip) -> bool:
    ref_g, ref_params = plain(ids, device)
    good = True
    missing = None
    for engine in ENGINES:
        if engine in skip:
            print(f"skip {engine}: --skip", flush=True)
            continue
        if engine.startswith("zero"):
            missing = missing or deepspeed_missing()
            if missing:
                print(f"skip {engine}: import deepspeed failed ({missing})", flush=True)
                continue
        t0 = time.perf_counter()
        wrapped = model = None
        try:
            wrapped, model, note = build(engine, device)
            g, fired_on = readme_step(model, ids)
            g_diff = worst_diff(g, ref_g)
            p_diff, worst_name = max(
                (worst_diff(through_model(model, n).grad, want), n)
                for n, want in ref_params.items()
            )
            ok = g_diff <= ATOL and p_diff <= ATOL
            good &= check(
                f"{engine}: README program",
                ok,
                f"saved gradient max diff {g_diff:.2e}, {len(ref_params)} parameter "
                f"gradients max diff {p_diff:.2e}{f' ({worst_name})' if p_diff else ''}; hooks on "
                f"{sorted(fired_on)}; {time.perf_counter() - t0:.1f} s{note}",
            )
        except Exception as exc:
            traceback.print_exc()
            good &= check(f"{engine}: README program", False, f"{type(exc).__name__}: {exc}")
        finally:
            del wrapped, model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return good


def check_invokes(model, net, ids, ref_g, ref_params) -> bool:
    net.zero_grad(set_to_none=True)
    with model.trace() as tr:
        with tr.invoke(ids[:1]):
            a = model.transformer.h[0].output
            with (model.output.logits.sum() * SCALE).backward():
                ga = a.grad.save()
                a.grad = a.grad * 2
        with tr.invoke(ids[1:]):
            b = model.transformer.h[0].output
            with (model.output.logits.sum() * SCALE).backward():
                gb = b.grad.save()
                b.grad = b.grad * 2
    diff = worst_diff(torch.cat([ga, gb]), ref_g)
    good = check("local: invokes, each row's gradient", diff <= ATOL, f"max diff {diff:.2e}")
    worst = max(worst_diff(p.grad, ref_params[n]) for n, p in net.named_parameters())
    return good & check(
        "local: invokes, parameter gradients", worst <= ATOL, f"max diff {worst:.2e}"
    )


def timed_in_turns(variants: dict, steps: int, sync) -> dict:
    """name -> step function: median us of ``steps`` steps each, in turns of 10."""
    for step in variants.values():  # warm-up
        for _ in range(5):
            step()
    times = {name: [] for name in variants}
    for _ in range(max(1, steps // 10)):
        for name, step in variants.items():
            for _ in range(10):
                sync()
                t0 = time.perf_counter_ns()
                step()
                sync()
                times[name].append(time.perf_counter_ns() - t0)
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def main() -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backward-mode", default="auto", choices=("auto", "greenlet", "thread"))
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    parser.add_argument("--traces", type=int, default=200, help="traces for the thread check")
    parser.add_argument("--quick", action="store_true", help="--steps 50 --traces 50")
    parser.add_argument("--skip", nargs="*", default=(), choices=ENGINES, help="engines to skip")
    parser.add_argument("--no-nnsight", action="store_true")
    parser.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds: past this, print every thread's stack and exit 1",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.traces = 50, 50
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --backward-mode thread for a dry run")
        return 2
    faulthandler.dump_traceback_later(args.budget, exit=True)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    logging.getLogger("transformers").setLevel(logging.ERROR)
    distgrad.config.backward_mode = args.backward_mode
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, 384, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    print(
        f"device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"torch {torch.__version__}, distgrad {distgrad.__version__}, backward_mode "
        f"{args.backward_mode}, body thread {threading.current_thread().name}; "
        f"tolerance atol {ATOL:g} on a loss of logits.sum() * {SCALE:g}",
        flush=True,
    )

    # 1. every engine that runs on one rank
    good = check_engines(device, ids, set(args.skip))

    # 2.-4. on the plain module
    net = build_gpt2().to(device)
    model = distgrad.wrap(net)
    ref_g, ref_params = plain(ids, device)
    good &= check_invokes(model, net, ids, ref_g, ref_params)

    traced_step(model, ids)
    before = threading.active_count()
    for _ in range(args.traces):
        traced_step(model, ids)
    good &= check(
        f"local: no thread growth over {args.traces} traces",
        threading.active_count() == before,
        f"{before} -> {threading.active_count()}",
    )

    def raw(n=net):
        n.zero_grad(set_to_none=True)
        return raw_step(n, ids, 1)

    def traced(m=model, n=net):
        n.zero_grad(set_to_none=True)
        return traced_step(m, ids)

    us = timed_in_turns({"raw hooks": raw, "distgrad": traced}, args.steps, sync)
    print(
        f"     step (median of {args.steps // 10 * 10}, in turns): raw hooks "
        f"{us['raw hooks']:.0f} us, distgrad {us['distgrad']:.0f} us, ratio "
        f"{us['distgrad'] / us['raw hooks']:.2f}x",
        flush=True,
    )

    if args.no_nnsight:
        print("skip nnsight: --no-nnsight")
    else:
        good &= time_nnsight(net, ids, args.steps, sync, us["distgrad"])
    dist.destroy_process_group() if dist.is_initialized() else None
    faulthandler.cancel_dump_traceback_later()
    print(
        f"{'all checks passed' if good else 'SOME CHECKS FAILED'}; total "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0 if good else 1


def time_nnsight(net, ids, steps, sync, distgrad_us) -> bool:
    """nnsight 0.8.1 on its own copy of the plain module, against raw hooks re-timed beside it.
    Last: importing nnsight replaces Tensor.backward and mounts .save() for good; distgrad's own
    import-time patches are undone first so that nnsight's path is nnsight's alone."""
    torch.Tensor.backward = getattr(torch.Tensor.backward, "__wrapped__", torch.Tensor.backward)
    for patched in ("save", "grad"):  # torch itself defines neither on torch.Tensor
        if patched in torch.Tensor.__dict__:
            delattr(torch.Tensor, patched)
    try:
        import importlib.metadata as md

        from nnsight import NNsight

        version = md.version("nnsight")
    except Exception as exc:
        print(f"skip nnsight: {type(exc).__name__}: {exc}")
        return True
    nn_net = copy.deepcopy(net)
    nn_model = NNsight(nn_net)

    def raw(n=net):
        n.zero_grad(set_to_none=True)
        return raw_step(n, ids, 1)

    def traced(m=nn_model, n=nn_net):
        n.zero_grad(set_to_none=True)
        return traced_step(m, ids)

    ref_net = copy.deepcopy(net)
    want = raw(ref_net)
    got = traced()
    diffs = [worst_diff(a, b) for a, b in zip(got, want)] + [
        worst_diff(q.grad, p.grad) for p, q in zip(ref_net.parameters(), nn_net.parameters())
    ]
    largest = max(p.grad.abs().max().item() for p in ref_net.parameters())
    # this step's loss is logits.sum(), unscaled: the tolerance is relative to its gradients
    ok = check(
        f"nnsight {version}: README program equals raw hooks",
        len(got) == len(want) and max(diffs) <= ATOL * largest,
        f"max diff {max(diffs):.2e}, tolerance atol {ATOL:g} x the largest gradient "
        f"({largest:.0f})",
    )
    us = timed_in_turns({"raw hooks": raw, "nnsight": traced}, steps, sync)
    print(
        f"     step (median of {steps // 10 * 10}, in turns): raw hooks {us['raw hooks']:.0f} "
        f"us, nnsight {us['nnsight']:.0f} us, ratio {us['nnsight'] / us['raw hooks']:.2f}x; "
        f"nnsight / distgrad {us['nnsight'] / distgrad_us:.2f}x (raw hooks re-timed: the "
        f"ratios are against the baseline of the same phase)",
        flush=True,
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
