"""Models inside wrappers users meet: ``torch.compile`` and modules found through another module.

* **torch.compile.** distgrad reads and edits values with module and tensor hooks, called in
  Python as the forward and backward run. A compiled forward runs a graph that dynamo traced
  ahead of time: hooks added for a trace are either traced into a new graph (where the body's
  switches and edits cannot happen) or never called. So while a trace is open, every compiled
  function and module of the process runs its eager code (``torch.compiler.set_stance(
  "force_eager")``), and when the last open trace ends the stance that was there before comes
  back. Steps outside traces run the compiled model untouched. A traced step of a compiled model
  therefore costs what an eager step costs.
* **Paths through wrappers.** PEFT's ``PeftModel``, ``torch.compile``'s ``OptimizedModule`` and
  similar wrappers pass attribute lookups on to the model inside them, so ``model.transformer``
  names a module that is not a child of the wrapper. ``module_path`` finds where such a module
  sits in the tree, so that its envoy knows its real enclosing modules.
"""

from __future__ import annotations

import torch

from .torch_internals import compiled_original, dynamo_imported


class EagerWhileTracing:
    """The ``force_eager`` stance, held while at least one trace is open (traces on other
    greenlets or threads may overlap; the first to open sets it, the last to close restores)."""

    def __init__(self):
        self.open_traces = 0
        self.stance = None  # torch's set_stance object: it remembers the stance it replaced

    def enter(self) -> bool:
        """Force eager for a trace that opens; returns whether ``leave`` must be called."""
        if self.open_traces == 0:
            # dynamo not imported: nothing in this process can have been compiled, and
            # importing it (seconds) to say so would be waste
            if not dynamo_imported():
                return False
            self.stance = torch.compiler.set_stance("force_eager")  # applies at once
        self.open_traces += 1
        return True

    def leave(self, entered: bool) -> None:
        if not entered:
            return
        self.open_traces -= 1
        if self.open_traces == 0:
            stance, self.stance = self.stance, None
            stance.__exit__(None, None, None)  # back to the stance before the first trace


EAGER = EagerWhileTracing()


def compiled_inner(obj):
    """The module inside ``torch.compile(obj)``, or None when ``obj`` is not compiled that way."""
    return compiled_original(obj)


def module_path(root: torch.nn.Module, module: torch.nn.Module) -> str | None:
    """The dotted name of ``module`` in ``root``'s tree ("" for ``root``), or None."""
    for name, candidate in root.named_modules():
        if candidate is module:
            return name
    return None
