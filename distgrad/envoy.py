"""Envoys: objects that mirror the module tree and serve its values inside a trace.

``model.transformer.h[0]`` is an Envoy for that module; ``.output``, ``.input`` and ``.inputs``
pause the run where the module produces them. Anything that is not a module (a parameter,
``config``, a method) is the module's own attribute; a module is always an envoy, also one that
a wrapper (PEFT, torch.compile) passes on from the model inside it. Envoys take no assignment
but those three: anything else would land on the module and change nothing.
"""

from __future__ import annotations

import difflib
import functools

import torch

from .errors import ModuleIndexError, TraceStateError, TraceUsageError
from .interleave.session import UNSET, current_body
from .saveable import held, held_inputs
from .torch_internals import submodules
from .wrappers import module_path


class Envoy:
    """The envoy of one module; see the module text. Its fields start with an underscore so
    that every other name reaches the user's module (as in nnsight); the objects that serve
    requests (``interleave/forward_requests.py``, the pipeline's ``body_requests.py``) read
    them, and ``ForwardRequests`` alone writes ``_kept``:

    * ``_module``: the module (an engine's per-module wrapper unwrapped); ``_path``: the path
      the user wrote, from ``model``; ``_parent``: the envoy of the enclosing module, None at
      the root (``_ancestors()``: the enclosing envoys, innermost first); ``_children``: child
      envoys by attribute name or index;
    * ``_call``: for ``.call(i)``, which call of the module (None: the next one);
    * ``_local``: True for ``.local`` under tensor parallelism (the shard, not the whole value);
    * ``_engine``: the engine of the wrapped model;
    * ``_kept``: the hook points kept for this envoy between traces, by kind (None until the
      first request).
    """

    # __dict__ holds child envoys by attribute name once looked up, so that `model.transformer`
    # is a plain attribute read the second time (no __getattr__ call). __weakref__: user code
    # keeps weak references to models (caches keyed by model, as to an nn.Module or nnsight's).
    __slots__ = (
        "_module",
        "_path",
        "_children",
        "_call",
        "_parent",
        "_engine",
        "_local",
        "_kept",
        "__dict__",
        "__weakref__",
    )

    def __init__(
        self,
        module: torch.nn.Module,
        path: str,
        call: int | None = None,
        parent: Envoy | None = None,
        engine=None,
    ):
        engine = engine if engine is not None else parent._engine
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_module", engine.unwrap(module))
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_call", call)
        object.__setattr__(self, "_parent", parent)
        object.__setattr__(self, "_local", False)
        object.__setattr__(
            self, "_kept", None
        )  # points kept between traces (ForwardRequests._new_point)

    def _ancestors(self):
        envoy = self._parent
        while envoy is not None:
            yield envoy
            envoy = envoy._parent

    # -- the tree -------------------------------------------------------------------------
    def __getattr__(self, name: str):
        children = self._children
        if name in children:
            return children[name]
        module = self._module
        sub = submodules(module).get(name)
        if sub is not None:
            envoy = children[name] = Envoy(sub, f"{self._path}.{name}", parent=self)
            self.__dict__[name] = envoy
            return envoy
        try:
            value = getattr(module, name)
        except AttributeError:
            pass
        else:
            if isinstance(value, torch.nn.Parameter):
                return self._engine.param(value, f"{self._path}.{name}")
            if isinstance(value, torch.nn.Module):  # passed on by a wrapper (PEFT, torch.compile)
                envoy = children[name] = self._forwarded(name, value)
                self.__dict__[name] = envoy
                return envoy
            if name in _RETURN_THE_MODULE and getattr(value, "__self__", None) is module:
                return _envoy_for_self(value, module, self)  # model = model.to(device)
            return value
        names = list(submodules(module)) + [n for n, _ in module.named_parameters(recurse=False)]
        near = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(f'{self._path}.{n}' for n in near)}?" if near else ""
        if name in _STEP_NAMES:
            hint = (
                f" To read a module at each step of a run, loop over the steps: `for step in "
                f"tracer.iter[...]:` (or tracer.all()), or name its i-th call: "
                f"{self._path}.call(i)."
            )
        listing = ", ".join(list(submodules(module))[:12]) or "none"
        raise AttributeError(
            f"{self._path} ({type(module).__name__}) has no submodule or "
            f"attribute {name!r}.{hint} Its submodules: {listing}."
        )

    def _forwarded(self, name: str, module: torch.nn.Module) -> Envoy:
        """The envoy of a module that ``getattr`` found but that is not a child of this one
        (``PeftModel`` and ``OptimizedModule`` pass lookups on to the model inside). It keeps
        the name the user wrote, and its parent is the envoy of the module that really holds
        it, so that the enclosing modules a trace watches (ForwardRequests._new_point) are the
        real ones."""
        root = self
        while root._parent is not None:
            root = root._parent
        path = module_path(root._module, module)
        if path == "":
            return root
        parent = self if path is None else root._descend(path.split(".")[:-1])
        return Envoy(module, f"{self._path}.{name}", parent=parent)

    def _descend(self, names: list) -> Envoy:
        """The envoy at the dotted path ``names`` below this one, along the module tree. A name
        of an engine's per-module wrapper (which ``unwrap`` already stepped through) is skipped."""
        envoy = self
        for name in names:
            holder = envoy._module
            if name not in submodules(holder):
                continue
            if isinstance(holder, torch.nn.ModuleDict):
                envoy = envoy[name]
            elif isinstance(holder, (torch.nn.ModuleList, torch.nn.Sequential)) and name.isdigit():
                envoy = envoy[int(name)]
            else:
                envoy = getattr(envoy, name)
        return envoy

    def __getitem__(self, key):
        envoy = self._children.get(key)
        if envoy is not None:
            return envoy
        module = self._module
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            raise TypeError(
                f"{self._path} ({type(module).__name__}) cannot be indexed; only "
                "ModuleList, Sequential and ModuleDict can."
            )
        try:
            sub = module[key]
        except (IndexError, KeyError):
            valid = (
                f"keys {list(module.keys())}"
                if isinstance(module, torch.nn.ModuleDict)
                else f"indices 0..{len(module) - 1}"
            )
            raise ModuleIndexError(
                f"{self._path}[{key!r}] does not exist: {self._path} has {valid}."
            ) from None
        label = f"{self._path}[{key!r}]" if isinstance(key, str) else f"{self._path}[{key}]"
        envoy = Envoy(sub, label, parent=self) if isinstance(sub, torch.nn.Module) else sub
        self._children[key] = envoy
        return envoy

    def __len__(self):
        return len(self._module)

    def __iter__(self):
        for i in range(len(self._module)):
            yield self[i]

    def __call__(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def __repr__(self):
        return f"Envoy({self._path}: {type(self._module).__name__})"

    def call(self, i: int) -> Envoy:
        """The ``i``-th call (from 0) of this module in the trace, for modules run more than
        once."""
        if not isinstance(i, int) or i < 0:
            raise ValueError(f"{self._path}.call(i) needs an int i >= 0, got {i!r}.")
        return Envoy(
            self._module,
            f"{self._path}.call({i})",
            call=i,
            parent=self._parent,
            engine=self._engine,
        )

    @property
    def device(self) -> torch.device:
        """The module's device: its own ``device`` attribute (transformers models have one),
        else that of its first parameter or buffer, else the CPU (nnsight's envoys have it)."""
        own = getattr(self._module, "device", None)
        if isinstance(own, torch.device):
            return own
        first = next(self._module.parameters(), None)
        first = first if first is not None else next(self._module.buffers(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def local(self) -> Envoy:
        """This module as this rank holds it: under tensor parallelism ``.local.output`` is the
        rank's shard as the module returned it, with no communication. Elsewhere the same as
        the envoy itself."""
        envoy = Envoy(
            self._module,
            f"{self._path}.local",
            call=self._call,
            parent=self._parent,
            engine=self._engine,
        )
        object.__setattr__(envoy, "_local", True)
        return envoy

    # -- values ---------------------------------------------------------------------------
    def _pause(self, kind: str):
        body = current_body()
        if body is None:
            raise TraceUsageError(
                f"{self._path}.{kind} can only be used inside `with model.trace(...):`."
            )
        return body, body.requests.module_value(body, self, kind)

    @property
    def output(self):
        """What the module returned (its next call, or the call the run is paused at).
        Assign to replace it for everything downstream."""
        body, pause = self._pause("output")
        value = pause.replacement
        if value is UNSET:
            value = pause.view
        return body.remember(value, self._path, ".output", pause, held)  # (saveable.py)

    @output.setter
    def output(self, value):
        body, pause = self._pause("output")
        pause.replace(value, f"{self._path}.output")
        body.remember(value, self._path, ".output")

    @property
    def inputs(self):
        """``(args, kwargs)`` of the call."""
        _, pause = self._pause("input")
        return held_inputs(pause.replacement if pause.replacement is not UNSET else pause.view)

    @inputs.setter
    def inputs(self, value):
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
            raise TypeError(f"{self._path}.inputs = ... needs a pair (args tuple, kwargs dict).")
        _, pause = self._pause("input")
        pause.replace((tuple(value[0]), dict(value[1])), f"{self._path}.inputs")

    @property
    def input(self):
        """The first positional argument (or, for a call with keywords only, the first
        keyword's value)."""
        body, pause = self._pause("input")
        args, kwargs = pause.replacement if pause.replacement is not UNSET else pause.view
        value = _first(args, kwargs, self._path)
        return body.remember(value, self._path, ".input", None, held)  # (saveable.py)

    @input.setter
    def input(self, value):
        body, pause = self._pause("input")
        args, kwargs = pause.replacement if pause.replacement is not UNSET else pause.view
        if args:
            pause.replace(((value,) + tuple(args[1:]), dict(kwargs)), f"{self._path}.input")
        elif kwargs:
            first = next(iter(kwargs))
            pause.replace(((), {**kwargs, first: value}), f"{self._path}.input")
        else:
            raise TraceStateError(f"{self._path}.input = ...: this call has no arguments.")
        body.remember(value, self._path, ".input")

    def __setattr__(self, name, value):
        if name in ("output", "input", "inputs"):
            object.__setattr__(self, name, value)
            return
        # Anything else would land on the module as a new attribute and change nothing
        # (`h.outptu = x`, `h.grad = g`), or swap a submodule under envoys that still name the
        # old one: refused, in a trace or not.
        near = difflib.get_close_matches(name, ["output", "input", "inputs"], n=1, cutoff=0.6)
        hint = f" Did you mean {self._path}.{near[0]} = ...?" if near else ""
        raise AttributeError(
            f"{self._path}.{name} = ...: an envoy takes assignments to .output, .input and "
            f".inputs only, and distgrad does not pass other assignments on to the module "
            f"(a new attribute there changes nothing).{hint} To change the module itself, do it "
            f"on the module "
            f"(model.module is the wrapped module) and call distgrad.wrap again."
        )


def _first(args, kwargs, path):
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise TraceStateError(f"{path}.input: this call has no arguments.")


# nnsight's spellings of steps on a module (``model.next()``, ``model.all()``, ``model.iter``)
_STEP_NAMES = frozenset({"next", "all", "iter"})

# nn.Module's methods that return the module itself (other methods are returned unchanged)
_RETURN_THE_MODULE = frozenset(
    {
        "to",
        "cpu",
        "cuda",
        "xpu",
        "mtia",
        "ipu",
        "half",
        "float",
        "double",
        "bfloat16",
        "type",
        "train",
        "eval",
        "requires_grad_",
        "apply",
        "share_memory",
        "to_empty",
    }
)


def _envoy_for_self(method, module: torch.nn.Module, envoy: Envoy):
    """``method`` of ``module``, returning ``envoy`` where it returns the module itself
    (``to``, ``cpu``, ``train``, ``requires_grad_``: ``model = model.to(dev)`` keeps the envoy,
    as in nnsight)."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        out = method(*args, **kwargs)
        return envoy if out is module else out

    return call
