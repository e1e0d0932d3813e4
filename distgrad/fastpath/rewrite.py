"""The rewrite that turns a trace body into a generator, and its compiled plan.

``survey.py`` decides whether a body qualifies; this file rewrites one that does:
``X.output`` (and ``.grad``) becomes ``(v if (v := X.output) is not PAUSED else
(yield v))``; ``.input`` / ``.inputs`` are read again after the pause; an assignment
``X.output = e`` first makes sure the run is at ``X``; ``with t.backward():`` leaves the forward
before it opens and the backward at its end. The code keeps the file name and line numbers, so
tracebacks and debuggers show the user's own lines.
"""
from __future__ import annotations

import ast
import types

from .. import capture
from ..interleave.paused import PAUSED
from .survey import REQUESTS, Survey, checks_pass, has_request, is_backward

_ARGS = ("_dg_out", "_dg_ns", "_dg_P", "_dg_leave", "_dg_ready", "_dg_body", "_dg_output",
         "_dg_grad", "_dg_set_grad", "_dg_save")


class Plan:
    """A body compiled as a generator function, and what to check before each run of it."""

    __slots__ = ("code", "names", "params", "first_line", "checks")

    def __init__(self, code, names, params, first_line, checks):
        self.code = code              # the generator function's code
        self.names = names            # names the body binds: written back afterwards
        self.params = params          # the frame's own locals the body uses
        self.first_line = first_line  # where the body is skipped in place
        self.checks = checks          # ((name, attrs), ...) callables to look at per trace

    def allowed(self, namespace: dict, frame) -> bool:
        """Whether the callables the body names are, this time, ones that cannot ask for values."""
        return checks_pass(self.checks, namespace, frame)


_plans: dict = {}  # (code object, line) -> (source lines, Plan or None)


def plan_for(frame) -> Plan | None:
    """The generator plan for the body of the ``with`` that ``frame`` is entering, or None
    when it must run in place. Parsed and compiled once per site and source."""
    key = (frame.f_code, frame.f_lineno)
    known = _plans.get(key)
    lines = capture.source_lines(frame)
    if known is not None and known[0] is lines:
        return known[1]
    plan = None
    in_class = not frame.f_code.co_flags & 0x02 and frame.f_locals is not frame.f_globals
    if lines and not in_class:
        try:
            node = capture.find_with(frame, "".join(lines))
        except (SyntaxError, ValueError):
            node = None
        if node is not None and not capture.one_line_body(node):
            try:
                plan = _make_plan(frame, node)
            except SyntaxError:  # legal where it stands, not inside a function: run in place
                plan = None
    _plans[key] = (lines, plan)
    return plan


def _make_plan(frame, node) -> Plan | None:
    first = capture.first_real_line(node.body)
    names = capture.bound_names(node.body)
    survey = Survey(set(names), {n.name for n in ast.walk(node) if isinstance(
        n, (ast.FunctionDef, ast.ClassDef))})
    for stmt in node.body:
        survey.visit(stmt)
    if survey.reason is not None or not survey.requests or first is None:
        return None
    used = {n.id for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    code = frame.f_code
    if code.co_flags & 0x02:  # a function: its own locals the body uses, bound or read
        own = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
        if not own.issuperset(names):  # it binds a name the function declares global
            return None
        params = tuple(sorted(used & own))
    else:  # a module: the globals the body binds (a read of one before it binds it still works)
        params = tuple(sorted(used & set(names)))
    body = [_Rewrite().visit(stmt) for stmt in node.body]
    body = [s for stmt in body for s in (stmt if isinstance(stmt, list) else [stmt])]
    fn_code = _compile(frame, node, params, body)
    return Plan(fn_code, tuple(names), params, first, tuple(survey.checks))


def _compile(frame, node, params, body):
    line = node.body[0]
    prologue = [_at(ast.If(test=ast.Compare(ast.Constant(p), [ast.In()], [_name("_dg_ns")]),
                           body=[ast.Assign([_name(p, ast.Store())],
                                            ast.Subscript(_name("_dg_ns"), ast.Constant(p),
                                                          ast.Load()))],
                           orelse=[]), line) for p in params]
    keep = _at(ast.Expr(ast.Call(ast.Attribute(_name("_dg_out"), "update", ast.Load()),
                                 [ast.Call(_name("locals"), [], [])], [])), node.body[-1])
    guarded = _at(ast.Try(body=body, handlers=[], orelse=[], finalbody=[keep]), line)
    name = frame.f_code.co_name
    fields = dict(name=name if name.isidentifier() else "trace_body",
                  args=ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in _ARGS],
                                     kwonlyargs=[], kw_defaults=[], defaults=[]),
                  body=prologue + [guarded], decorator_list=[], returns=None)
    if "type_params" in ast.FunctionDef._fields:
        fields["type_params"] = []
    fn = _at(ast.FunctionDef(**fields), line)
    module = ast.Module(body=[fn], type_ignores=[])
    ast.fix_missing_locations(module)
    compiled = compile(module, frame.f_code.co_filename, "exec")
    return next(c for c in compiled.co_consts if isinstance(c, types.CodeType))


