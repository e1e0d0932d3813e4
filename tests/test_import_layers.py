"""Imports go down: distgrad's modules in layers (the core, the demos, the pipeline folder),
each importing only from its own layer or the ones below, with no circle; checked on the
source."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "distgrad"


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


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
    (
        "what a body touches",
        lambda m: m in {"envoy", "backward", "gradpatch", "saving", "saveable", "steps"},
    ),
    ("engines", lambda m: m.split(".")[0] == "engines"),
    ("the trace", lambda m: m == "trace"),
    ("the package", lambda m: m == "__init__"),
    (
        "integrations with training libraries",
        lambda m: m in {"trainer", "lightning", "step_records"},
    ),
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
