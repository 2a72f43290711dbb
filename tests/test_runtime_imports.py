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
        if name.split('.')[0] in {'torch', 'transformers', 'optimum', 'export'}:
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


def _import_graph() -> dict[str, set[str]]:
    """d2r_edge module -> the d2r_edge modules it imports, at the top or inside a function."""
    import ast

    pkg_root = Path(__file__).resolve().parent.parent / "d2r_edge"
    mods = {}
    for path in pkg_root.rglob("*.py"):
        parts = path.relative_to(pkg_root.parent).with_suffix("").parts
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
