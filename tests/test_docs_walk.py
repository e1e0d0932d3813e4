"""The walk of one value in docs/concepts.rst ("One value, from the body to the hook" and
"Adding a request kind") names the code as it is: every file, class, function and attribute it
names in double backquotes exists in distgrad/, read off the source (no import)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distgrad"
SECTIONS = ("One value, from the body to the hook", "Adding a request kind")


def _walk_text() -> str:
    text = (ROOT / "docs" / "concepts.rst").read_text()
    start = text.index(SECTIONS[0] + "\n")
    end = text.index(SECTIONS[1] + "\n")
    tail = text[end:]
    following = re.search(r"\n\n([^\n]+)\n-{3,}\n", tail[len(SECTIONS[1]) + 1 :])
    return text[start : end + (len(tail) if following is None else following.start())]


def _source_names():
    """(files, classes, modules): the paths under distgrad/, each class's attributes (methods,
    class attributes, ``self.x`` assignments) and each module's top-level names."""
    files, classes, modules = set(), {}, {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        files.add(rel)
        tree = ast.parse(path.read_text())
        top = modules.setdefault(path.stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                top.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                top.add(node.target.id)
            elif isinstance(node, ast.ImportFrom):
                top.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = classes.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                        names.add(item.attr)
                    elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                        names.add(item.id)
    return files, classes, modules


def _constant(name: str, modules: dict) -> bool:
    return any(name in names for names in modules.values())


TORCH_NAMES = {"Tensor"}  # torch's own, named where the walk meets PyTorch (Tensor.backward)


def _unknown(text: str) -> list:
    """What ``text`` names in double backquotes that distgrad's source does not have."""
    files, classes, modules = _source_names()
    unknown = []
    for token in sorted(set(re.findall(r"``([^`]+)``", text))):
        if token.endswith(".py"):
            path = token.removeprefix("distgrad/")
            if not any(f == path or f.endswith("/" + path) for f in files):
                unknown.append(f"file {token}")
            continue
        if not re.fullmatch(r"[A-Za-z_][\w.]*", token):
            continue  # code, not a name: `...output = v`, `"output"`, `h.grad = ...`
        head, _, attr = token.partition(".")
        attr = attr.split(".")[0]
        if head in TORCH_NAMES:
            continue
        if not attr:
            if head[0].isupper() and head not in classes and not _constant(head, modules):
                unknown.append(f"class or constant {head}")
            continue
        # `Session.x` (a class), `session.x` (its module, or an instance of Session named so)
        owners = [classes[c] for c in classes if c == head or c.lower() == head]
        owners += [modules[head]] if head in modules else []
        if not owners:
            if head[0].isupper():
                unknown.append(f"class {head}")
        elif not any(attr in names for names in owners):
            unknown.append(f"{head} has no {attr}")
    return unknown


def test_the_walk_names_the_code_as_it_is():
    unknown = _unknown(_walk_text())
    assert not unknown, "docs/concepts.rst's walk names what the code does not have:\n" + (
        "\n".join(unknown)
    )


def test_the_check_finds_a_wrong_name():
    """The check is not empty: names that are gone, or never were, are found."""
    wrong = "``Session.request_solo``, ``GreenletRun``, ``fastpath/driver.py``, ``session.spare``"
    assert len(_unknown(wrong)) == 4, _unknown(wrong)
    assert _unknown("``Session.request_single``, ``GreenletTransport.hand``, ``kinds.py``") == []
