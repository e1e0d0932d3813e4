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

from . import engines, gradpatch, patches  # noqa: F401 (gradpatch registers .grad with patches)
from .backward import BackwardTracer
from .config import config
from .engines.ranks.beside import keep_rank_local
from .engines.ranks.ragged import rank_parts
from .errors import (
    GradientError,
    NotSavedError,
    OutOfOrderError,
    RankFailedError,
    TraceStateError,
    TraceUsageError,
)
from .saving import save
from .trace import Model, Trace

__version__ = "0.1.0"


def wrap(
    module, tokenizer=None, accelerator=None, tp_shards: dict | None = None, full_model=None
) -> Model:
    """Wrap a module, or an engine's wrapper of one, for tracing.

    Args:
        module: any ``torch.nn.Module``; or the wrapper itself: a ``DistributedDataParallel``,
            an FSDP1 module, a ``fully_shard``-ed module, a model from ``accelerator.prepare``.
        tokenizer: used by ``trace()`` to turn a ``str`` or ``list[str]`` into model inputs.
        accelerator: the ``accelerate.Accelerator`` that prepared ``module``; backward blocks
            then run ``accelerator.backward(loss)``.
        tp_shards: for a model split with ``parallelize_module``: modules that are not
            parallelized themselves but return a local shard (sequence parallelism's decoder
            layers), ``{name as in named_modules(): sharded dim}``, so that the body sees their
            values whole. See docs/engines/tensor_parallel.md.
        full_model: with a pipeline schedule as ``module``: the whole model (it may live on the
            meta device), whose paths the body uses on every stage.
    Returns:
        a :class:`Model` whose attributes mirror the user's module tree.
    """
    return Model(
        engines.select(module, accelerator=accelerator, tp_shards=tp_shards, full_model=full_model),
        tokenizer=tokenizer,
    )


patches.install()  # Tensor.backward, Tensor.save, Tensor.grad

__all__ = [
    "wrap",
    "save",
    "rank_parts",
    "BackwardTracer",
    "Model",
    "Trace",
    "OutOfOrderError",
    "NotSavedError",
    "TraceStateError",
    "TraceUsageError",
    "GradientError",
    "RankFailedError",
    "config",
    "engines",
    "keep_rank_local",
]
