"""``.save()`` on the containers a body gets from envoys, as nnsight spells it.

``tensor.save()`` is a method of every tensor (``saving.py``). A module's value is often not a
tensor: ``model.h[0].inputs`` is the pair ``(args, kwargs)``, ``model.output`` a transformers
``ModelOutput``, some modules return tuples, lists or dicts. nnsight mounts ``save`` on every
object; distgrad adds it only to the values its envoys hand a body, so nothing outside a trace
changes:

* a tuple is handed over as a ``SaveableTuple``, a tuple with ``.save()`` holding the same
  items (a tuple cannot change, so a copy is the value itself); ``.inputs``' ``args`` too;
* a list or a dict as a ``SaveableList`` / ``SaveableDict`` holding the same items, which the
  run then goes on with, so that an in-place change the body makes to it reaches the model;
* any other object (a ``ModelOutput``, a named tuple) keeps its identity: its class is swapped
  for a subclass with ``.save()`` while the body runs and put back when the body ends
  (``release``), so the object the user keeps after the trace is of its own class again.

``.save()`` keeps the object as ``distgrad.save`` does (gathered the same way under an engine)
and returns it; a saved ``SaveableTuple``, list or dict is kept as the plain builtin.
"""

from __future__ import annotations

import torch

from .interleave.session import UNSET
from .saving import save


class SaveableTuple(tuple):
    """A tuple a body got from an envoy; ``.save()`` keeps it as a plain tuple."""

    __slots__ = ()

    def save(self, **options):
        return save(tuple(_plain(item) for item in self), **options)


class SaveableList(list):
    """A list a body got from an envoy; ``.save()`` keeps it as a plain list."""

    __slots__ = ()

    def save(self, **options):
        return save(list(self), **options)


class SaveableDict(dict):
    """A dict a body got from an envoy; ``.save()`` keeps it as a plain dict."""

    __slots__ = ()

    def save(self, **options):
        return save(dict(self), **options)


def _plain(value):
    """A ``Saveable*`` container as the builtin it copies (``.inputs``' ``args`` in the pair)."""
    if isinstance(value, SaveableTuple):
        return tuple(value)
    return value


def _save_method(self, **options):
    """nnsight's ``.save()``: keep this object for use after the trace; returns it."""
    return save(self, **options)


_SUBCLASSES: dict = {}  # a class -> its subclass with .save()


def _with_save(cls):
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        # no __slots__ of its own: the layout stays the class's, so __class__ can be swapped
        sub = _SUBCLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {"__slots__": (), "save": _save_method, "__module__": cls.__module__},
        )
        sub.__qualname__ = cls.__qualname__
    return sub


def _has_save(cls) -> bool:
    """Whether ``cls`` defines ``save`` below ``object`` (where nnsight, once imported, mounts
    its own, which works in nnsight's traces only)."""
    return any("save" in vars(klass) for klass in cls.__mro__[:-1])


def held(value, body, pause):
    """``value`` (not a tensor) as the body holds it: with ``.save()`` where it had none.
    ``pause``: where the run goes on with a list or dict the body holds (None for a call's
    argument, which is handed over as it is)."""
    cls = type(value)
    if cls is tuple:
        return SaveableTuple(value)
    if cls is list or cls is dict:
        if pause is None:
            return value
        copy = SaveableList(value) if cls is list else SaveableDict(value)
        if pause.replacement is UNSET or pause.replacement is value:
            # the run goes on with the one the body holds
            pause.replacement = copy
        return copy
    if (
        value is None
        or isinstance(value, (torch.Tensor, torch.nn.Module, type))
        or _has_save(cls)  # its own save (or one already added) is left alone
        or cls.__module__ == "builtins"  # str, int, ...: their class cannot be swapped
    ):
        return value
    try:
        value.__class__ = _with_save(cls)
    except TypeError:  # a class whose instances' layout a subclass cannot share
        return value
    body.held.append((value, cls))
    return value


def held_inputs(value):
    """``.inputs``' pair ``(args, kwargs)``, with ``.save()`` on it and on ``args``."""
    args, kwargs = value
    return SaveableTuple((SaveableTuple(args), kwargs))


def release(body) -> None:
    """Give the objects the body held their own class back (the body has ended)."""
    held_objects, body.held = body.held, []
    for value, cls in held_objects:
        value.__class__ = cls
