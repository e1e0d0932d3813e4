"""``retain_grad()`` on an invoke's rows of a value.

An invoke body sees a slice of the batch's tensor (``batching.narrow``); the batch's graph goes
on from the full tensor, so PyTorch's own retain_grad on the slice would see at most what the
body computed from the slice. ``fill_retained_grads`` hooks the full tensor up before each
backward of the trace, so that the slice's ``.grad`` is its rows of the full gradient,
accumulated over backwards as retain_grad() does.
"""

from __future__ import annotations

import weakref


def fill_retained_grads(slices: dict, hooked: set) -> None:
    """``retain_grad()`` on an invoke's rows of a value: the batch's graph goes on from the full
    tensor, not from the body's slice of it, so the slice's own retained gradient would hold at
    most what the body itself computed from it. A hook on the full tensor gives the slice its
    rows of the full gradient, as ``retain_grad()`` on the whole batch and slicing would.
    ``hooked``: the slices hooked up already, by an earlier backward of the trace."""
    for key, (view, full, rows) in slices.items():
        if key not in hooked and view.retains_grad and full.requires_grad:
            retained = _RowsOfGrad(view, rows)
            view.register_hook(retained.before_own)
            full.register_hook(retained)
            hooked.add(key)


class _RowsOfGrad:
    """The hooks: the slice's ``.grad`` after a backward is what it held before that backward
    plus the rows of the full gradient (which include what the body computed from the slice),
    as retain_grad() accumulates. "Before" is read when the backward reaches the slice (a
    tensor hook runs before the slice's own retain_grad hook adds its part) or, when the slice
    is not on this backward's path, when it reaches the full tensor; so ``h.grad = None``
    between two backwards starts from nothing. The slice is held weakly: the full tensor holds
    the hook, and the slice holds the full tensor (its base)."""

    def __init__(self, view, rows: slice):
        self.view = weakref.ref(view)
        self.rows = rows
        self.held = _UNREAD  # the slice's .grad as this backward reached it

    def before_own(self, grad) -> None:
        view = self.view()
        if view is not None:
            self.held = view.grad

    def __call__(self, grad):
        view = self.view()
        if view is not None:
            before = view.grad if self.held is _UNREAD else self.held
            self.held = _UNREAD
            rows = grad[self.rows]
            view.grad = rows.clone() if before is None else before + rows


_UNREAD = object()
