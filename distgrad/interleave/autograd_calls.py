"""``torch.autograd.backward`` and ``torch.autograd.grad`` called in an invoke body.

An invoke body sees its rows of each value: a slice of the batch's tensor (``batching.narrow``).
The batch's graph goes on from the full tensor, not from that slice, so PyTorch, called on the
slice, differentiates the wrong tensor: ``h.retain_grad()`` then ``torch.autograd.backward(loss)``
left ``h.grad`` None, ``torch.autograd.grad(loss, h)`` found ``h`` unused by the graph (and gave
None with ``allow_unused=True``), and ``loss.backward(inputs=[h])`` left ``h.grad`` None.

While a trace with invokes runs its bodies (``serving()``), the two functions are replaced by
ones that let the body's requests hear of the call first (``Requests.plain_backward``: the
retained rows are hooked up, as for ``loss.backward()``) and differentiate the full tensor in
place of a slice, handing back the slice's rows (``Requests.grad_inputs``); any other caller
(another thread, code outside the bodies) gets PyTorch's functions unchanged. They are put back
when the bodies end, so nothing stays replaced after the trace.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import torch
from torch.autograd.graph import GradientEdge

from .session import current_body

_lock = threading.Lock()
_depth = 0  # traces serving their bodies now (each thread's, nested ones)
_replaced = {}  # name -> the function torch.autograd had before
_at_import = {"backward": torch.autograd.backward, "grad": torch.autograd.grad}
# how each takes its arguments (inspect follows a wrapper's __wrapped__ to torch's own)
_SIGNATURES = {name: inspect.signature(fn) for name, fn in _at_import.items()}


@contextlib.contextmanager
def serving():
    """Replace ``torch.autograd.backward`` and ``grad`` while the block runs."""
    global _depth
    with _lock:
        if _depth == 0:
            for name, ours in _OURS.items():
                _replaced[name] = getattr(torch.autograd, name)
                setattr(torch.autograd, name, ours)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, previous in _replaced.items():
                    if getattr(torch.autograd, name) is _OURS[name]:  # (else: not ours to undo)
                        setattr(torch.autograd, name, previous)
                _replaced.clear()


def _listed(inputs) -> list:
    if isinstance(inputs, (torch.Tensor, GradientEdge)):
        return [inputs]
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def _body():
    body = current_body()
    return body if body is not None and body.requests is not None else None


def _backward(*args, **kwargs):
    real = _replaced.get("backward") or _at_import["backward"]
    body = _body()
    if body is None:
        return real(*args, **kwargs)
    bound = _SIGNATURES["backward"].bind(*args, **kwargs)
    body.requests.plain_backward(body, bound.arguments.get("tensors"))
    inputs = bound.arguments.get("inputs")
    if inputs is not None:
        rows = body.requests.grad_inputs(body, _listed(inputs))[1]
        if rows is not None and any(r is not None for r in rows):
            raise NotImplementedError(
                "backward(inputs=[...]) in an invoke body, naming the invoke's rows of a model "
                "value: those rows are a slice of the batch's tensor, which the graph goes on "
                "from, so PyTorch would leave their .grad None. Call h.retain_grad() before "
                "loss.backward() (without inputs=), or take torch.autograd.grad(loss, h)."
            )
    result = real(*args, **kwargs)
    body.requests.backward_done(body, _listed(bound.arguments.get("tensors")))
    return result


def _grad(*args, **kwargs):
    real = _replaced.get("grad") or _at_import["grad"]
    body = _body()
    if body is None:
        return real(*args, **kwargs)
    bound = _SIGNATURES["grad"].bind(*args, **kwargs)
    body.requests.plain_backward(body, bound.arguments["outputs"])
    inputs = bound.arguments["inputs"]
    keys = list(inputs) if isinstance(inputs, dict) else None
    instead, rows = body.requests.grad_inputs(body, _listed(inputs))
    if rows is None:
        return real(*args, **kwargs)
    bound.arguments["inputs"] = dict(zip(keys, instead)) if keys is not None else instead
    result = real(*bound.args, **bound.kwargs)
    lead = (slice(None),) if bound.arguments.get("is_grads_batched") else ()
    values = [result[k] for k in keys] if keys is not None else list(result)
    values = [g if g is None or r is None else g[lead + (r,)] for g, r in zip(values, rows)]
    return dict(zip(keys, values)) if keys is not None else tuple(values)


_OURS = {"backward": _backward, "grad": _grad}
