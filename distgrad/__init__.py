"""distgrad: read and edit activations and gradients during a real forward and backward pass.

    model = distgrad.wrap(net, tokenizer=tok)
    with model.trace("The Eiffel Tower is in"):
        a1 = model.transformer.h[0].output
        loss = model.output.logits.sum()
        with loss.backward():
            g = a1.grad.save()
            a1.grad = a1.grad * 2
"""
from __future__ import annotations

from . import engines, gradpatch, saving
from .backward import BackwardTracer, config
from .errors import NotSavedError, OutOfOrderError, RankFailedError, TraceStateError
from .saving import save
from .trace import Model, Trace

__version__ = "0.1.0"


def wrap(module, tokenizer=None) -> Model:
    """Wrap a module (or an engine's wrapper of one) for tracing.

    Args:
        module: any ``torch.nn.Module``.
        tokenizer: used by ``trace()`` to turn a ``str`` or ``list[str]`` into model inputs.
    Returns:
        a :class:`Model` whose attributes mirror the module tree.
    """
    return Model(engines.select(module), tokenizer=tokenizer)


BackwardTracer.install()
saving.install()
gradpatch.install()

__all__ = ["wrap", "save", "BackwardTracer", "Model", "Trace", "OutOfOrderError",
           "NotSavedError", "TraceStateError", "RankFailedError", "config", "engines"]
