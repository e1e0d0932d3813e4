"""Rules of the code base that a reader relies on, checked on the source of distgrad/:
every private PyTorch internal is reached through distgrad/torch_internals.py (one place to
audit when torch changes), and no underscore name is imported from another module."""

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


# distgrad/demo/: which of its modules each may import. The models and the shared set-up are
# leaves (tests and benchmarks import them without pulling a demo in); each demo takes only
# from those; __main__ alone picks a demo.
DEMO_LAYERS = {
    "models": set(),
    "ranks": set(),
    "local": {"models"},
    "data_parallel": {"models", "ranks"},
    "tensor_parallel": {"models", "ranks"},
    "pipeline": {"models", "ranks"},
    "__main__": {"local", "data_parallel", "tensor_parallel", "pipeline"},
    "__init__": set(),
}


def _demo_imports(tree) -> set[str]:
    """The distgrad.demo modules a module imports, anywhere in it (function bodies too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:  # from . import x / from .x import y
                found |= {module} if module else {alias.name for alias in node.names}
            elif module.startswith("distgrad.demo"):
                rest = module[len("distgrad.demo") :].lstrip(".")
                found |= {rest} if rest else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {
                alias.name[len("distgrad.demo.") :]
                for alias in node.names
                if alias.name.startswith("distgrad.demo.")
            }
    return found


def test_demo_imports_go_down():
    demo = PACKAGE / "demo"
    assert sorted(path.stem for path in demo.glob("*.py")) == sorted(DEMO_LAYERS)
    upward = [
        f"demo/{path.name} imports {name}"
        for path in sorted(demo.glob("*.py"))
        for name in sorted(_demo_imports(ast.parse(path.read_text())))
        if name not in DEMO_LAYERS[path.stem]
    ]
    assert not upward, "imports against distgrad/demo's layers:\n" + "\n".join(upward)
    models = ast.parse((demo / "models.py").read_text())
    roots = {
        alias.name.split(".")[0]
        for node in ast.walk(models)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    roots |= {
        (node.module or "").split(".")[0]
        for node in ast.walk(models)
        if isinstance(node, ast.ImportFrom) and node.level == 0
    }
    assert roots <= {"__future__", "logging", "torch", "transformers"}, roots


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


# distgrad's modules in layers, lowest first. A module imports only from its own layer or the
# ones below (at module level: a function-level import is for an optional dependency, never
# for a distgrad module), so data flows down; and no two modules import each other in a circle.
CORE_LAYERS = (
    (
        "leaves",
        lambda m: (
            m
            in {
                "config",
                "errors",
                "torch_internals",
                "patches",
                "capture",
                "wrappers",
                "cpp_backtrace",
            }
        ),
    ),
    ("the protocol", lambda m: m.split(".")[0] == "interleave"),
    ("what a body touches", lambda m: m in {"envoy", "backward", "gradpatch", "saving"}),
    ("engines", lambda m: m.split(".")[0] == "engines"),
    ("the trace", lambda m: m == "trace"),
    ("the package", lambda m: m == "__init__"),
    ("integrations with training libraries", lambda m: m == "trainer"),
    ("tools built on traces", lambda m: m.split(".")[0] == "flow"),
)


def _module_name(path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _imports_of(path, tree):
    """(line, distgrad module, at module level?) for each import of a distgrad module, with
    typing-only imports (``if TYPE_CHECKING:``) left out."""
    package = list(path.relative_to(PACKAGE).parent.parts)
    known = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    top = {id(node) for node in tree.body}
    typing_only = {
        id(node)
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)] + (node.module or "").split(".")
            base = ".".join(part for part in base if part)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                targets.append(sub if sub in known else base or "__init__")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
            )
            targets += [name[len("distgrad.") :] for name in names if name.startswith("distgrad.")]
        found += [(node.lineno, target, id(node) in top) for target in targets]
    return found


def _layer(module: str):
    return next((i for i, (_, test) in enumerate(CORE_LAYERS) if test(module)), None)


def test_imports_go_down():
    wrong, graph = [], {}
    for path, tree in _sources():
        module = _module_name(path)
        if module.split(".")[0] == "demo":  # (test_demo_imports_go_down)
            continue
        layer = _layer(module)
        assert layer is not None, f"{module}: in no layer of CORE_LAYERS"
        for line, target, at_top in _imports_of(path, tree):
            if target.split(".")[0] == "demo":
                wrong.append(f"{module}:{line}: imports the demos ({target})")
            elif not at_top and target != "engines.fsdp1":  # (fsdp: half a second to import)
                wrong.append(f"{module}:{line}: imports {target} inside a function")
            elif _layer(target) > layer:
                wrong.append(
                    f"{module}:{line}: imports {target}, a layer above "
                    f"({CORE_LAYERS[_layer(target)][0]})"
                )
            graph.setdefault(module, set()).add(target)
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)
    # no circle: repeatedly drop the modules that import nothing left
    left = {m: {t for t in ts if t != m} for m, ts in graph.items()}
    while True:
        done = [m for m, ts in left.items() if not ts & left.keys()]
        if not done:
            break
        for m in done:
            del left[m]
    assert not left, f"modules that import one another in a circle: {sorted(left)}"


# distgrad/engines/pipeline/: which of its modules each may import, typing-only imports
# included. The run and its parts read the engine only through adapter.py's declarations; the
# engines build the run (schedule_run.py) and hand it themselves, so data flows down.
PIPELINE_LAYERS = {
    "placement": set(),
    "value_stages": set(),
    "checks": set(),
    "messages": set(),
    "waits": set(),
    "body_requests": set(),
    "direct": set(),
    "threaded": set(),
    "adapter": {"placement"},
    "schedule_run": {
        "adapter",
        "body_requests",
        "checks",
        "direct",
        "messages",
        "threaded",
        "value_stages",
        "waits",
    },
    "engine": {"adapter", "schedule_run"},
    "deepspeed_pipe": {"adapter", "schedule_run"},
    "__init__": {"adapter", "deepspeed_pipe", "engine", "schedule_run"},
}


def test_pipeline_imports_go_down():
    folder = PACKAGE / "engines" / "pipeline"
    assert sorted(path.stem for path in folder.glob("*.py")) == sorted(PIPELINE_LAYERS)
    upward = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = {node.module} if node.module else {a.name for a in node.names}
                upward += [
                    f"engines/pipeline/{path.name} imports {name}"
                    for name in sorted(names - PIPELINE_LAYERS[path.stem])
                ]
    assert not upward, "imports against engines/pipeline's layers:\n" + "\n".join(upward)
