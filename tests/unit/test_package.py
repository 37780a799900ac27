"""The package as a newcomer meets it: the names the README uses import from ``deltackpt``, no
module imports itself back through others, and modules stay small."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import pkgutil
import re
import types

import pytest

import deltackpt

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Names the README writes in backticks that belong to other projects.
FOREIGN = {"EmbeddingBagCollection", "Replicate", "DistributedModelParallel", "ModelDeltaTracker"}


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package, with the subpackages installed from other folders."""
    found = {}
    for top in ("deltackpt", "deltackpt.kernels", "deltackpt.datasets"):
        package = importlib.import_module(top)
        found[top] = pathlib.Path(package.__file__)
        for m in pkgutil.walk_packages(package.__path__, f"{top}."):
            spec = importlib.util.find_spec(m.name)
            assert spec is not None and spec.origin is not None
            found[m.name] = pathlib.Path(spec.origin)
    return found


def test_every_class_name_the_readme_uses_imports_from_deltackpt():
    readme = (ROOT / "README.md").read_text()
    names = set(re.findall(r"`([A-Z][a-z]+[A-Z]?[A-Za-z]*)[`(]", readme)) - FOREIGN
    names |= set(re.findall(r"\bdeltackpt\.([A-Z]\w*)", readme))
    assert {"Checkpointer", "Intermittent", "Differential", "ChainLimit", "WriterConflictError"} <= names
    missing = sorted(n for n in names if not hasattr(deltackpt, n))
    assert not missing, f"the README uses names deltackpt does not export: {missing}"
    public = {n for n, v in vars(deltackpt).items() if not n.startswith("_")
              and not isinstance(v, types.ModuleType) and n != "annotations"}
    assert set(deltackpt.__all__) == public


def test_every_dotted_path_the_docs_name_resolves():
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    for path in sorted(set(re.findall(r"\bdeltackpt(?:\.\w+)+", text))):
        parts = path.split(".")
        for i in range(len(parts), 0, -1):  # the longest module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                assert hasattr(obj, attr), f"{path}: no {attr!r}"
                obj = getattr(obj, attr)
            break


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its code except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            found |= subs & known
            if subs - known:  # names defined in the module ``base`` itself
                found.add(base)
    return {m for m in found if m in known and m != name}


def test_no_import_cycles():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"], ["d"]]


def test_modules_stay_small():
    big = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    assert not {n: k for n, k in big.items() if k > 400}, "modules over 400 lines"


def test_the_package_is_typed_and_installed_whole():
    assert (ROOT / "deltackpt" / "py.typed").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(deltackpt(?:\.\w+)*)"', pyproject.split("packages = ", 1)[1].split("]", 1)[0]))
    packages = {n for n, p in modules().items() if p.name == "__init__.py"}
    assert packages == listed


def test_mypy_finds_nothing_in_the_package(monkeypatch):
    api = pytest.importorskip("mypy.api")
    monkeypatch.chdir(ROOT)  # the configuration in pyproject.toml names the files
    out, err, status = api.run([])
    assert status == 0, out + err