def start(plan: Plan, frame, namespace: dict, driver):
    """A new generator of ``plan``'s body, with the frame's globals and its locals' values."""
    fn = types.FunctionType(plan.code, frame.f_globals)
    out: dict = {}
    return fn(out, namespace, PAUSED, driver.leave, driver.ready, driver.body, driver.read_output,
              driver.read_grad, driver.set_grad, driver.save), out


# -- the rewrite ---------------------------------------------------------------------------
def _name(name: str, ctx=None):
    return ast.Name(name, ctx or ast.Load())


def _at(node, like):
    """Give ``node`` and its new sub-nodes the location of the user's ``like``."""
    for sub in ast.walk(node):
        if "lineno" in sub._attributes and not hasattr(sub, "lineno"):
            ast.copy_location(sub, like)
    return node


def _wait_if(call, like):
    """``if (_dg_w := call) is not None: yield _dg_w``"""
    test = ast.Compare(ast.NamedExpr(_name("_dg_w", ast.Store()), call), [ast.IsNot()],
                       [ast.Constant(None)])
    return _at(ast.If(test=test, body=[ast.Expr(ast.Yield(_name("_dg_w")))], orelse=[]), like)


def _at_grad_of(name: str):
    """``(_dg_s := _dg_body.stop) is not None and _dg_s.tensor is name``: the body is at this
    tensor's gradient already (``t.grad = t.grad * 2``)."""
    stop = ast.NamedExpr(_name("_dg_s", ast.Store()), ast.Attribute(_name("_dg_body"), "stop",
                                                                    ast.Load()))
    return ast.BoolOp(ast.And(), [
        ast.Compare(stop, [ast.IsNot()], [ast.Constant(None)]),
        ast.Compare(ast.Attribute(_name("_dg_s"), "tensor", ast.Load()), [ast.Is()],
                    [_name(name)])])


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict):
        self.names = names

    def visit_Name(self, node):
        new = self.names.get(node.id)
        return ast.copy_location(ast.Name(new, node.ctx), node) if new else node


