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
from .base import Engine
from .owners import called_by_library_backward, library_refusal


class FabricEngine(Engine):
    name = "fabric"

    def __init__(self, wrapped, inner: Engine):
        super().__init__(wrapped)
        self.inner = inner

    # everything but the forward's entry and the backward is the engine of what Fabric calls
    model = property(lambda self: self.inner.model)
    root = property(lambda self: self.wrapped)
    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)
    views = property(lambda self: self.inner.views)
    own_backward = True  # fabric.backward: its precision's loss scaling

    def forward(self, args, kwargs):
        # the Fabric module, not the inner engine's forward: Fabric converts inputs and outputs
        return self.wrapped(*args, **kwargs)

    def backward(self, tensor, fn, args, kwargs):
        what = "a `with loss.backward():` block"
        raise library_refusal(what, self.model, self.wrapped, self.world_size)

    def plain_backward(self) -> None:
        if not called_by_library_backward():
            what = "a plain `.backward()` in the trace's body"
            raise library_refusal(what, self.model, self.wrapped, self.world_size)
        self.inner.plain_backward()

    def unwrap(self, module):
        return self.inner.unwrap(module)

    def param(self, param, path):
        return self.inner.param(param, path)

    def owns(self, module):
        return self.inner.owns(module)

    def module_here(self, module):
        return self.inner.module_here(module)

    def output_holders(self, module):
        return self.inner.output_holders(module)

    def refuse_flow(self):
        self.inner.refuse_flow()

    def grad_pieces(self, module):
        return self.inner.grad_pieces(module)

    def begin_trace(self):
        self.inner.begin_trace()

    def end_trace(self, saves, error):
        return self.inner.end_trace(saves, error)


def is_fabric_module(obj) -> bool:
    """Whether ``obj`` is a module ``fabric.setup`` returned (no import: Lightning is optional)."""
    return type(obj).__name__ == "_FabricModule" and type(obj).__module__.startswith("lightning")


def forward_module(obj):
    """The module a Fabric module calls (Fabric keeps it as ``_forward_module``, its only
    reference to the strategy's wrapper of the user's module)."""
    return submodules(obj)["_forward_module"]
