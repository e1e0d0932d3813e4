"""Gradients shown unscaled under a loss scaler (``with loss.backward(scaler=scaler):``).

The backward runs on ``scaler.scale(loss)``, so every gradient autograd computes is the
plain one times the scale. A block's session built with ``scale=`` wraps its hand-off (what
its gradient hooks call) in ``unscaled_hand_off`` once, when it is built: each gradient
reaches the body divided by the scale, and what the body puts back is multiplied by it before
autograd carries it on. A gradient the body leaves alone flows on as autograd made it,
untouched by the round trip. Sessions without a scaler keep the transport's hand-off as it
is, so the ``.grad`` hot path costs nothing more.

float16 gradients are shown in float32: divided in float16 by a scale of 2**16, the small
values that the scaler exists to keep would flush to zero. An edit is multiplied back and
cast to the gradient's own dtype, as a hook doing the same by hand would.
"""

from __future__ import annotations

import torch

_HALF = torch.float16


def unscaled_hand_off(hand, scale: float):
    """``hand`` (``hand(key, grad)``: it returns the body's reply or None), showing
    ``grad / scale`` and returning the reply times ``scale``."""

    def hand_unscaled(key, grad):
        shown = (grad.float() if grad.dtype is _HALF else grad) / scale
        reply = hand(key, shown)
        if reply is None:
            return None
        return (reply * scale).to(grad.dtype)

    return hand_unscaled
