"""Reader of `models/<profile>/manifest.json`, the contract between export and runtime.

The export step writes one manifest per profile; the runtime trusts nothing
that it does not list: every file it opens is checked against the recorded
sha256, label order comes from `id2label`, and roles exported with random
weights are refused unless the caller opts in (tests, benchmarks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

from d2r_edge.errors import IntegrityError, ManifestError, RandomWeightsError
from d2r_edge.jsonl import loads as json_loads

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT_VERSION = 1
_HASH_CHUNK_BYTES = 1 << 20


class Role(str, Enum):
    """What a model does in the pipeline."""

    NLI = "nli"
    TRIPLES = "triples"
    RERANKER = "reranker"
    EMBEDDER = "embedder"
    READER = "reader"            # extractive QA: the answer span of a question in a passage (issue 53)


class Variant(str, Enum):
    """Precision variants of one exported role."""

    FP32 = "fp32"
    INT8 = "int8"
    FP16 = "fp16"


class Weights(str, Enum):
    TRAINED = "trained"
    RANDOM = "random"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


VERIFIED_CACHE = ".verified-sha256.json"
_verified: dict[tuple[str, int, int], str] = {}
_verified_lock = threading.Lock()


def verified_sha256(path: Path, cache_dir: Path) -> str:
    """sha256 of a model file, hashed once per (path, size, mtime): in this process, and across
    processes through `cache_dir/.verified-sha256.json` (the profile's directory; best effort:
    a read-only models directory just hashes again). A file rewritten in place gets a new mtime and is hashed
    again; this guards against corrupted or swapped files, not against someone forging mtimes."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _verified_lock:
        if key in _verified:
            return _verified[key]
    cache_path = Path(cache_dir) / VERIFIED_CACHE
    name = os.path.relpath(path, Path(cache_dir).resolve())
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    hit = cache.get(name)
    stale = not (isinstance(hit, dict) and isinstance(hit.get("sha256"), str)
                 and (hit.get("size_bytes"), hit.get("mtime_ns")) == (st.st_size, st.st_mtime_ns))
    digest = sha256_file(path) if stale else hit["sha256"]
    with _verified_lock:
        _verified[key] = digest
    if not stale:
        return digest
    cache[name] = {"sha256": digest, "size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        tmp = cache_path.with_name(f"{VERIFIED_CACHE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, cache_path)
    except OSError:
        pass
    return digest


@dataclass(frozen=True)
class FileEntry:
    name: str
    sha256: str
    size_bytes: int


def _files(raw: Mapping[str, Any], where: str) -> dict[str, FileEntry]:
    try:
        for name in raw:
            if not name or Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"file name {name!r} is not a path inside the role's directory")
        return {
            name: FileEntry(name, str(meta["sha256"]), int(meta["size_bytes"]))
            for name, meta in raw.items()
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(
            f"{where}: file entries need sha256 and size_bytes ({exc}); re-run d2r-edge export"
        ) from None


@dataclass(frozen=True)
class RoleEntry:
    """One role of a manifest, bound to the directory that holds its files."""

    role: Role
    directory: Path
    architecture: str
    task: str
    weights: Weights
    max_length_tokens: int
    id2label: dict[int, str]
    files: dict[str, FileEntry]
    variants: dict[Variant, dict[str, FileEntry]]
    generation: dict[str, Any]
    raw: dict[str, Any]
    rescore_margin: float = 0.0     # int8 near-tie margin under which the fp32 graph rescores (0: never)

    def label_index(self, label: str) -> int:
        """Index of a label name (case-insensitive) in the model's output."""
        for idx, name in self.id2label.items():
            if name.lower() == label.lower():
                return idx
        raise ManifestError(
            f"role {self.role.value}: label {label!r} not in id2label {self.id2label}; "
            f"export a checkpoint whose config names its labels"
        )

    def check_weights(self, allow_random_weights: bool) -> None:
        if self.weights is Weights.RANDOM and not allow_random_weights:
            raise RandomWeightsError(
                f"role {self.role.value} in {self.directory} has random weights "
                f"(a test/benchmark export); its outputs mean nothing. Export trained "
                f"checkpoints, or pass allow_random_weights=True if that is intended"
            )

    def verified_path(self, name: str, variant: Variant | None = None) -> Path:
        """Path of one listed file after checking its size and sha256."""
        table = self.files if variant is None else self.variants.get(variant, {})
        if name not in table:
            raise ManifestError(
                f"role {self.role.value}: {name!r} is not listed for variant "
                f"{variant.value if variant else 'shared'}; re-run d2r-edge export"
            )
        entry = table[name]
        path = self.directory / name
        if not path.is_file():
            raise IntegrityError(f"{path} is missing; re-run d2r-edge export for this profile")
        if path.stat().st_size != entry.size_bytes or verified_sha256(path, self.directory.parent) != entry.sha256:
            raise IntegrityError(
                f"{path} does not match the sha256 recorded in the manifest (changed or "
                f"corrupted); re-run d2r-edge export for this profile"
            )
        return path

    def variant_paths(self, variant: Variant) -> dict[str, Path]:
        """Verified paths of every file of one precision variant, keyed by base name."""
        if variant not in self.variants:
            have = ", ".join(v.value for v in self.variants)
            raise ManifestError(
                f"role {self.role.value} has no {variant.value} variant (has: {have}); "
                f"pick one of those or re-export"
            )
        return {Path(name).name: self.verified_path(name, variant)
                for name in self.variants[variant]}

    def tokenizer_path(self) -> Path:
        return self.verified_path("tokenizer.json")

    @property
    def where(self) -> str:
        """This role in its manifest, for error messages."""
        return f"{self.directory.parent / MANIFEST_NAME} role {self.role.value}"

    @property
    def source(self) -> dict[str, str]:
        """Where the weights came from (`spec`, `weights_sha256`, ...), as export recorded it."""
        return {str(k): str(v) for k, v in (self.raw.get("source") or {}).items() if v is not None}



@dataclass(frozen=True)
class Manifest:
    path: Path
    profile: str
    roles: dict[Role, RoleEntry]
    absent: dict[Role, str]
    tools: dict[str, str]

    def role(self, role: Role | str, *, allow_random_weights: bool = False) -> RoleEntry:
        """The entry of a role, refusing random weights unless allowed."""
        role = _role(role, self.path)
        if role in self.absent:
            raise ManifestError(
                f"profile {self.profile!r} has no {role.value} model ({self.absent[role]})"
            )
        if role not in self.roles:
            raise ManifestError(
                f"{self.path} has no role {role.value!r}; export it with "
                f"d2r-edge export --profile {self.profile}"
            )
        entry = self.roles[role]
        entry.check_weights(allow_random_weights)
        return entry

    def has(self, role: Role | str) -> bool:
        return _role(role, self.path) in self.roles


def _role(value: Role | str, where: Path) -> Role:
    try:
        return Role(value)
    except ValueError:
        names = ", ".join(r.value for r in Role)
        raise ManifestError(f"{where}: unknown role {value!r}; known roles: {names}") from None


def _mapping(value: Any, where: str, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ManifestError(f"{where}: {what} must be a JSON object, got {type(value).__name__}; "
                            f"re-run d2r-edge export")
    return value


_GENERATION_TYPES = (int, float, bool, str, type(None))


def _role_entry(role: Role, raw: Any, path: Path) -> RoleEntry:
    where = f"{path} role {role.value}"
    raw = _mapping(raw, where, "the entry")
    try:
        directory = raw["directory"]
        if not isinstance(directory, str) or not directory or Path(directory).is_absolute() \
                or ".." in Path(directory).parts:
            raise ValueError(f"directory {directory!r} is not a folder name inside {path.parent}")
        max_len = int(raw["max_length_tokens"])
        if not 0 < max_len <= 1 << 20:
            raise ValueError(f"max_length_tokens {max_len} is out of range")
        generation = dict(_mapping(raw.get("generation"), where, "generation"))
        bad = sorted(str(k) for k, v in generation.items() if not isinstance(v, _GENERATION_TYPES))
        if bad:
            raise ValueError(f"generation values {bad} are not scalars")
        for block in ("source", "validation", "parity", "training"):
            _mapping(raw.get(block), where, block)
        variants_raw = _mapping(raw["variants"], where, "variants")
        margins = {v: float(_mapping(_mapping(meta, f"{where} variant {v}", "the variant").get("quantization"),
                                     f"{where} variant {v}", "quantization").get("fp32_rescore_margin") or 0.0)
                   for v, meta in variants_raw.items()}
        return RoleEntry(
            role=role,
            directory=path.parent / directory,
            architecture=str(raw["architecture"]),
            task=str(raw["task"]),
            weights=Weights(raw["weights"]),
            max_length_tokens=max_len,
            id2label={int(k): str(v) for k, v in _mapping(raw.get("id2label"), where, "id2label").items()},
            files=_files(_mapping(raw["files"], where, "files"), where),
            variants={Variant(v): _files(_mapping(meta["files"], f"{where} variant {v}", "files"),
                                         f"{where} variant {v}")
                      for v, meta in variants_raw.items()},
            generation=generation,
            raw=dict(raw),
            rescore_margin=margins.get(Variant.INT8.value, 0.0),
        )
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        raise ManifestError(f"{where}: malformed entry ({exc!r}); re-run d2r-edge export") from None


def load_manifest(models_dir: Path | str) -> Manifest:
    """Read `manifest.json` from a profile directory (or the file itself).

    Every field the runtime reads later is checked here, so a damaged manifest is one
    ManifestError naming the file, not a TypeError deep inside a model's constructor."""
    path = Path(models_dir)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"no manifest at {path}; run d2r-edge export --profile NAME first "
            f"(it writes models/NAME/{MANIFEST_NAME})"
        )
    try:
        data = json_loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc}); re-run d2r-edge export") from None
    except OSError as exc:
        raise ManifestError(f"cannot read {path} ({exc})") from None
    if not isinstance(data, dict) or data.get("format_version") != MANIFEST_FORMAT_VERSION:
        raise ManifestError(
            f"{path}: manifest format {data.get('format_version') if isinstance(data, dict) else '?'} "
            f"is not {MANIFEST_FORMAT_VERSION}; re-export with this version of d2r-edge"
        )
    roles = {(role := _role(name, path)): _role_entry(role, raw, path)
             for name, raw in _mapping(data.get("roles"), str(path), "roles").items()}
    absent = {_role(k, path): str(v) for k, v in _mapping(data.get("absent"), str(path), "absent").items()}
    return Manifest(
        path=path,
        profile=str(data.get("profile", path.parent.name)),
        roles=roles,
        absent=absent,
        tools={str(k): str(v) for k, v in _mapping(data.get("tools"), str(path), "tools").items()},
    )
