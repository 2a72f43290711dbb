"""Input checks and `.npz` persistence shared by the policies (no pickle, atomic writes)."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from d2r_edge.errors import PolicyError, PolicyFileError

POLICY_FORMAT_VERSION = 1


def check_x(x, dim: int) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] != dim:
        raise PolicyError(f"context x must be a 1-d vector of length {dim}, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise PolicyError(f"context x has a NaN/inf at index {bad}; check the features that fill it")
    return np.ascontiguousarray(arr)


def check_allowed(allowed, n_arms: int) -> np.ndarray:
    """A boolean mask from None (all), a boolean mask, or a list of arm indices."""
    if allowed is None:
        return np.ones(n_arms, dtype=np.bool_)
    arr = np.asarray(allowed)
    if arr.dtype == np.bool_:
        if arr.shape != (n_arms,):
            raise PolicyError(f"allowed mask must have {n_arms} entries, got shape {arr.shape}")
        mask = arr.copy()
    else:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise PolicyError(f"allowed must be a boolean mask or arm indices, got dtype {arr.dtype}")
        idx = arr.astype(np.int64).ravel()
        if idx.size and (idx.min() < 0 or idx.max() >= n_arms):
            raise PolicyError(f"allowed arm indices must be in [0, {n_arms}), got {idx.tolist()}")
        mask = np.zeros(n_arms, dtype=np.bool_)
        mask[idx] = True
    if not mask.any():
        raise PolicyError("no arm is allowed; pass None to allow all arms")
    return mask


def check_arm(arm, n_arms: int) -> int:
    if isinstance(arm, bool) or not isinstance(arm, (int, np.integer)) or not 0 <= arm < n_arms:
        raise PolicyError(f"unknown arm {arm!r}; arms are 0..{n_arms - 1}")
    return int(arm)


def check_reward(reward) -> float:
    try:
        r = float(reward)
    except (TypeError, ValueError):
        raise PolicyError(f"reward must be a number in [0, 1], got {reward!r}") from None
    if not (0.0 <= r <= 1.0):
        raise PolicyError(f"reward must be in [0, 1] (Eq. 2), got {r!r}")
    return r


def save_npz(path: Path | str, kind: str, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically: a temp file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, format_version=np.int64(POLICY_FORMAT_VERSION),
                     kind=np.array(kind), **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stored_kind(path: Path | str) -> str | None:
    """The kind a policy file says it holds (linucb, thompson, fixed); None when unreadable (loading it
    then says why)."""
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            return str(z["kind"]) if "kind" in z.files else None
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError):
        return None


def load_npz(path: Path | str, kind: str, *, expect_dim: int | None = None,
             expect_arms: list[str] | None = None) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.is_file():
        raise PolicyFileError(f"no policy file at {path}; train one with d2r-edge train")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as exc:
        raise PolicyFileError(
            f"{path} is not a readable policy file ({type(exc).__name__}: {exc}); it may be "
            f"truncated: restore it or train again"
        ) from None
    try:
        version = int(data.get("format_version", -1))
    except (TypeError, ValueError, OverflowError):
        version = -1
    if version != POLICY_FORMAT_VERSION:
        raise PolicyFileError(
            f"{path}: policy format {version}, this d2r-edge reads {POLICY_FORMAT_VERSION}; retrain"
        )
    if str(data.get("kind")) != kind:
        raise PolicyFileError(f"{path} holds a {data.get('kind')!s} policy, not {kind}")
    if expect_dim is not None and "dim" in data and stored_scalar(data, path, "dim") != expect_dim:
        raise PolicyFileError(
            f"{path}: policy context dim {int(data['dim'])} differs from the configured {expect_dim}; "
            f"use the context settings it was trained with or retrain"
        )
    if expect_arms is not None and "arm_names" not in data:
        raise _damaged(path, "no 'arm_names' entry")
    if expect_arms is not None and [str(a) for a in np.atleast_1d(data["arm_names"])] != list(expect_arms):
        have, want = [str(a) for a in np.atleast_1d(data["arm_names"])], list(expect_arms)
        if len(have) != len(want):
            added = [a for a in want if a not in have]
            raise PolicyFileError(
                f"{path} was trained for {len(have)} arms, this d2r-edge has {len(want)}"
                + (f" (new: {', '.join(added)})" if added else "")
                + "; its rows cannot be matched to arms: retrain it with `d2r-edge train`"
            )
        raise PolicyFileError(f"{path}: policy arms {have} differ from {want}; retrain it with `d2r-edge train`")
    return data


def _damaged(path, what: str) -> PolicyFileError:
    return PolicyFileError(f"{path}: {what}; the file is damaged or was not written by d2r-edge: restore it or retrain")


def stored_scalar(data: dict[str, np.ndarray], path, key: str, kind: type = int, low: float | None = None,
                  high: float | None = None):
    """A 0-d entry of a policy file as `kind`, finite and within [low, high], or PolicyFileError."""
    if key not in data:
        raise _damaged(path, f"no {key!r} entry")
    a = data[key]
    try:
        if a.ndim != 0 or a.dtype.kind not in "iuf":
            raise ValueError
        value = kind(a)
        if not np.isfinite(float(value)):
            raise ValueError
    except (ValueError, TypeError, OverflowError):
        raise _damaged(path, f"{key!r} is not a finite number ({a.dtype}, shape {a.shape})") from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise _damaged(path, f"{key!r} = {value!r} is outside [{low}, {high}]")
    return value


def stored_array(data: dict[str, np.ndarray], path, key: str, shape: tuple, finite: bool = True,
                 positive: bool = False, counts: bool = False) -> np.ndarray:
    """A numeric entry of a policy file with exactly `shape` (finite, > 0 when asked; `counts`: integers
    >= 0), or PolicyFileError."""
    if key not in data:
        raise _damaged(path, f"no {key!r} entry")
    a = data[key]
    if a.dtype.kind not in ("iu" if counts else "iuf") or a.shape != tuple(shape):
        raise _damaged(path, f"{key!r} has shape {a.shape} ({a.dtype}), expected {tuple(shape)} "
                             f"{'counts' if counts else 'numbers'}")
    if counts and (a < 0).any():
        raise _damaged(path, f"{key!r} holds negative counts")
    if finite and not np.isfinite(a).all():
        raise _damaged(path, f"{key!r} holds NaN/inf")
    if positive and not (a > 0).all():
        raise _damaged(path, f"{key!r} holds values <= 0")
    return a


def stored_names(data: dict[str, np.ndarray], path, n: int) -> list[str]:
    if "arm_names" not in data or data["arm_names"].dtype.kind != "U" or data["arm_names"].shape != (n,):
        raise _damaged(path, f"'arm_names' is not a list of {n} names")
    return [str(a) for a in data["arm_names"]]


def context_arrays(context: dict | None) -> dict[str, np.ndarray]:
    """A policy's context spec as an npz entry (JSON text; nothing pickled)."""
    return {} if context is None else {"context_json": np.array(json.dumps(context, sort_keys=True))}


def context_from(data: dict[str, np.ndarray]) -> dict | None:
    """The context spec saved with a policy; None for a file written before specs were saved."""
    if "context_json" not in data:
        return None
    try:
        spec = json.loads(str(data["context_json"]))
    except (json.JSONDecodeError, RecursionError):
        raise PolicyFileError("the policy file's context spec is not valid JSON; retrain it") from None
    if not isinstance(spec, dict):
        raise PolicyFileError("the policy file's context spec is not an object; retrain it")
    return spec