class _Rewrite(ast.NodeTransformer):
    def __init__(self):
        self.n = 0

    def _tmp(self, kind: str) -> str:
        self.n += 1
        return f"_dg_{kind}{self.n}"

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr not in REQUESTS or not isinstance(node.ctx, ast.Load):
            return node
        v = self._tmp("v")
        if node.attr in ("output", "grad"):  # the hook sends the very value the read gives
            read = ast.Call(_name(f"_dg_{node.attr}"), [node.value], [])
            waited = ast.Yield(_name(v))
        else:  # .input / .inputs: read again at the stop
            r = self._tmp("r")
            read = ast.Attribute(ast.NamedExpr(_name(r, ast.Store()), node.value), node.attr,
                                 ast.Load())
            waited = ast.Subscript(ast.Tuple([ast.Yield(_name(v)),
                                              ast.Attribute(_name(r), node.attr, ast.Load())],
                                             ast.Load()), ast.Constant(1), ast.Load())
        test = ast.Compare(ast.NamedExpr(_name(v, ast.Store()), read), [ast.IsNot()],
                           [_name("_dg_P")])
        return _at(ast.IfExp(test=test, body=_name(v), orelse=waited), node)

    def visit_Call(self, node):
        self.generic_visit(node)
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "save" and not node.args
                and not node.keywords):  # `x.save()`: the driver's save
            return _at(ast.Call(_name("_dg_save"), [func.value], []), node)
        return node

    def _store(self, node, target, rebuild):
        """``t.attr = e`` / ``t.attr op= e``: be at t's value before assigning it."""
        recv = self._tmp("t")
        before = [ast.Assign([_name(recv, ast.Store())], self.visit(target.value))]
        ready = ast.Call(_name("_dg_ready"), [_name(recv), ast.Constant(target.attr)], [])
        store = ast.Attribute(_name(recv), target.attr, ast.Store())
        return [_at(s, node) for s in before] + [_wait_if(ready, node), _at(rebuild(store), node)]

    def visit_Assign(self, node):
        target = node.targets[0]
        if len(node.targets) == 1 and isinstance(target, ast.Attribute) and target.attr in REQUESTS:
            value = self._tmp("e")  # the value first, as Python evaluates it
            first = _at(ast.Assign([_name(value, ast.Store())], self.visit(node.value)), node)
            stores = self._store(node, target, lambda t: ast.Assign([t], _name(value)))
            if target.attr != "grad":
                return [first] + stores
            # at that gradient already (`t.grad = t.grad * 2`): the driver's set_grad
            recv = stores[0].targets[0].id
            direct = ast.Expr(ast.Call(_name("_dg_set_grad"), [_name("_dg_s"), _name(recv),
                                                               _name(value)], []))
            branch = ast.If(test=_at_grad_of(recv), body=[direct], orelse=stores[1:])
            return [first, stores[0], _at(branch, node)]
        if isinstance(node.value, ast.ListComp) and has_request(node.value):
            stmts, result = self._expand(node.value, node)
            node.targets = [self.visit(t) for t in node.targets]
            node.value = _at(_name(result), node)
            return stmts + [node]
        return self.generic_visit(node)

    def visit_AugAssign(self, node):
        target = node.target
        if isinstance(target, ast.Attribute) and target.attr in REQUESTS:
            value = self.visit(node.value)
            return self._store(node, target, lambda t: ast.AugAssign(t, node.op, value))
        return self.generic_visit(node)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.ListComp) and has_request(node.value):
            return self._expand(node.value, node)[0]
        return self.generic_visit(node)

    def _expand(self, comp, like):
        """A list comprehension as the loop it stands for, its variables renamed apart."""
        result = self._tmp("l")
        names = {}
        for gen in comp.generators:
            for sub in ast.walk(gen.target):
                if isinstance(sub, ast.Name):
                    names[sub.id] = f"_dg_c{self.n}_{sub.id}"
        rename = _Rename(names)
        inner = ast.Expr(ast.Call(ast.Attribute(_name(result), "append", ast.Load()),
                                  [rename.visit(comp.elt)], []))
        for i, gen in reversed(list(enumerate(comp.generators))):
            body = [inner]
            for cond in reversed(gen.ifs):
                body = [ast.If(rename.visit(cond), body, [])]
            source = gen.iter if i == 0 else rename.visit(gen.iter)
            inner = ast.For(target=rename.visit(gen.target), iter=source, body=body, orelse=[])
        start = ast.Assign([_name(result, ast.Store())], ast.List([], ast.Load()))
        return [_at(start, like), self.visit(_at(inner, like))], result

    def visit_With(self, node):
        if not any(is_backward(item) for item in node.items):
            return self.generic_visit(node)
        call = node.items[0].context_expr
        tensor = self._tmp("b")
        first = _at(ast.Assign([_name(tensor, ast.Store())], self.visit(call.func.value)), node)
        call.func.value = _at(_name(tensor), call)
        leave = ast.Call(_name("_dg_leave"), [], [])
        body = []
        for stmt in node.body:
            new = self.visit(stmt)
            body.extend(new if isinstance(new, list) else [new])
        if node.items[0].optional_vars is not None:
            node.items[0].optional_vars = self.visit(node.items[0].optional_vars)
        node.body = body + [_wait_if(leave, node.body[-1])]
        return [first, _wait_if(leave, node), node]

