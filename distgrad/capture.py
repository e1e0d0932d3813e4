"""Deferred with-block bodies: lift the body of ``with tracer.invoke(...):`` out of its frame.

An invoke body cannot run where it is written: the batch is known only once every invoke has
been declared. So at ``__enter__`` we compile the body's statements (from the source, keeping the
file name and line numbers, so tracebacks point at the user's own lines), make the interpreter
skip them (a one-shot line trace that raises ``SkipBody``), and run the code later as a
coroutine of the batched forward. Afterwards the names the body bound are written back into the
caller's frame: a saved value as itself, anything else as a placeholder whose every use raises
``NotSavedError`` saying what happened.
"""

from __future__ import annotations

import ast
import linecache
import sys

from .errors import NotSavedError
from .torch_internals import locals_to_fast


class SkipBody(Exception):
    """Raised on the first line of a captured body so that it does not run in place.

    It is raised from a trace function, and CPython answers an exception there by switching
    tracing off: the thread's trace function and the frame's own. They may be a debugger's or
    coverage's, so the block's ``__exit__`` puts both back with ``resume_tracing``; otherwise
    breakpoints and coverage would stop at the first captured body."""

    def __init__(self, frame=None, previous_trace=None, previous_local=None):
        super().__init__()
        self.frame, self.previous_trace, self.previous_local = frame, previous_trace, previous_local


def resume_tracing(skipped: SkipBody) -> None:
    """Reinstall the trace functions that raising ``skipped`` switched off, if there were any."""
    if skipped.previous_trace is not None:
        sys.settrace(skipped.previous_trace)
        skipped.frame.f_trace = skipped.previous_local
    skipped.frame = None  # no cycle through the traceback's frames


_trees: dict = {}
_bodies: dict = {}  # (file, line of the with) -> (lines, source, (code, names, first line))


# What a captured body is, in messages: (the block, what to do instead of capturing it)
INVOKE_BODY = ("`with tracer.invoke(...):` body", "or trace without invokes")
PIPELINE_BODY = (
    "pipeline trace's body (`with model.trace(...):` over a pipeline schedule, "
    "run once per microbatch)",
    "such as a script run with torchrun",
)


def capture(frame, what: tuple = INVOKE_BODY) -> tuple:
    """Compile the body of the ``with`` statement that ``frame`` is entering. ``what``:
    ``INVOKE_BODY`` or ``PIPELINE_BODY``, for the wording of errors."""
    filename = frame.f_code.co_filename
    lines = source_lines(frame)
    if not lines:
        raise RuntimeError(
            f"distgrad cannot read the source of {filename}, so a {what[0]} "
            f"there cannot be run later. Put the code in a file or notebook "
            f"cell, {what[1]}."
        )
    line = frame.f_lineno
    known = _bodies.get((filename, line))
    if known is not None and known[0] is lines:
        # a loop opens the same block every step: parse and compile once. linecache hands out
        # the same list while the file is unchanged, so this skips joining the file per trace.
        return known[2]
    source = "".join(lines)
    if known is not None and known[1] == source:
        _bodies[(filename, line)] = (lines, source, known[2])
        return known[2]
    node = find_with(frame, source)
    if node is None:
        raise RuntimeError(f"distgrad could not find the `with` statement at {filename}:{line}.")
    if one_line_body(node):
        raise SyntaxError(
            f"{filename}:{line}: put the {what[0]} on its own lines; distgrad "
            f"runs it later and cannot skip a one-line body."
        )
    code = compile(ast.Module(body=node.body, type_ignores=[]), filename, "exec")
    found = (code, bound_names(node.body), first_real_line(node.body))
    _bodies[(filename, line)] = (lines, source, found)
    return found


def source_lines(frame) -> list:
    """The lines of ``frame``'s file as linecache holds them (the same list while unchanged)."""
    return linecache.getlines(frame.f_code.co_filename, frame.f_globals)


def find_with(frame, source: str):
    """The ``with`` statement that ``frame`` is entering, parsed from its file's ``source``
    (kept parsed per file), or None."""
    filename = frame.f_code.co_filename
    tree = _trees.get(filename)
    if tree is None or tree[0] != source:
        tree = _trees[filename] = (source, ast.parse(source, filename))
    return _innermost_with(tree[1], frame.f_lineno)


