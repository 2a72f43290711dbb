"""The runtime must import with torch, transformers and optimum unavailable."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import d2r_edge

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'optimum', 'export', 'd2r_edge_export'}:
            raise ImportError('blocked: ' + name)
        return None
sys.meta_path.insert(0, Block())
import importlib
for name in %r:
    importlib.import_module(name)
print('imported', len(%r))
"""


def test_every_runtime_module_imports_without_heavy_deps():
    names = ["d2r_edge"] + [m.name for m in pkgutil.walk_packages(d2r_edge.__path__, "d2r_edge.")]
    assert len(names) > 5
    out = subprocess.run([sys.executable, "-c", BLOCKER % (names, names)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"imported {len(names)}" in out.stdout


ROOT = Path(__file__).resolve().parent.parent
EXPORT_PACKAGE = "d2r_edge_export"      # the repository's export/ folder, as installed


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, at the top or inside a function: d2r_edge and the
    export tooling (export/, installed as d2r_edge_export)."""
    import ast

    mods = {}
    for folder, name in ((ROOT / "d2r_edge", "d2r_edge"), (ROOT / "export", EXPORT_PACKAGE)):
        for path in folder.rglob("*.py"):
            parts = (name, *path.relative_to(folder).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                deps |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_the_runtime_import_graph_has_no_cycle():
    """Lazy imports count too: an import running back up is a circle waiting to bite."""
    graph = _import_graph()
    assert "d2r_edge.eval.answers" in graph and "d2r_edge.engine.ray_eval" in graph
    assert f"{EXPORT_PACKAGE}.fever_train" in graph and "d2r_edge.serve.app" in graph
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(w):] + [w]))
            if w not in state:
                visit(w)
        path.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            visit(v)
    assert not any(m.startswith("d2r_edge.engine") for m in graph["d2r_edge.eval.answers"])


def _layers() -> dict[str, int]:
    """docs/design.md's layer table: a module or package name (without `d2r_edge.`) -> its layer."""
    import re

    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rows = text[text.index("| layer |"):].splitlines()[2:]
    out = {}
    for row in rows:
        if not row.startswith("|"):
            break
        cells = row.split("|")
        layer = int(cells[1].split()[0])
        for name in re.findall(r"`([^`]+)`", cells[2]):
            out[name] = layer
    return out


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    name = module if module == "d2r_edge" else module.removeprefix("d2r_edge.")
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in layers:
            return layers[".".join(parts[:i])]
    return None


def test_no_import_runs_back_up_the_layers_of_the_design_doc():
    """docs/design.md names each module's layer; a module imports only its own layer and those below
    (lazy imports too). The table is read from the doc, so the doc and the code cannot drift apart."""
    layers, graph = _layers(), _import_graph()
    assert len(set(layers.values())) >= 6
    unplaced = sorted(m for m in graph if _layer_of(m, layers) is None)
    assert not unplaced, f"modules missing from docs/design.md's layer table: {unplaced}"
    up = sorted(f"{m} (layer {_layer_of(m, layers)}) -> {d} (layer {_layer_of(d, layers)})"
                for m, deps in graph.items() for d in deps if _layer_of(d, layers) > _layer_of(m, layers))
    assert not up, "imports running back up:\n" + "\n".join(up)


def test_the_wheel_lists_every_package_and_installs_export_under_our_name():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {"d2r_edge"} | {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "d2r_edge").rglob("*")
                              if p.is_dir() and "__pycache__" not in p.parts}
    assert set(cfg["packages"]) == folders | {EXPORT_PACKAGE}
    assert cfg["package-dir"] == {EXPORT_PACKAGE: "export"} and "export" not in cfg["packages"]
