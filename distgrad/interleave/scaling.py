"""Gradients shown unscaled under a loss scaler (``with loss.backward(scaler=scaler):``).

The backward runs on ``scaler.scale(loss)``, so every gradient autograd computes is the
plain one times the scale. ``unscale(session, scale)`` wraps the session's hand-offs (the
functions its gradient hooks call) once, when the block opens: each gradient reaches the body
divided by the scale, and what the body puts back is multiplied by it before autograd carries
it on. A gradient the body leaves alone flows on as autograd made it, untouched by the round
trip. Sessions without a scaler keep their hand-offs as they are, so the ``.grad`` hot path
costs nothing more.

float16 gradients are shown in float32: divided in float16 by a scale of 2**16, the small
values that the scaler exists to keep would flush to zero. An edit is multiplied back and
cast to the gradient's own dtype, as a hook doing the same by hand would.
"""
from __future__ import annotations

import torch

_HALF = torch.float16


def unscaled_hand_off(hand, scale: float):
    """``hand`` (``hand(key, grad)`` or ``hand(grad)``: it returns the body's reply or None),
    showing ``grad / scale`` and returning the reply times ``scale``."""

    def hand_unscaled(*args):
        grad = args[-1]
        shown = (grad.float() if grad.dtype is _HALF else grad) / scale
        reply = hand(*args[:-1], shown)
        if reply is None:
            return None
        return (reply * scale).to(grad.dtype)

    return hand_unscaled


def unscale(session, scale: float) -> None:
    """Make ``session`` (a backward block's) show its gradients divided by ``scale``."""
    session.hand = unscaled_hand_off(session.hand, scale)
    ready = getattr(session, "grad_ready", None)  # the generator path's own gradient hook
    if ready is not None:
        session.grad_ready = unscaled_hand_off(ready, scale)
