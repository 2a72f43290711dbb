"""The runtime must import with torch, transformers and optimum unavailable."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

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
