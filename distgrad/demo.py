"""The main job: ``python -m distgrad.demo [--check]``.

Runs the README program on a tiny GPT-2 (random weights from a config, nothing downloaded):
capture the gradient reaching ``transformer.h[0]`` and double it. Prints the saved gradient's
norm and every parameter gradient the edit changed. ``--check`` also runs the same step with
plain autograd and exits non-zero if any number differs.
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch

import distgrad

TEXT = "The Eiffel Tower is in"


def build():
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=384)).eval()
    return net, ByT5Tokenizer()


def traced_step(net, tokenizer):
    model = distgrad.wrap(net, tokenizer=tokenizer)
    with model.trace(TEXT):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum()
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    return g, _grads(net)


def autograd_step(net, tokenizer, factor: float):
    """The same step in plain PyTorch: a tensor hook on h[0]'s output."""
    seen = {}

    def on_output(module, args, out):
        def on_grad(grad):
            seen["grad"] = grad.clone()
            return grad * factor
        out.register_hook(on_grad)

    handle = net.transformer.h[0].register_forward_hook(on_output)
    try:
        out = net(**tokenizer([TEXT], return_tensors="pt"))
    finally:
        handle.remove()
    out.logits.sum().backward()
    return seen["grad"], _grads(net)


def _grads(net):
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    return grads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with plain autograd")
    parser.add_argument("--engine", default="local",
                        help="local (one process); under a launcher: ddp, fsdp1, fsdp2, "
                             "accelerate, zero1, zero2, zero3, tp, pp-gpipe, pp-1f1b, "
                             "pp-interleaved, deepspeed-pipe")
    parser.add_argument("--steps", type=int, default=3, help="fine-tuning steps (parallel engines)")
    parser.add_argument("--ds-config", default=None, help="DeepSpeed JSON (zero1/2/3 engines)")
    args, _ = parser.parse_known_args(argv)  # launchers may add their own flags
    if args.engine in ("pp-gpipe", "pp-1f1b", "pp-interleaved", "deepspeed-pipe"):
        from .demo_pp import run as run_pp
        return run_pp(args.engine, args.steps, args.check)
    if args.engine == "tp":
        from .demo_tp import run as run_tp
        return run_tp(args.steps, args.check)
    if args.engine != "local":
        from .demo_parallel import run
        return run(args.engine, args.steps, args.check, args.ds_config)
    net, tokenizer = build()
    g, grads = traced_step(net, tokenizer)
    _, plain = autograd_step(net, tokenizer, 1.0)
    print(f"saved gradient at transformer.h[0]: shape {list(g.shape)}, norm {g.norm():.6f}")
    print(f"\n{'parameter':40} {'grad norm (edited)':>20} {'grad norm (plain)':>20}")
    changed = [n for n in grads if not torch.allclose(grads[n], plain[n], atol=1e-6)]
    for name in changed:
        print(f"{name:40} {grads[name].norm():20.6f} {plain[name].norm():20.6f}")
    print(f"\n{len(changed)} of {len(grads)} parameter gradients changed by the edit "
          "(upstream of h[0]); the rest are unchanged.")
    if not args.check:
        return 0
    ref_g, ref = autograd_step(net, tokenizer, 2.0)
    bad = [n for n in ref if not torch.allclose(grads[n], ref[n], atol=1e-5, rtol=0)]
    if not torch.allclose(g, ref_g, atol=1e-6, rtol=0):
        bad.insert(0, "saved gradient")
    print("check against plain autograd (atol 1e-5):", "OK" if not bad else f"MISMATCH {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
