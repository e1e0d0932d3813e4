"""The kinds of module value a body can ask for, each declared once.

A kind says where its hook goes (which of the module's hook dicts, and whether PyTorch passes
that hook the call's keyword arguments) and what the body is handed when the hook fires. A
reply of the body (an assignment) is what the hook returns, so it takes the value's form: a
forward hook's return replaces the output, a pre-hook's ``(args, kwargs)`` the call's arguments.
``points.ModulePoint`` installs and fires any kind, ``checkpointing.Replay`` repeats an edit of
any kind in a checkpointed block's recompute, and the envoy's property for the kind
(``envoy.py``) is what the body reads and assigns.

Adding a kind (a value that a module hook of the forward produces): an entry in ``KINDS`` here,
the property on ``Envoy``, and a test against plain autograd. See docs/concepts.rst.
"""

from __future__ import annotations

from ..torch_internals import forward_hooks, forward_pre_hooks


class ModuleKind:
    """One kind of module value. ``name``: the envoy's attribute (``model.x.<name>``);
    ``hooks(module)``: the hook dict its hook goes in; ``with_kwargs``: the hook is a pre-hook
    that takes and returns the keyword arguments too; ``value(*hook_args)``: what the body is
    handed, from the arguments PyTorch calls the hook with (after the module)."""

    __slots__ = ("name", "hooks", "with_kwargs", "value")

    def __init__(self, name: str, hooks, with_kwargs: bool, value):
        self.name, self.hooks, self.with_kwargs, self.value = name, hooks, with_kwargs, value


def _output(args, output):
    return output


def _call_arguments(args, kwargs):
    return (args, kwargs)


KINDS = {
    "output": ModuleKind("output", forward_hooks, False, _output),
    # ``.input`` and ``.inputs`` are two views of this kind (envoy.py)
    "input": ModuleKind("input", forward_pre_hooks, True, _call_arguments),
}
