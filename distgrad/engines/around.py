"""An engine around another: a library's wrapper of a model that some engine already runs
(accelerate's prepared model, Lightning Fabric's module), which changes how the backward is
entered and nothing else.

``EngineAround`` passes every method and attribute of ``base.Engine`` to ``inner``, the engine
of what the library wraps, so that what ``inner`` does in each (its forward's bookkeeping, the
reduction of parameters beside the model after a backward, the gather at the trace's end) is
done under the library too. A subclass overrides only what the library changes. Written once,
here: a method added to ``Engine`` and forgotten in one copy of the delegation would do
nothing under that library, silently.
"""

from __future__ import annotations

from .base import Engine


class EngineAround(Engine):
    """``inner``: the engine of the module the library calls; ``wrapped``: the library's
    object, as the user wrapped it."""

    def __init__(self, wrapped, inner: Engine):
        super().__init__(wrapped)
        self.inner = inner

    model = property(lambda self: self.inner.model)
    root = property(lambda self: self.inner.root)
    rank = property(lambda self: self.inner.rank)
    world_size = property(lambda self: self.inner.world_size)
    views = property(lambda self: self.inner.views)
    captures_body = property(lambda self: self.inner.captures_body)

    def forward(self, args, kwargs, call=None):
        return self.inner.forward(args, kwargs, call)

    def generate(self, args, kwargs):
        return self.inner.generate(args, kwargs)

    def backward(self, tensor, fn, args, kwargs):
        return self.inner.backward(tensor, fn, args, kwargs)

    def plain_backward(self) -> None:
        self.inner.plain_backward()

    def after_backward(self, roots) -> None:
        self.inner.after_backward(roots)

    def owns(self, module):
        return self.inner.owns(module)

    def unwrap(self, module):
        return self.inner.unwrap(module)

    def module_here(self, module):
        return self.inner.module_here(module)

    def output_holders(self, module):
        return self.inner.output_holders(module)

    def refuse_flow(self) -> None:
        self.inner.refuse_flow()

    def watch_param_grads(self, take):
        return self.inner.watch_param_grads(take)

    def grad_pieces(self, module):
        return self.inner.grad_pieces(module)

    def param(self, param, path):
        return self.inner.param(param, path)

    def begin_trace(self) -> None:
        self.inner.begin_trace()

    def end_trace(self, saves, error):
        return self.inner.end_trace(saves, error)

    def run_captured(self, trace, code, names, frame) -> None:
        self.inner.run_captured(trace, code, names, frame)
