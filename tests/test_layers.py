"""No import runs back up: each package of edge0_eval (and model_wrappers) imports only the
layers below it, read from the source (lazy imports inside functions too), its subpackages'
files included. The verbs at the top level may import any package; no package imports a verb
or the command line.

    errors  <  formats/  <  engine/  <  api  <  arguments/, evaluation/  <  training/
            <  checkpoints/, server/  <  model_wrappers  <  the verbs, cli.py

api is edge0_eval/__init__.py: the names it exports (imported lazily, from its `_API` table)
come from the layers below it, so `from edge0_eval import Engine` is an import of the engine.

Inside evaluation/ and model_wrappers, the subpackages (and top-level modules) import each
other one way only: no cycle between them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BELOW = {
    "errors": set(),
    "formats/": {"errors"},
    "engine/": {"errors", "formats/"},
    "api": {"errors", "formats/", "engine/"},
    "arguments/": {"errors", "formats/", "engine/", "api"},
    "evaluation/": {"errors", "formats/", "engine/", "api"},
    "training/": {"errors", "formats/", "engine/", "api", "arguments/"},
    "checkpoints/": {"errors", "formats/", "engine/", "api", "training/"},
    "server/": {"errors", "formats/", "engine/", "api", "evaluation/"},
    "model_wrappers": {"errors", "formats/", "engine/", "api", "evaluation/"},
}


def _unit(module: str) -> str:
    """The layer a module belongs to: its package folder, or a top-level module's name."""
    parts = module.split(".")
    if module == "edge0_eval":
        return "api"
    if parts[0] == "model_wrappers":
        return "model_wrappers"
    if len(parts) == 1:
        return "edge0_eval"
    return f"{parts[1]}/" if (REPO / "edge0_eval" / parts[1]).is_dir() else parts[1]


def _exists(module: str) -> bool:
    path = REPO / module.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The project modules `path` imports, anywhere in the file."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if module == "edge0_eval.__init__" and isinstance(node, ast.Dict):  # API table
            found |= {v.value for v in node.values if isinstance(v, ast.Constant)}
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("edge0_eval", "model_wrappers") and _exists(name):
                found.add(name)
    return found


def _files(layer: str) -> list[Path]:
    if layer == "api":
        return [REPO / "edge0_eval" / "__init__.py"]
    if layer == "model_wrappers":
        return sorted((REPO / "model_wrappers").rglob("*.py"))
    if layer.endswith("/"):
        return sorted((REPO / "edge0_eval" / layer).rglob("*.py"))
    return [REPO / "edge0_eval" / f"{layer}.py"]


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_layer_imports_only_layers_below(layer):
    up = {
        f"{path.relative_to(REPO)} -> {name}"
        for path in _files(layer)
        for name in _imports(path)
        if _unit(name) not in BELOW[layer] | {layer} and name != "model_wrappers"
    }
    assert not up, sorted(up)


def test_every_package_has_a_layer():
    packages = {
        f"{p.parent.name}/"
        for p in (REPO / "edge0_eval").glob("*/__init__.py")
        if p.parent.name != "__pycache__"
    }
    assert packages <= set(BELOW), packages - set(BELOW)


def _part(module: str, package: str) -> str:
    """The subpackage, or top-level module, of `package` that `module` belongs to."""
    return module[len(package) + 1 :].split(".")[0]


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as the path around it, or [] when it has none."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return []


@pytest.mark.parametrize("package", ["edge0_eval.evaluation", "model_wrappers"])
def test_subpackages_import_each_other_one_way(package):
    root = REPO / package.replace(".", "/")
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mine = _part(module, package)
        for name in _imports(path):
            if name.startswith(package + ".") and _part(name, package) != mine:
                graph.setdefault(mine, set()).add(_part(name, package))
    assert not _cycle(graph), " -> ".join(_cycle(graph))
