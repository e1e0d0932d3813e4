"""The names an invoke body sees: the frame as it was at the body's ``tracer.invoke(...)``, and
what the bodies themselves bind.

Invoke bodies run later than they are written, all at the end of the trace block, taking turns
at each hook point. Two kinds of names come out of that:

* A name no invoke body binds (a loop variable, the input, a helper) has, in each body, the
  value it had when that body's ``with tracer.invoke(...):`` was entered, as if the body had
  run there: ``for i, x in enumerate(xs): with tr.invoke(x): seen.append(i)`` appends 0, 1, ...
  Each body runs in its own namespace, a shallow copy of the caller's names made at ``enter``.
* A name some invoke body binds is one value for all the bodies, whoever bound it last when a
  body resumes: body 1 saves ``h``, body 2 writes ``h`` into its own rows. After the trace the
  last binding goes back to the caller's frame (``Invokes.run_rest``).

Bodies switch only where the scheduler wakes them, so the shared names are copied into a body's
namespace before each wake and read back out after it. Objects are never copied: a list
appended to in every body is the one list, as in Python.
"""
from __future__ import annotations

from .run import BodyRunners

_UNBOUND = object()  # a shared name a body deleted


def namespace(frame) -> dict:
    """The names ``frame`` sees now, copied: the dict a deferred body of it runs in."""
    local = frame.f_locals
    if local is frame.f_globals:  # module scope: one dict
        return dict(local)
    return {**frame.f_globals, **local}


class InvokeNames:
    """The namespaces of one trace's invoke bodies. ``spaces``: one per body, in invoke order,
    each taken when its invoke's block was skipped (``Invoke.__exit__``); ``shared``: every name some body binds."""

    def __init__(self, spaces: list[dict], shared):
        self.spaces = spaces
        self.shared = tuple(dict.fromkeys(shared))
        self.bound: dict = {}  # shared name -> what a body bound it to last (_UNBOUND: deleted)

    def runners(self, bodies: list, codes: list, registry: dict) -> "NamedRunners":
        """Greenlets that run ``codes[i]`` as ``bodies[i]``, each in its own namespace."""
        functions = {body: (lambda code=code, space=space: exec(code, space))
                     for body, code, space in zip(bodies, codes, self.spaces)}
        spaces = {id(body): space for body, space in zip(bodies, self.spaces)}
        return NamedRunners(functions, registry, self, spaces)

    def bound_values(self) -> dict:
        """The shared names the bodies left bound, as the caller's frame should get them."""
        return {name: value for name, value in self.bound.items() if value is not _UNBOUND}


class NamedRunners(BodyRunners):
    """``BodyRunners`` that hand the shared names over between bodies at every wake."""

    def __init__(self, bodies: dict, registry: dict, names: InvokeNames, spaces: dict):
        super().__init__(bodies, registry)
        self.names = names
        self.spaces = spaces  # id(body) -> its namespace

    def wake(self, body) -> None:
        space = self.spaces[id(body)]
        bound = self.names.bound
        for name, value in bound.items():
            if value is _UNBOUND:
                space.pop(name, None)
            else:
                space[name] = value
        shared = self.names.shared
        before = [space.get(name, _UNBOUND) for name in shared]
        try:
            super().wake(body)
        finally:
            for name, old in zip(shared, before):
                new = space.get(name, _UNBOUND)
                if new is not old:
                    bound[name] = new


__all__ = ["InvokeNames", "NamedRunners", "namespace"]
