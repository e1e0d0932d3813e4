"""Which trace bodies may run as generators: the survey, before a body's first run.

A body qualifies when every place it could ask for a value is in the with-block itself, where a
``yield`` can stand (``driver.py`` says why that is faster; ``rewrite.py`` rewrites
and compiles a body that qualifies). The survey refuses, and the body then runs in place as
before, when it:

* calls a function that could read ``.output`` or ``.grad`` itself: a function bound in the body,
  or one that does not come from Python, torch, NumPy or distgrad (checked on each trace, against
  what the names hold then); a method whose name no tensor, list, dict, set or str has;
* reads a value inside a lambda, a nested function or class, or a comprehension other than a
  list comprehension that is a whole statement (``acts = [m[i].output for i in range(k)]``
  becomes a loop);
* returns, yields, awaits, breaks out of the body, declares ``global`` / ``nonlocal``, or uses
  ``getattr`` / ``locals`` / ``exec`` and the like, or a private ``__name`` (name mangling);
* deletes a name, star-imports, or binds a name its function declares ``global`` (the
  generator's names are its own: it could neither delete nor rebind the caller's);
* sits in a class body, or has no source distgrad can read.
"""
from __future__ import annotations

import ast
import builtins
import functools
import types

import torch

from ..backward import BackwardTracer
from ..envoy import Envoy

REQUESTS = frozenset(("output", "input", "inputs", "grad"))
_SAFE_METHODS = frozenset({"save"}).union(*(dir(t) for t in (torch.Tensor, list, dict, set,
                                                             tuple, str)))
_UNSAFE_NAMES = frozenset(("getattr", "setattr", "hasattr", "delattr", "locals", "vars",
                           "globals", "exec", "eval", "super", "dir", "__import__", "compile"))
_TRUSTED = frozenset(("torch", "distgrad", "builtins", "math", "operator", "functools",
                      "itertools", "collections", "statistics", "numpy", "copy", "random",
                      "einops", "typing"))
_NESTED = (ast.Lambda, ast.FunctionDef, ast.ClassDef, ast.GeneratorExp, ast.SetComp,
           ast.DictComp, ast.ListComp)
_REFUSED = {ast.Return: "return", ast.Yield: "yield", ast.YieldFrom: "yield from",
            ast.Await: "await", ast.Global: "global", ast.Nonlocal: "nonlocal",
            ast.AsyncFor: "async for", ast.AsyncWith: "async with",
            ast.AsyncFunctionDef: "async def", ast.AnnAssign: "an annotated assignment"}
_BUILTIN_KINDS = (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodDescriptorType,
                  types.WrapperDescriptorType, types.MethodWrapperType,
                  types.ClassMethodDescriptorType)
_MISSING = object()


def checks_pass(checks, namespace: dict, frame) -> bool:
    """Whether the callables a body names (``checks``: (name, attrs) pairs) are, this time,
    ones that cannot ask for values: looked up in the frame's locals, globals and builtins."""
    for root, attrs in checks:
        obj = namespace.get(root, _MISSING)
        if obj is _MISSING:
            obj = frame.f_globals.get(root, _MISSING)
            if obj is _MISSING:
                obj = getattr(builtins, root, None)
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except Exception:
            return False
        if not _callable_ok(obj):
            return False
    return True


def _callable_ok(obj) -> bool:
    """A callable that cannot read values from the trace (builtins, torch, distgrad, ...)."""
    if isinstance(obj, _BUILTIN_KINDS):
        return getattr(obj, "__name__", None) not in _UNSAFE_NAMES
    if isinstance(obj, types.MethodType):
        return _callable_ok(obj.__func__)
    if isinstance(obj, functools.partial):
        return _callable_ok(obj.func)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return True  # `raise Error(...)`: an exception's constructor reads no values
    if isinstance(obj, (type, types.FunctionType)):
        module = getattr(obj, "__module__", None) or ""
        return obj is not BackwardTracer and module.split(".")[0] in _TRUSTED
    if isinstance(obj, torch.nn.Module):
        return True
    return isinstance(obj, Envoy) or not callable(obj)


