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

from .transports import BodyRunners

_UNBOUND = object()  # a shared name a body deleted


def namespace(frame) -> dict:
    """The names ``frame`` sees now, copied: the dict a deferred body of it runs in."""
    local = frame.f_locals
    if local is frame.f_globals:  # module scope: one dict
        return dict(local)
    return {**frame.f_globals, **local}


class InvokeNames:
    """The namespaces of one trace's invoke bodies. ``spaces``: one per body, in invoke order,
    each taken when its invoke's block was skipped (``Invoke.__exit__``); ``names``: per body,
    the names it binds; ``frames``: per body, the frame its invoke is written in. Bodies written
    in one frame share the names they bind; bodies written in different functions (a helper
    that opens an invoke) share none, as the functions' own locals would not."""

    def __init__(self, spaces: list[dict], names: list[list[str]], frames: list):
        self.spaces = spaces
        self.frames = {id(f): f for f in frames}
        self.group = [id(f) for f in frames]  # per body: its frame's key
        shared: dict = {key: {} for key in self.frames}
        for key, bound in zip(self.group, names):
            shared[key].update(dict.fromkeys(bound))
        self.shared = {key: tuple(bound) for key, bound in shared.items()}
        # per frame: shared name -> what a body bound it to last (_UNBOUND: deleted)
        self.bound: dict = {key: {} for key in self.frames}

    def runners(self, bodies: list, codes: list, registry: dict) -> NamedRunners:
        """Greenlets that run ``codes[i]`` as ``bodies[i]``, each in its own namespace."""
        functions = {
            body: (lambda code=code, space=space: exec(code, space))
            for body, code, space in zip(bodies, codes, self.spaces)
        }
        spaces = {
            id(body): (space, key) for body, space, key in zip(bodies, self.spaces, self.group)
        }
        return NamedRunners(functions, registry, self, spaces)

    def bound_values(self) -> list[tuple]:
        """``(frame, names)`` for each frame invokes were written in: the shared names its
        bodies left bound, as that frame should get them."""
        return [
            (
                frame,
                {name: value for name, value in self.bound[key].items() if value is not _UNBOUND},
            )
            for key, frame in self.frames.items()
        ]


class NamedRunners(BodyRunners):
    """``BodyRunners`` that hand the shared names over between bodies at every wake."""

    def __init__(self, bodies: dict, registry: dict, names: InvokeNames, spaces: dict):
        super().__init__(bodies, registry)
        self.names = names
        self.spaces = spaces  # id(body) -> (its namespace, its frame's key)

    def wake(self, body) -> None:
        space, key = self.spaces[id(body)]
        bound = self.names.bound[key]
        for name, value in bound.items():
            if value is _UNBOUND:
                space.pop(name, None)
            else:
                space[name] = value
        shared = self.names.shared[key]
        before = [space.get(name, _UNBOUND) for name in shared]
        try:
            super().wake(body)
        finally:
            for name, old in zip(shared, before):
                new = space.get(name, _UNBOUND)
                if new is not old:
                    bound[name] = new


__all__ = ["InvokeNames", "NamedRunners", "namespace"]
