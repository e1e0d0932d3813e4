"""A step at a size users run: a 12-layer GPT-2 (d_model 256, 8 heads, vocabulary 8192) on
4 x 128 tokens per rank, saving every layer's output and the gradient reaching it, and
doubling the gradient of layer 6.

    python benchmarks/realistic.py [--steps 20]                              # one process
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/realistic.py    # DDP, 2 ranks
    python benchmarks/realistic.py --backward-mode thread    # the backward as CUDA runs it
    python benchmarks/realistic.py --memory [--steps 20]     # peak memory of a traced loop

Variants, taking turns in rounds: raw hooks (forward hooks keep each output, tensor hooks each
gradient; under DDP followed by one all_gather per saved tensor to bring every rank's rows to
rank 0, what a user writes by hand), distgrad, and on one process nnsight 0.8.1 (it has no
data-parallel support). Before timing, every variant's saved values and parameter gradients
are checked against raw hooks (atol 1e-5). Prints the median ms per step and the ratio to raw
hooks (rank 0).

``--memory`` runs each variant alone in a fresh process for ``--steps`` steps and prints its
peak resident memory (``ru_maxrss``: the model, its activations and gradients, what the
variant keeps) and the ratio to raw hooks'. glibc's malloc is made deterministic in those
processes (``MALLOC_MMAP_THRESHOLD_=65536``: large blocks are mapped and returned at once),
since its adaptive threshold otherwise moves the peak by tens of MiB from run to run.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import distgrad

logging.getLogger("transformers").setLevel(logging.ERROR)
LAYERS, EDITED = 12, 6


def build():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_embd=256, n_head=8, vocab_size=8192)
    return GPT2LMHeadModel(config).eval()  # no dropout: every variant computes one function


def raw_step(net, wrapped, ids, gather):
    """Hooks on the user's blocks; the step through the engine's wrapper (DDP), if any."""
    outputs, grads = [None] * LAYERS, [None] * LAYERS
    handles = []
    for i, block in enumerate(net.transformer.h):

        def on_output(module, args, out, i=i):
            outputs[i] = out.detach()

            def on_grad(g):
                grads[i] = g
                return g * 2 if i == EDITED else None

            out.register_hook(on_grad)

        handles.append(block.register_forward_hook(on_output))
    try:
        (wrapped(ids).logits.sum() * 1e-3).backward()
    finally:
        for handle in handles:
            handle.remove()
    return [gather(t) for t in outputs], [gather(t) for t in grads]


def distgrad_step(model, ids):
    with model.trace(ids):
        blocks = [model.transformer.h[i].output for i in range(LAYERS)]
        outputs = [b.save() for b in blocks]
        with (model.output.logits.sum() * 1e-3).backward():
            grads = [None] * LAYERS
            for i in reversed(range(LAYERS)):
                grads[i] = blocks[i].grad.save()
                if i == EDITED:
                    blocks[i].grad = blocks[i].grad * 2
    return outputs, grads


def nnsight_step(lm, ids):
    # nnsight gives back only saved names after its trace: fill lists made before it
    outputs, grads = [], [None] * LAYERS
    with lm.trace(ids):
        blocks = [lm.transformer.h[i].output for i in range(LAYERS)]
        outputs.extend(b.save() for b in blocks)
        loss = lm.output.logits.sum() * 1e-3
        with loss.backward():
            for i in reversed(range(LAYERS)):
                grads[i] = blocks[i].grad.save()
                if i == EDITED:
                    blocks[i].grad = blocks[i].grad * 2
    return outputs, grads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-nnsight", action="store_true")
    parser.add_argument(
        "--backward-mode",
        default="auto",
        choices=("auto", "greenlet", "thread"),
        help="distgrad.config.backward_mode (thread: what a CUDA backward uses)",
    )
    parser.add_argument("--memory", action="store_true", help="peak memory, a process a variant")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one variant's loop (--memory)
    args = parser.parse_args()
    distgrad.config.backward_mode = args.backward_mode
    if args.memory:
        return peak_memory(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = world > 1
    if ranks:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ranks else 0
    net = build()
    wrapped = torch.nn.parallel.DistributedDataParallel(net) if ranks else net
    ids = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(rank))

    def gather(t):
        if not ranks:
            return t
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts) if rank == 0 else t

    model = distgrad.wrap(wrapped)
    variants = {
        "raw hooks": lambda: raw_step(net, wrapped, ids, gather),
        "distgrad": lambda: distgrad_step(model, ids),
    }
    if not ranks and not args.no_nnsight and args.only in (None, "nnsight"):
        from nnsight import NNsight

        lm = NNsight(net)
        variants["nnsight"] = lambda: nnsight_step(lm, ids)

    if args.only is not None:  # one variant's loop in a process of its own (peak_memory)
        for _ in range(args.steps):
            net.zero_grad(set_to_none=True)
            variants[args.only]()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
        return
    base_out, base_grads = variants["raw hooks"]()
    base_params = [p.grad.clone() for p in net.parameters()]
    for name, fn in variants.items():
        net.zero_grad(set_to_none=True)
        out, grads = fn()
        diff = max((a - b).abs().max().item() for a, b in zip(out + grads, base_out + base_grads))
        diff = max(
            [diff]
            + [(p.grad - q).abs().max().item() for p, q in zip(net.parameters(), base_params)]
        )
        assert diff <= 1e-5, f"{name}: differs from raw hooks by {diff:.3g}"
    times = {name: [] for name in variants}
    for _ in range(args.steps):
        for name, fn in variants.items():
            net.zero_grad(set_to_none=True)
            if ranks:
                dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        base = statistics.median(times["raw hooks"])
        print(
            f"{LAYERS}-layer GPT-2, d_model 256, 4 x 128 tokens per rank, {world} rank(s), "
            f"{args.steps} steps each, torch {torch.__version__}"
        )
        for name, t in times.items():
            median = statistics.median(t)
            print(f"{name:10s} {median * 1e3:9.1f} ms/step  {median / base:5.2f}x raw hooks")
    if ranks:
        dist.destroy_process_group()


def peak_memory(args) -> None:
    """Each variant's loop in a fresh process; its peak resident memory against raw hooks'."""
    names = ["raw hooks", "distgrad"] + ([] if args.no_nnsight else ["nnsight"])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    peaks = {}
    for name in names:
        argv = [
            sys.executable,
            __file__,
            "--only",
            name,
            "--steps",
            str(args.steps),
            "--backward-mode",
            args.backward_mode,
        ]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        peaks[name] = int(done.stdout.split()[-1]) / 1024
    print(
        f"{LAYERS}-layer GPT-2, d_model 256, 4 x 128 tokens, 1 rank, peak resident memory "
        f"over {args.steps} steps, a process each, torch {torch.__version__}"
    )
    for name, peak in peaks.items():
        print(f"{name:10s} {peak:9.1f} MiB  {peak / peaks['raw hooks']:5.2f}x raw hooks")


if __name__ == "__main__":
    main()
