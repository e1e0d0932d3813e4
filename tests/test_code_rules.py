"""Rules of the code base that a reader relies on, checked on the source of distgrad/:
every private PyTorch internal is reached through distgrad/torch_internals.py (one place to
audit when torch changes), no underscore name is imported from another module, and the core
uses only what the engines declare (``engines/base.py``). How modules import one another:
test_import_layers.py."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "distgrad"

# Private attributes of torch objects that distgrad reads or writes.
TORCH_PRIVATE_ATTRS = {
    "_backward_hooks",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_register_hook_dict",
    "next_id",
    "_version",
    "_base",
    "_modules",
    "_get_default_store",
    "_allgather_base",
    "_orig_mod",
    "_maybe_compute_loss",
    "_internal_losses",
    "_n_microbatches",
    "_stage",
    "_stages",
    "__closure__",
    "pythonapi",
}

# Hot paths that read the attribute inline, each under a comment naming its torch_internals
# entry: a function call there would cost every read (benchmarks/bytecodes.py counts it).
INLINE_HOT_PATHS = {
    ("interleave/points.py", "ModulePoint.arm"),
    ("interleave/points.py", "ModulePoint.remove"),
    ("interleave/session.py", "Pause.__init__"),
    ("interleave/session.py", "Pause.edited"),
}


def _torch_internal_uses(tree):
    """(line, enclosing function's qualified name and first line, what) for each torch
    internal touched."""
    found = []

    def visit(node, scope, start):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope, start = (f"{scope}.{node.name}" if scope else node.name), node.lineno
        what = None
        if isinstance(node, ast.Attribute):
            if node.attr in TORCH_PRIVATE_ATTRS:
                what = node.attr
            elif (
                node.attr.startswith("_")
                and not node.attr.startswith("__")
                and ast.unparse(node).startswith("torch.")
            ):
                found.append((node.lineno, scope, start, ast.unparse(node)))
                return  # (torch._C._x: one use, not two)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in TORCH_PRIVATE_ATTRS or node.value.startswith("torch._"):
                what = repr(node.value)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = node.module.split(".") + [alias.name for alias in node.names]
            if any(part.startswith("_") for part in parts):
                what = f"from {node.module} import ..."
        if what is not None:
            found.append((node.lineno, scope, start, what))
        for child in ast.iter_child_nodes(node):
            visit(child, scope, start)

    visit(tree, "", 1)
    return found


def _name(path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_torch_internals_are_reached_through_one_module():
    outside = []
    for path, tree in _sources():
        if path.name == "torch_internals.py":
            continue
        for line, scope, _, what in _torch_internal_uses(tree):
            if (_name(path), scope) not in INLINE_HOT_PATHS:
                outside.append(f"{path.relative_to(PACKAGE)}:{line} ({scope}): {what}")
    assert not outside, "torch internals outside torch_internals.py:\n" + "\n".join(outside)


def test_inline_hot_paths_name_their_entry():
    """Each hot path that reads a torch internal inline says which torch_internals entry it
    copies, so that an audit of that entry finds the copy."""
    for path, tree in _sources():
        lines = path.read_text().splitlines()
        for line, scope, start, what in _torch_internal_uses(tree):
            if (_name(path), scope) in INLINE_HOT_PATHS:
                above = "\n".join(lines[start - 1 : line])
                assert "torch_internals." in above, f"{_name(path)}:{line} ({scope}): {what}"


def test_the_checks_see_what_they_look_for():
    uses = _torch_internal_uses(
        ast.parse(
            "def f(t, m):\n"
            "    t._backward_hooks\n"
            "    torch._C._set_grad_enabled(False)\n"
            "    getattr(m, '_stages', None)\n"
            "from torch.utils import _pytree\n"
        )
    )
    assert [(line, scope) for line, scope, _, _ in uses] == [(2, "f"), (3, "f"), (4, "f"), (5, "")]


def test_no_underscore_name_is_imported_across_modules():
    crossing = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                crossing += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
    assert not crossing, "underscore names imported from other modules:\n" + "\n".join(crossing)


def test_no_underscore_name_is_read_from_another_module():
    """``from . import capture`` then ``capture._helper``: the same crossing, by attribute."""
    crossing = []
    for path, tree in _sources():
        modules = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level > 0 and not node.module
            for alias in node.names
        }
        crossing += [
            f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ]
    assert not crossing, "underscore names read from other modules:\n" + "\n".join(crossing)


def _engine_uses(tree):
    """(line, role, what) for each attribute the code reads on an engine (``engine.x``,
    ``self.engine.x``, ``self._engine.x``, ``self.backend.x``: role ``"engine"``) or on an
    engine's views of sharded values (``session.views.x``, ``self.views.x``, ``views.x``: role
    ``"views"``), and each ``getattr`` on either (which would hide an undeclared name)."""
    engine_names = {"engine", "_engine", "backend"}

    def role(node):
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if name in engine_names:
            return "engine"
        return "views" if name == "views" else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and role(node.value) is not None:
            found.append((node.lineno, role(node.value), node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and role(node.args[0]) is not None
        ):
            found.append((node.lineno, "getattr", ast.unparse(node)))
    return found


def test_the_core_uses_only_what_engines_declare():
    """The core (distgrad/, but not the engines or the demos) calls an engine only through what
    ``engines.base.Engine`` declares, and an engine's ``views`` only through what
    ``engines.base.ShardViews`` declares: base.py is the whole interface. The engines too reach
    ``views`` only through ``ShardViews`` (``Engine.output_holders``, the end of a trace), but
    for tensor_parallel.py, which makes its own. (What a body asks for reaches an engine's own
    run through ``requests.Requests``, the core's seam.)"""
    from distgrad.engines.base import Engine, ShardViews

    declared = {"engine": Engine, "views": ShardViews}
    undeclared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        inside = path.relative_to(PACKAGE).parts
        if inside[0].startswith("demo") or inside == ("engines", "tensor_parallel.py"):
            continue
        checked = {"views"} if inside[0] == "engines" else {"engine", "views", "getattr"}
        for line, role, what in _engine_uses(ast.parse(path.read_text(), str(path))):
            if role in checked and (role == "getattr" or not hasattr(declared[role], what)):
                undeclared.append(f"{path.relative_to(PACKAGE)}:{line}: {role} {what}")
    assert not undeclared, "undeclared engine interface:\n" + "\n".join(undeclared)


def test_the_checks_see_the_views_the_core_calls():
    """The check above finds the core's calls on ``views`` (it would pass on finding none)."""
    session = (PACKAGE / "interleave" / "session.py").read_text()
    gradients = (PACKAGE / "interleave" / "gradients.py").read_text()
    seen = {
        what
        for source in (session, gradients)
        for _, role, what in _engine_uses(ast.parse(source))
        if role == "views"
    }
    assert {"show", "place", "show_grad", "place_grad", "source"} <= seen, seen


def test_tensor_parallel_views_implement_what_is_declared():
    from distgrad.engines.base import ShardViews
    from distgrad.engines.tensor_parallel import TensorParallelViews

    declared = [name for name in vars(ShardViews) if not name.startswith("_")]
    assert issubclass(TensorParallelViews, ShardViews)
    missing = [name for name in declared if name not in vars(TensorParallelViews)]
    assert not missing, f"TensorParallelViews does not implement {missing}"


def test_an_engine_around_another_passes_on_all_it_declares():
    """accelerate's and Fabric's engines run around the engine of what they wrap: every member
    ``Engine`` declares must reach that inner engine (a method left to ``Engine``'s default
    would do nothing under that library, as the reduction of parameters beside the model once
    did under Fabric)."""
    from distgrad.engines.around import EngineAround
    from distgrad.engines.base import Engine

    declared = {name for name in vars(Engine) if not name.startswith("_")}
    # what the library itself decides, not the inner engine: its name, its own backward
    own = {"name", "own_backward"}
    missing = sorted(name for name in declared - own if name not in vars(EngineAround))
    assert not missing, f"EngineAround leaves these to Engine's defaults: {missing}"