def _chain(node):
    """``a.b.c`` as ("a", ("b", "c")), or None when it is not names and attributes only."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, tuple(reversed(attrs))) if isinstance(node, ast.Name) else None


def has_request(node) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in REQUESTS for n in ast.walk(node))


def is_backward(item) -> bool:
    call = item.context_expr
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "backward")


class Survey(ast.NodeVisitor):
    """Walks a body once: ``reason`` (why it must run in place, or None), ``requests`` (whether
    it reads any value) and ``checks`` (callables to look up on each trace)."""

    def __init__(self, bound: set, defined: set):
        self.bound = bound        # names the body binds: what they hold is not known yet
        self.defined = defined    # functions and classes the body defines
        self.reason = None
        self.requests = False
        self.checks: list = []
        self.nested = 0
        self.loops = 0

    def refuse(self, why: str) -> None:
        if self.reason is None:
            self.reason = why

    def generic_visit(self, node):
        refused = _REFUSED.get(type(node))
        if refused is not None:
            self.refuse(refused)
        super().generic_visit(node)

    def _scope(self, node):
        self.nested += 1
        loops, self.loops = self.loops, 0
        self.generic_visit(node)
        self.nested -= 1
        self.loops = loops

    visit_Lambda = visit_FunctionDef = visit_ClassDef = visit_GeneratorExp = _scope
    visit_SetComp = visit_DictComp = visit_ListComp = _scope

    def _loop(self, node):
        for field in ("target", "iter", "test"):
            if getattr(node, field, None) is not None:
                self.visit(getattr(node, field))
        self.loops += 1
        for stmt in node.body:
            self.visit(stmt)
        self.loops -= 1
        for stmt in node.orelse:
            self.visit(stmt)

    visit_For = visit_While = _loop

    def visit_Break(self, node):
        if not self.loops:
            self.refuse("break out of the body")

    visit_Continue = visit_Break

    def visit_Name(self, node):
        self._identifier(node.id)
        if isinstance(node.ctx, ast.Del):
            self.refuse(f"del {node.id}")  # the generator cannot delete the caller's name

    def visit_ImportFrom(self, node):
        if any(alias.name == "*" for alias in node.names):
            self.refuse("import *")

    def _identifier(self, name: str) -> None:
        if name.startswith("_dg_") or (name.startswith("__") and not name.endswith("__")):
            self.refuse(f"the name {name}")

    def visit_Attribute(self, node):
        self._identifier(node.attr)
        if node.attr in REQUESTS:
            self.requests = True
            if self.nested:
                self.refuse("a value read inside a nested scope")
            if not isinstance(node.ctx, ast.Load):
                self.refuse("an assignment to a value that is not a whole statement")
        self.visit(node.value)

    def _expandable(self, comp) -> bool:
        return (isinstance(comp, ast.ListComp) and not self.nested and has_request(comp)
                and not any(g.is_async for g in comp.generators)
                and not any(isinstance(n, _NESTED) for n in ast.walk(comp) if n is not comp))

    def _comprehension(self, comp):
        for gen in comp.generators:
            self.visit(gen.target)
            self.visit(gen.iter)
            for cond in gen.ifs:
                self.visit(cond)
        self.visit(comp.elt)

    def visit_Assign(self, node):
        target = node.targets[0]
        if (len(node.targets) == 1 and isinstance(target, ast.Attribute)
                and target.attr in REQUESTS and not self.nested):
            self.requests = True
            self.visit(target.value)
            self.visit(node.value)
        elif self._expandable(node.value):
            for target in node.targets:
                self.visit(target)
            self._comprehension(node.value)
        else:
            self.generic_visit(node)

    def visit_Expr(self, node):
        if self._expandable(node.value):
            self._comprehension(node.value)
        else:
            self.generic_visit(node)

    def visit_AugAssign(self, node):
        target = node.target
        if isinstance(target, ast.Attribute) and target.attr in REQUESTS and not self.nested:
            self.requests = True
            self.visit(target.value)
            self.visit(node.value)
        else:
            self.generic_visit(node)

    def visit_With(self, node):
        if any(is_backward(item) for item in node.items):
            item = node.items[0]
            call = item.context_expr
            if len(node.items) != 1 or self.nested:
                self.refuse("a backward block with other context managers")
            if any(has_request(a) for a in call.args + [k.value for k in call.keywords]):
                self.refuse("a value read in the arguments of .backward()")
            self.visit(call.func.value)
            for arg in call.args + [k.value for k in call.keywords]:
                self.visit(arg)
            if item.optional_vars is not None:
                self.visit(item.optional_vars)
            for stmt in node.body:
                self.visit(stmt)
        elif any(isinstance(item.context_expr, ast.Call)
                 and isinstance(item.context_expr.func, ast.Attribute)
                 and item.context_expr.func.attr == "invoke" for item in node.items):
            self.refuse("an invoke block")  # its body runs later, over the whole batch
        else:
            self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in _UNSAFE_NAMES or func.id in self.bound:
                self.refuse(f"a call of {func.id}")
            else:
                self.checks.append((func.id, ()))
        elif isinstance(func, ast.Attribute):
            chain = _chain(func)
            if (chain is not None and chain[0] not in self.bound
                    and not REQUESTS.intersection(chain[1])):
                self.checks.append(chain)
            elif func.attr not in _SAFE_METHODS:
                self.refuse(f"a call of .{func.attr}()")
        else:
            self.refuse("a call of a computed callable")
        for arg in node.args + [k.value for k in node.keywords]:
            if isinstance(arg, ast.Starred):
                arg = arg.value
            if isinstance(arg, ast.Name):
                if arg.id in self.defined:
                    self.refuse(f"{arg.id} passed to a call")
                elif arg.id not in self.bound:
                    self.checks.append((arg.id, ()))
        self.generic_visit(node)
