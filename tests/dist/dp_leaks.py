"""A data-parallel trace leaves nothing for the cycle collector (the multi-process half of
tests/test_leaks.py): the engine's gather, failure watcher and end-of-trace agreement must not
link a trace's tensors into reference cycles either, or every step's activations and gradients
stay in memory until Python's collector happens to run."""
from __future__ import annotations

import gc
import weakref
from collections import Counter

import distgrad

# backward_mode: the backward on a greenlet, and on a worker thread (what CUDA forces)
MODES = ["greenlet", "thread"]


def cyclic_garbage(step, times: int = 3) -> list:
    """What ``times`` calls of ``step`` leave that only the cycle collector frees (also used by
    tests/test_leaks.py)."""
    step()  # first-use caches (compiled bodies, kept points) are not garbage
    # Earlier garbage can take more than one pass: freeing a tensor in one pass can hand its
    # Python object back to the collector for the next (dynamo's fake tensors, left by a
    # torch.compile test in the same worker, take two). Collect until a pass finds nothing.
    for _ in range(10):
        if not gc.collect():
            break
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(times):
            step()
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    return found


def kinds(found: list) -> Counter:
    return Counter(type(obj).__name__ for obj in found)


def describe(counts: Counter) -> str:
    return ", ".join(f"{n} x {kind}" for kind, n in counts.most_common())


def readme_step(model, ids, scale: float, clear_grads):
    """The README program: read a layer's output, read and edit its gradient, save."""
    with model.trace(ids):
        a1 = model.transformer.h[0].output
        logits = model.output.logits.save()
        with (logits.sum() * scale).backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
    clear_grads()
    return logits, g


def check_no_cycles(model, ids, scale: float, clear_grads, plain_step) -> None:
    """In each mode: no tensor in cyclic garbage after traces, nor anything beyond what the
    engine leaves on its own (``plain_step()``, the same step without distgrad: FSDP1 links a
    few closures of its hooks into cycles), and the saved logits die, without gc.collect(),
    once the user drops them."""
    engine_own = kinds(cyclic_garbage(plain_step))
    old = distgrad.config.backward_mode
    try:
        for backward_mode in MODES:
            distgrad.config.backward_mode = backward_mode
            mode = f"backward_mode={backward_mode}"
            found = kinds(cyclic_garbage(lambda: readme_step(model, ids, scale, clear_grads)))
            if found["Tensor"] or found - engine_own:
                raise AssertionError(f"{mode}: {found['Tensor']} tensors in cyclic garbage: "
                                     f"{describe(found)} (the engine alone: {describe(engine_own)})")
            logits, g = readme_step(model, ids, scale, clear_grads)
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                alive = weakref.ref(logits)
                del logits, g
                if alive() is not None:
                    raise AssertionError(f"{mode}: the saved logits outlived the user's names")
            finally:
                if was_enabled:
                    gc.enable()
    finally:
        distgrad.config.backward_mode = old
