"""The one place that opens ONNX Runtime sessions.

Provider choice: CUDA when a GPU is visible *and* the CUDA provider really
loads, else CPU, with one log line saying which and why. On CUDA the arena
grows by what is requested (the default power-of-two growth would swamp a
6 MB per-action budget).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from pathlib import Path

from d2r_edge.config import coerce_enum
from d2r_edge.errors import ConfigError, InferenceError, ModelLoadError

log = logging.getLogger(__name__)


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class SessionConfig:
    """How sessions are opened. `intra_op_threads=0` means one per usable core (`usable_cores`)."""

    device: Device = Device.AUTO
    intra_op_threads: int = 0
    cuda_device_id: int = 0

    def __post_init__(self) -> None:
        coerce_enum(self, "device", Device)
        if not isinstance(self.intra_op_threads, int) or self.intra_op_threads < 0:
            raise ConfigError(f"intra_op_threads must be an int >= 0, got {self.intra_op_threads!r}")


def usable_cores() -> int:
    """CPUs this process may really use: its affinity mask, capped by a cgroup CPU quota.

    `os.cpu_count()` is the host's count; in a container limited by quota
    (docker --cpus, Kubernetes limits) it can be 64 where 2 are paid for, and
    one ORT thread per host core then oversubscribes the quota.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota else max(1, cores)


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """ceil(quota / period) from cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`; None if unlimited."""
    try:
        if (root / "cpu.max").is_file():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else -(-int(quota) // int(period))
        v1 = root / "cpu" / "cpu.cfs_quota_us"
        if v1.is_file():
            quota = int(v1.read_text())
            period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else -(-quota // period)
    except (OSError, ValueError):
        return None
    return None


def _ort():
    import onnxruntime

    return onnxruntime


@lru_cache(maxsize=None)
def _cuda_usable() -> tuple[bool, str]:
    """Whether CUDA is really usable, and why (cached: probing is not free)."""
    ort = _ort()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, "this onnxruntime build has no CUDA provider"
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:  # pynvml raises its own NVMLError family, or ImportError
        return False, f"no NVIDIA driver/GPU visible ({type(exc).__name__})"
    if count == 0:
        return False, "NVML sees no GPU"
    _preload_cuda_libraries(ort)
    return True, f"{count} GPU(s) visible"


def _preload_cuda_libraries(ort) -> None:
    """Load CUDA/cuDNN from the nvidia-* wheels (`pip install onnxruntime-gpu[cuda,cudnn]`) before any session.

    The CUDA provider's library searches only its own folder (RUNPATH $ORIGIN) and the loader path: CUDA
    libraries that came as wheels are found only through `onnxruntime.preload_dlls`, else the provider
    fails to load and sessions run on the CPU. Best effort (system CUDA on the loader path needs none of
    it); ORT prints what it could not load, which goes to the debug log instead of stdout.
    """
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:         # ORT < 1.21
        return
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            preload()
    except Exception as exc:    # RuntimeError for a missing folder, OSError from ctypes
        log.debug("onnxruntime.preload_dlls: %s: %s", type(exc).__name__, exc)
    if said.getvalue().strip():
        log.debug("onnxruntime.preload_dlls: %s", " ".join(said.getvalue().split())[:500])


def resolve_device(requested: Device) -> tuple[Device, str]:
    if requested is Device.CPU:
        return Device.CPU, "CPU requested"
    ok, why = _cuda_usable()
    if ok:
        return Device.CUDA, why
    if requested is Device.CUDA:
        raise ConfigError(f"device=cuda requested but {why}; use device=auto or cpu")
    return Device.CPU, why


def _providers(device: Device, cfg: SessionConfig) -> list:
    if device is Device.CUDA:
        return [
            ("CUDAExecutionProvider", {
                "device_id": cfg.cuda_device_id,
                "arena_extend_strategy": "kSameAsRequested",
            }),
            "CPUExecutionProvider",
        ]
    return ["CPUExecutionProvider"]


_logged_choice: set[tuple[str, int]] = set()


def on_cuda(session) -> bool:
    return session.get_providers()[0] == "CUDAExecutionProvider"


def run(session, output_names: list[str], feeds: dict) -> list:
    """session.run, through IO binding when the session runs on CUDA.

    With binding, inputs are copied to the device once per run and outputs
    land in host memory ORT allocates for them, instead of ORT's per-run
    staging copies.
    """
    try:
        if not on_cuda(session):
            return session.run(output_names, feeds)
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in output_names:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()
    except Exception as exc:  # ORT's Fail/InvalidArgument/RuntimeException are plain Exceptions
        shapes = ", ".join(f"{k}{tuple(getattr(v, 'shape', ()))}" for k, v in feeds.items())
        raise InferenceError(
            f"ONNX Runtime failed running {_model_name(session)} on inputs {shapes}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}; if this repeats, "
            f"check free memory and that the model files match their manifest (d2r-edge export)"
        ) from exc


def _model_name(session) -> str:
    try:
        return Path(session._model_path).name
    except (AttributeError, TypeError):
        return "a model"


def open_session(path: Path | str, cfg: SessionConfig = SessionConfig()):
    """An `onnxruntime.InferenceSession` for a verified model file."""
    ort = _ort()
    device, why = resolve_device(cfg.device)
    threads = cfg.intra_op_threads or usable_cores()
    if (why, threads) not in _logged_choice:
        _logged_choice.add((why, threads))
        log.info("ONNX Runtime on %s: %s; %d intra-op threads", device.value.upper(), why, threads)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3  # errors only: no provider warnings spam on CPU machines
    try:
        sess = ort.InferenceSession(str(path), sess_options=opts,
                                    providers=_providers(device, cfg))
    except Exception as exc:  # ORT raises its own Fail/InvalidProtobuf/... types
        raise ModelLoadError(
            f"ONNX Runtime cannot open {path}: {str(exc).splitlines()[0][:200]}; "
            f"re-run d2r-edge export for this profile"
        ) from None
    if device is Device.CUDA and "CUDAExecutionProvider" not in sess.get_providers():
        log.info("CUDA provider did not load for %s; running on CPU", Path(path).name)
    return sess
