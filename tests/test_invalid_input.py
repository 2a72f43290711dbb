"""Bad input to every public entry point: typed errors, one line at the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from d2r_edge.errors import (
    ConfigError,
    HubUnreachableError,
    InputError,
    IntegrityError,
    ManifestError,
    ModelLoadError,
    ModelSourceError,
    RandomWeightsError,
    UnknownRoleError,
)
from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder
from d2r_edge.onnx.manifest import Role, Variant, load_manifest

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "d2r_edge.cli"]


def _copy(tiny_models: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "profile"
    shutil.copytree(tiny_models, dst)
    return dst


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode not in (0, 1), out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("d2r-edge: error:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


# --- export sources ---------------------------------------------------------

def test_unknown_role_is_typed(tmp_path):
    pytest.importorskip("torch")
    from d2r_edge_export.build import parse_role_overrides

    with pytest.raises(UnknownRoleError, match="roles are"):
        parse_role_overrides(["summarizer=/x"])
    with pytest.raises(ConfigError, match="NAME=SOURCE"):
        parse_role_overrides(["nli"])


def test_unreachable_hub_id_fails_fast_naming_both_ways_out(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from d2r_edge_export.sources import resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(HubUnreachableError) as err:
        resolve("nli", "SomeOrg/not-a-real-model", tmp_path)
    assert time.perf_counter() - t0 < 30
    assert "network" in str(err.value) and "--role nli=" in str(err.value)


def test_directory_without_weights(tmp_path):
    pytest.importorskip("torch")
    from d2r_edge_export.sources import resolve

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="no weights"):
        resolve("nli", str(tmp_path / "ckpt"), tmp_path)


def test_cli_errors_are_one_line():
    for args, needle in [
        (("export", "--profile", "tiny", "--role", "summarizer=/x"), "unknown role"),
        (("export", "--profile", "no-such-profile"), "unknown profile"),
        (("export", "--profile", "tiny", "--role", "nli=/nonexistent/dir"), "not a directory"),
    ]:
        assert needle in _one_line_error(_cli(*args))


def test_cli_unreachable_hub_is_one_line():
    out = subprocess.run([*CLI, "export", "--profile", "paper", "--models-dir", "/tmp/d2r-none",
                          "--profiles", str(ROOT / "models" / "profiles.toml")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert "--role nli=" in _one_line_error(out)


def test_missing_export_extra_names_the_pip_command():
    code = ("import sys, importlib.abc\n"
            "class B(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, n, p=None, t=None):\n"
            "        if n.split('.')[0] == 'torch': raise ImportError('blocked', name='torch')\n"
            "sys.meta_path.insert(0, B())\n"
            "from d2r_edge.cli import main\n"
            "sys.exit(main(['export', '--profile', 'tiny']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    line = _one_line_error(out)
    assert "pip install torch==2.13.0" in line and "d2r-edge[export]" in line


# --- manifests and model files ---------------------------------------------

def test_wrong_sha256_is_refused(tiny_models, tmp_path):
    profile = _copy(tiny_models, tmp_path)
    raw = json.loads((profile / "manifest.json").read_text())
    files = raw["roles"]["embedder"]["variants"]["int8"]["files"]
    files["int8/model.onnx"]["sha256"] = "0" * 64
    (profile / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(IntegrityError, match="sha256"):
        Embedder(load_manifest(profile), variant=Variant.INT8)


def test_corrupted_onnx_is_refused(tiny_models, tmp_path):
    profile = _copy(tiny_models, tmp_path)
    path = profile / "embedder" / "fp32" / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        Embedder(load_manifest(profile), variant=Variant.FP32)


def test_corrupted_onnx_with_matching_manifest_is_a_load_error(tiny_models, tmp_path):
    from d2r_edge.onnx.session import open_session

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(ModelLoadError, match="re-run d2r-edge export"):
        open_session(bad)


def test_random_weights_refused_unless_allowed(tiny_models):
    manifest = load_manifest(tiny_models)
    with pytest.raises(RandomWeightsError, match="allow_random_weights"):
        NLI(manifest)
    NLI(manifest, allow_random_weights=True)  # explicit opt-in works
    Embedder(manifest)  # trained weights need no opt-in


def test_missing_or_malformed_manifest(tmp_path):
    with pytest.raises(ManifestError, match="d2r-edge export"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(ManifestError, match="format"):
        load_manifest(tmp_path)


def test_unknown_role_and_variant_in_runtime(tiny_models):
    manifest = load_manifest(tiny_models)
    with pytest.raises(ManifestError, match="unknown role"):
        manifest.role("summarizer")
    entry = manifest.role(Role.TRIPLES, allow_random_weights=True)
    with pytest.raises(ManifestError, match="no fp16 variant"):
        entry.variant_paths(Variant.FP16)


# --- encoder inputs ----------------------------------------------------------

def test_encoder_bad_and_edge_inputs(tiny_models):
    manifest = load_manifest(tiny_models)
    nli = NLI(manifest, allow_random_weights=True)
    emb = Embedder(manifest)
    ce = CrossEncoder(manifest, allow_random_weights=True)
    assert nli.score([]).shape == (0, 3)
    assert emb.encode([]).shape == (0, emb.dim)
    assert ce.score("q", []).shape == (0,)
    probs = nli.score([("", ""), ("a passage", "")])
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    huge = "word " * 20_000  # 100k characters: truncated, not an error
    assert emb.encode([huge]).shape == (1, emb.dim)
    assert nli.score([(huge, "short claim")]).shape == (1, 3)
    with pytest.raises(InputError, match="item 1"):
        emb.encode(["fine", "bad \ud800 surrogate"])
    with pytest.raises(InputError, match="item 0"):
        nli.score([("ok", "\udfff")])
    with pytest.raises(InputError, match="expected str"):
        emb.encode([b"bytes"])
