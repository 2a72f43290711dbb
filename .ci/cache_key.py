"""The content key of an exported profile: a hash of everything its export reads.

    .venv/bin/python .ci/cache_key.py          prints the key (20 hex digits)

Hashed: every file of export/ and every d2r_edge module the export imports (followed through
the import graph, lazy imports included, by the same AST walk as tests/test_runtime_imports.py;
a module it cannot place pulls in all of d2r_edge), models/profiles.toml, pyproject.toml, .ci/models
(the build requests), the installed packages and versions (`pip freeze`, d2r-edge's own line left
out: it names the commit), the Python build, and the shared data's files by name and sha256.
A change to any of them is another key: a cached build is never reused for a tree it was not
built from. A change elsewhere (the server, the pipeline, tests, docs) keeps the key.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


def _module_files() -> dict[str, Path]:
    out = {}
    for folder, name in ((ROOT / "d2r_edge", "d2r_edge"), (ROOT / "export", "d2r_edge_export")):
        for path in folder.rglob("*.py"):
            parts = (name, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            deps |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return deps


def export_closure() -> list[Path]:
    """export/'s files and the project modules they reach, with each module's parent packages."""
    files = _module_files()
    todo = [m for m in files if m.startswith("d2r_edge_export")]
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in files]
        for dep in _imports(m, files[m]):
            if dep in files:
                todo.append(dep)
            elif dep.startswith(("d2r_edge.", "d2r_edge_export.")) and dep.rsplit(".", 1)[0] not in files:
                return sorted(files.values())      # an import it cannot place: hash everything
    return sorted(files[m] for m in seen)


def key() -> str:
    h = hashlib.sha256()
    # .ci/models holds the build requests themselves (which profile, which arguments)
    for path in [*export_closure(), ROOT / "models" / "profiles.toml", ROOT / "pyproject.toml",
                 ROOT / ".ci" / "models"]:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                            check=True).stdout
    h.update("\n".join(x for x in freeze.splitlines() if "d2r" not in x.lower() and not x.startswith("-e ")).encode())
    h.update(sys.version.encode())
    if DATA.is_dir():       # by content (32 MB, ~0.1 s): CI's copy of shared/ need not keep modification times
        for path in sorted(p for p in DATA.rglob("*") if p.is_file()):
            h.update(f"{path.relative_to(DATA)} {hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()[:20]


if __name__ == "__main__":
    print(key())
