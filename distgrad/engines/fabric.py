"""Lightning Fabric: a module from ``fabric.setup(net)`` (a ``_FabricModule``), wrapped as
``distgrad.wrap(model)``.

* What Fabric set up decides the rest: the module it calls (``_forward_module``: a DDP module,
  a DeepSpeed engine, an FSDP module, or the user's module on one device) selects the engine
  of paths, saves and parameter gradients; paths are those of the user's own module.
* Forward: through the Fabric module, so that its precision conversions run as in the loop.
* Backward: Fabric's is ``fabric.backward(loss)`` (its strategy's: DeepSpeed's engine, the
  precision plugin's loss scaling). distgrad cannot reach the Fabric object from the module, so a
  ``with loss.backward():`` block or a plain ``.backward()`` in the body, which would bypass it,
  raises and says how to open the block on ``fabric.backward`` (``model.trace_step``).
  ``fabric.backward(loss)`` called in the body itself is Fabric's own backward and runs.
"""

from __future__ import annotations

from ..torch_internals import submodules
from .around import EngineAround
from .owners import called_by_library_backward, library_refusal


class FabricEngine(EngineAround):
    name = "fabric"

    # everything but the forward's entry, model.output and the backward is the engine of what
    # Fabric calls (EngineAround)
    root = property(lambda self: self.wrapped)
    own_backward = True  # fabric.backward: its precision's loss scaling

    def forward(self, args, kwargs, call=None):
        # through the Fabric module, which converts inputs and outputs; the inner engine's
        # bookkeeping of the forward runs around it
        return self.inner.forward(args, kwargs, self.wrapped)

    def backward(self, tensor, fn, args, kwargs):
        what = "a `with loss.backward():` block"
        raise library_refusal(what, self.model, self.wrapped, self.world_size)

    def plain_backward(self) -> None:
        if not called_by_library_backward():
            what = "a plain `.backward()` in the trace's body"
            raise library_refusal(what, self.model, self.wrapped, self.world_size)
        self.inner.plain_backward()


def is_fabric_module(obj) -> bool:
    """Whether ``obj`` is a module ``fabric.setup`` returned (no import: Lightning is optional)."""
    return type(obj).__name__ == "_FabricModule" and type(obj).__module__.startswith("lightning")


def forward_module(obj):
    """The module a Fabric module calls (Fabric keeps it as ``_forward_module``, its only
    reference to the strategy's wrapper of the user's module)."""
    return submodules(obj)["_forward_module"]
