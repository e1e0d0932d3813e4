"""What a request gives back while a generator body must wait for the run (fastpath/driver.py).

The rewritten body yields ``PAUSED`` and is resumed with the value. Code that was not rewritten
(a helper function the body calls) cannot yield, so ``PAUSED`` is poisoned: its first use there
raises an error that says what to do.
"""
from __future__ import annotations

from ..errors import TraceStateError
from .session import Stop

FAST_PATH_HELP = ("distgrad runs this trace body as a generator (its fast path), and a value was asked "
           "for where the body cannot pause: inside a function the body calls, or through "
           "getattr. Read .output / .input / .grad in the with-block itself and pass the values "
           "to the function, or set distgrad.config.body_mode = 'greenlet' to run bodies in "
           "place.")


class Paused:
    """What a request gives back while the body must wait for the run; see the module text."""

    __slots__ = ()

    def _fail(self, *args, **kwargs):
        raise TraceStateError(FAST_PATH_HELP)

    def __repr__(self):
        return "<distgrad: waiting for the run>"


for _dunder in ("__getattr__", "__bool__", "__len__", "__iter__", "__getitem__", "__setitem__",
                "__call__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                "__truediv__", "__matmul__", "__neg__", "__float__", "__int__", "__index__",
                "__format__", "__str__", "__lt__", "__gt__", "__array__", "__contains__",
                "__setattr__"):
    setattr(Paused, _dunder, Paused._fail)

PAUSED = Paused()
LEAVE = "leave"  # what the body yields to let the run it is inside finish


class _PausedStop(Stop):
    """The Stop a request returns while the body must wait; writing to it is a helper's write."""

    def replace(self, value, label) -> None:
        raise TraceStateError(FAST_PATH_HELP)


PAUSE_STOP = _PausedStop.blank("value")
PAUSE_STOP.view = PAUSED