def one_line_body(node) -> bool:
    """Whether the body starts on the with's own line (``with m.trace(x): y = ...``): such a
    body cannot be skipped line by line."""
    return node.body[0].lineno <= max(item.context_expr.end_lineno for item in node.items)


def first_real_line(body) -> int | None:
    """Line of the first statement that does something. ``pass`` and bare constants compile to
    NOPs that no exception handler covers, so the skip must fire on a later line; a body of
    only such statements needs no skipping at all."""
    for stmt in body:
        if not (
            isinstance(stmt, ast.Pass)
            or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
        ):
            return stmt.lineno
    return None


def _innermost_with(tree, line: int):
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and node.lineno <= line <= max(
            item.context_expr.end_lineno for item in node.items
        ):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


def bound_names(body) -> list[str]:
    names: list[str] = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            return  # their insides are their own scope
        if isinstance(
            node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        ):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.append(node.id)
        elif isinstance(node, ast.alias):
            names.append((node.asname or node.name).split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in body:
        visit(stmt)
    return list(dict.fromkeys(names))


def skip(frame, line: int | None) -> None:
    """Make ``frame`` raise ``SkipBody`` when it reaches ``line`` instead of running it."""
    if line is None:
        return
    previous_global = sys.gettrace()
    if previous_global is None:
        sys.settrace(_no_trace)  # local tracing needs a global trace function
    frame.f_trace_lines = True
    frame.f_trace = _SkipAt(line, previous_global, frame.f_trace)


def _no_trace(*args):
    return None


class _SkipAt:
    """The one-shot line trace ``skip`` installs. An object rather than a closure: a local
    trace function returns itself, and a closure that names itself is a reference cycle."""

    __slots__ = ("line", "previous_global", "previous_local")

    def __init__(self, line, previous_global, previous_local):
        self.line, self.previous_global, self.previous_local = line, previous_global, previous_local

    def __call__(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line:
            raise SkipBody(frame, self.previous_global, self.previous_local)
        return self


class NotSaved:
    """Stands in for a name an invoke body bound without saving it."""

    __slots__ = ("_name", "_where")

    def __init__(self, name: str, where: str = "inside a `with tracer.invoke(...):` block"):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_where", where)

    def _fail(self, *args, **kwargs):
        name = object.__getattribute__(self, "_name")
        where = object.__getattribute__(self, "_where")
        raise NotSavedError(
            f"name {name!r} was bound {where} but not saved. Such a body runs later than it is "
            f"written, and only saved values come back: write `{name} = (...).save()` or "
            f"`distgrad.save({name})` in the body."
        )


for _dunder in (
    "__getattr__",
    "__repr__",
    "__str__",
    "__bool__",
    "__len__",
    "__iter__",
    "__getitem__",
    "__setitem__",
    "__call__",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__matmul__",
    "__neg__",
    "__float__",
    "__int__",
    "__index__",
    "__format__",
    "__eq__",
    "__lt__",
    "__gt__",
    "__array__",
    "__contains__",
    "__setattr__",
):
    setattr(NotSaved, _dunder, NotSaved._fail)
NotSaved.__hash__ = None


def write_back(frame, values: dict) -> None:
    """Bind ``values`` as names in the caller's frame (module, class or function scope)."""
    if frame.f_locals is frame.f_globals or sys.version_info >= (3, 13):
        for name, value in values.items():
            frame.f_locals[name] = value
        return
    local = frame.f_locals
    local.update(values)
    locals_to_fast(frame)


_CO_OPTIMIZED = 0x01  # a function's frame: its f_locals is a snapshot of the fast locals


def release_locals(frame) -> None:
    """Empty the snapshot dict that reading ``frame.f_locals`` left on a function's frame.

    Before Python 3.13 that dict keeps a reference to every local's value as it was when read,
    after the function deletes or rebinds the name, until something reads f_locals again: a
    trace's activations would outlive the user's ``del``. Any later read fills it afresh."""
    if sys.version_info < (3, 13) and frame.f_code.co_flags & _CO_OPTIMIZED:
        frame.f_locals.clear()
