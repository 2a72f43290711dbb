from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """The `tiny` profile exported once per session (needs the [export] extra)."""
    import os

    reuse = os.environ.get("D2R_TINY_MODELS")      # a slow-step subprocess reuses its parent's export
    if reuse and (Path(reuse) / "manifest.json").is_file():
        return Path(reuse)
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    from d2r_edge_export.build import ExportRequest, run_export

    warnings.filterwarnings("ignore")
    logging.getLogger("optimum").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("models")
    data = SHARED_DATA if SHARED_DATA.is_dir() else None
    path = run_export(ExportRequest("tiny", models_dir=out,
                                    profiles_file=ROOT / "models" / "profiles.toml",
                                    data_dir=data))
    return path.parent


@pytest.fixture(scope="session")
def demo_kb(tiny_models, tmp_path_factory) -> Path:
    """A KB of the bundled demo documents, embedded with the tiny profile."""
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase

    kb = tmp_path_factory.mktemp("demo") / "kb"
    KnowledgeBase.build(ROOT / "d2r_edge" / "data" / "demo" / "docs.jsonl", kb, Embedder(load_manifest(tiny_models)))
    return kb
