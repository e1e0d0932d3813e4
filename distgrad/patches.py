"""The three attributes distgrad puts on ``torch.Tensor``, and how they live with other libraries.

``save`` (saving.py), ``grad`` (gradpatch.py) and ``backward`` (backward.py) are installed once,
at import, each over whatever the class had, and each serves only distgrad's bodies: every other
caller gets what it would have without distgrad (PyTorch's own attribute, or another library's,
such as nnsight's ``with loss.backward():`` and its ``.save()``).

A library imported after distgrad may put its own attribute over distgrad's (nnsight replaces
``Tensor.backward`` the first time it traces). Then distgrad's would no longer see its own
bodies: ``with loss.backward():`` in a distgrad trace would open the other library's block.
So every trace (and every backward block outside a trace) first checks that the three are still
distgrad's, and installs any that is not again, over the other library's, which it then defers
to. The check is three lookups in the class's dict; the install happens only after another
library has changed the class (see gradpatch.py for why installs are kept rare).
"""

from __future__ import annotations

import torch

# Each attribute and how distgrad's is made over the one the class had (None: none), entered
# by the module that defines it (``register``), which imports this one: this module stays a
# leaf, so that the backward block can keep the attributes on top without an import cycle.
_MAKERS: dict = {}
_ours: dict = {}  # distgrad's attributes, as last installed


def register(name: str, make) -> None:
    """``make(previous)`` makes distgrad's ``torch.Tensor.<name>`` over ``previous``."""
    _MAKERS[name] = make
    _ours[name] = None


def install() -> None:
    """Put distgrad's three attributes on ``torch.Tensor``, each over what is there now (left
    alone while it is still distgrad's own)."""
    attrs = torch.Tensor.__dict__
    for name, make in _MAKERS.items():
        current = attrs.get(name)
        if current is None or current is not _ours[name]:
            _ours[name] = make(current)
            setattr(torch.Tensor, name, _ours[name])


def installed(name: str) -> bool:
    """Whether ``torch.Tensor.<name>`` is distgrad's, as installed last."""
    return _ours.get(name) is not None and torch.Tensor.__dict__.get(name) is _ours[name]


def keep_on_top() -> None:
    """Install again any of distgrad's three attributes that another library has replaced."""
    attrs = torch.Tensor.__dict__
    ours = _ours
    if (
        attrs.get("backward") is not ours["backward"]
        or attrs.get("save") is not ours["save"]
        or attrs.get("grad") is not ours["grad"]
    ):
        install()
