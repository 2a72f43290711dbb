"""Budget meters and the per-arm cost model that masks arms before selection.

A `Meter` measures one repair action: wall latency (perf_counter_ns) and the
growth of memory during it, sampled by a background thread at 500 Hz so the
peak is caught. On CUDA it reads this process's GPU memory from NVML (or the
device-wide figure where containers hide pids); without a GPU it reads the
resident set and says so (`memory_kind="host"`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from d2r_edge.config import Budget
from d2r_edge.errors import PolicyError
from d2r_edge.policy.state import (
    check_arm,
    load_npz,
    save_npz,
    stored_array,
    stored_scalar,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryKind(str, Enum):
    DEVICE = "device"
    HOST = "host"


class MemorySource(str, Enum):
    NVML_PROCESS = "nvml-process"
    NVML_DEVICE = "nvml-device"
    HOST_RSS = "host-rss"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):  # not Linux: peak RSS as a fallback
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryProbe:
    """Reads one memory figure in bytes; chosen once (NVML if usable, else host RSS)."""

    def __init__(self, prefer_device: bool = True, device_index: int = 0, nvml_module=None) -> None:
        self.kind, self.source = MemoryKind.HOST, MemorySource.HOST_RSS
        self._nvml = None
        self._handle = None
        self._pid = os.getpid()
        if prefer_device:
            self._try_nvml(device_index, nvml_module)

    def _try_nvml(self, device_index: int, nvml_module) -> None:
        try:
            nvml = nvml_module
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self._handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as exc:  # ImportError, NVMLError_* (no driver, no GPU)
            log.info("device memory: no usable NVML (%s); metering host RSS instead",
                     type(exc).__name__)
            return
        self._nvml = nvml
        self.kind = MemoryKind.DEVICE
        self.source = (MemorySource.NVML_PROCESS if self._process_bytes() is not None
                       else MemorySource.NVML_DEVICE)
        log.info("device memory: NVML, %s", self.source.value)

    def _process_bytes(self) -> int | None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            return None
        for p in procs:
            if p.pid == self._pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
        return None

    def read(self) -> int:
        if self._nvml is None:
            return _rss_bytes()
        if self.source is MemorySource.NVML_PROCESS:
            value = self._process_bytes()
            if value is not None:
                return value
            # our entry vanished (process freed every CUDA allocation): it uses nothing
            return 0
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)


@dataclass(frozen=True)
class Measurement:
    latency_s: float
    mem_growth_mib: float
    memory_kind: MemoryKind
    memory_source: MemorySource
    samples: int


class _Window:
    """One measurement's memory figures, updated by the meter's sampler while it is open."""

    def __init__(self, start_value: int) -> None:
        self.start_value = self.peak = start_value
        self.samples = 1

    def see(self, value: int) -> None:
        self.samples += 1
        if value > self.peak:
            self.peak = value


class Meter:
    """`with meter.measure() as m: ...` then `m.result` (latency and memory growth).

    One sampler thread per meter (per process), started on first use and idle while no
    measurement is open; measurements may overlap (parallel requests), each keeps its own
    start and peak. Starting a thread per measurement cost 2-3 ms on a 2-core machine
    whose ONNX Runtime threads were spinning: more than the rest of the loop together.
    With nothing to measure the thread polls for `linger_s`, then parks; parked for
    `idle_exit_s` it ends, and starts again on use.
    """

    linger_s = 0.05
    idle_exit_s = 2.0

    def __init__(self, probe: MemoryProbe | None = None, sample_hz: float = 500.0) -> None:
        if sample_hz < 200:
            raise PolicyError(f"sample_hz must be >= 200 to catch peaks, got {sample_hz}")
        self.probe = probe or MemoryProbe()
        self.interval_s = 1.0 / sample_hz
        self._cond = threading.Condition()
        self._open: set[_Window] = set()
        self._thread: threading.Thread | None = None
        self._thread_pid = 0
        self._parked = False

    def measure(self) -> "_Measuring":
        return _Measuring(self)

    def _open_window(self) -> _Window:
        w = _Window(self.probe.read())
        with self._cond:
            if self._thread is None or self._thread_pid != os.getpid() or not self._thread.is_alive():
                # first use, or a forked child (threads do not survive fork)
                self._thread = threading.Thread(target=self._sample, name="d2r-meter", daemon=True)
                self._thread_pid = os.getpid()
                self._thread.start()
            self._open.add(w)
            if self._parked:   # waking a parked thread costs a GIL hand-over (~0.5 ms when busy)
                self._cond.notify()
        return w

    def _close_window(self, w: _Window) -> None:
        with self._cond:
            self._open.discard(w)
        w.see(self.probe.read())

    def _sample(self) -> None:
        idle_since = None
        while True:
            with self._cond:
                if self._open:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.linger_s:
                    # back-to-back measurements (a loop's attempts) find the thread still
                    # awake; only a pause longer than linger_s parks it
                    self._parked = True
                    self._cond.wait(self.idle_exit_s)
                    self._parked = False
                    if not self._open:   # idle: end, so an unused meter holds no thread
                        self._thread = None
                        return
                    idle_since = None
            time.sleep(self.interval_s)
            if self._open:
                value = self.probe.read()
                with self._cond:
                    for w in self._open:
                        w.see(value)


class _Measuring:
    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.result: Measurement | None = None

    def __enter__(self) -> "_Measuring":
        self._window = self.meter._open_window()
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        elapsed_ns = time.perf_counter_ns() - self._t0
        w = self._window
        self.meter._close_window(w)
        self.result = Measurement(
            latency_s=elapsed_ns / 1e9,
            mem_growth_mib=max(0, w.peak - w.start_value) / MIB,
            memory_kind=self.meter.probe.kind,
            memory_source=self.meter.probe.source,
            samples=w.samples,
        )


# --- per-arm cost model -------------------------------------------------------

@dataclass(frozen=True)
class MaskResult:
    allowed: np.ndarray               # boolean mask over arms
    fallback: bool                    # no arm fit: the cheapest predicted arm was kept
    predicted_latency_s: np.ndarray   # nan where an arm has no observation yet
    predicted_mem_mib: np.ndarray


class CostModel:
    """Online mean/variance (Welford) and a high quantile over a window, per arm.

    The prediction used for masking is the `quantile` (0.9) of the last
    `window` observations once an arm has `min_observations`; arms never
    tried are predicted as fitting, so they can be learned.
    """

    def __init__(self, n_arms: int, *, window: int = 64, quantile: float = 0.9,
                 min_observations: int = 3) -> None:
        if n_arms < 1 or window < 1 or not 0 < quantile <= 1 or min_observations < 1:
            raise PolicyError("CostModel needs n_arms >= 1, window >= 1, 0 < quantile <= 1, "
                              "min_observations >= 1")
        self.n_arms, self.window, self.quantile = n_arms, window, quantile
        self.min_observations = min_observations
        self.count = np.zeros(n_arms, dtype=np.int64)
        self.mean = np.zeros((n_arms, 2))       # [:, 0] latency_s, [:, 1] mem_mib
        self.m2 = np.zeros((n_arms, 2))
        self.recent = np.full((n_arms, window, 2), np.nan)
        self._lock = threading.Lock()           # observations may come from concurrent requests

    def observe(self, arm: int, latency_s: float, mem_mib: float) -> None:
        arm = check_arm(arm, self.n_arms)
        obs = np.array([latency_s, mem_mib], dtype=np.float64)
        if not np.isfinite(obs).all() or (obs < 0).any():
            raise PolicyError(f"costs must be finite and >= 0, got {obs.tolist()}")
        with self._lock:
            self.count[arm] += 1
            delta = obs - self.mean[arm]
            self.mean[arm] += delta / self.count[arm]
            self.m2[arm] += delta * (obs - self.mean[arm])
            self.recent[arm, (self.count[arm] - 1) % self.window] = obs

    def std(self) -> np.ndarray:
        n = np.maximum(self.count - 1, 1)[:, None]
        return np.sqrt(self.m2 / n)

    def predict(self) -> np.ndarray:
        """(n_arms, 2) predicted [latency_s, mem_mib]; nan for arms not yet known."""
        out = np.full((self.n_arms, 2), np.nan)
        with self._lock:
            known = self.count >= self.min_observations
            if known.any():
                out[known] = np.nanquantile(self.recent[known], self.quantile, axis=1)
        return out

    def mask(self, remaining: Budget | tuple[float, float], allowed: np.ndarray | None = None) -> MaskResult:
        """Arms whose predicted cost fits the remaining budget (within `allowed`)."""
        if isinstance(remaining, Budget):
            remaining = remaining.absolute()
        lat, mem = ((remaining.latency_s, remaining.device_mem_mib) if isinstance(remaining, Budget)
                    else remaining)
        base = np.ones(self.n_arms, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool)
        pred = self.predict()
        unknown = np.isnan(pred).any(axis=1)
        fits = unknown | ((pred[:, 0] <= lat) & (pred[:, 1] <= mem))
        mask = base & fits
        fallback = False
        if not mask.any():
            # nothing fits: keep the cheapest predicted arm (relative to the remaining budget)
            rel = np.maximum(pred[:, 0] / max(lat, 1e-9), pred[:, 1] / max(mem, 1e-9))
            rel = np.where(base, rel, np.inf)
            mask = np.zeros(self.n_arms, dtype=bool)
            mask[int(np.argmin(rel))] = True
            fallback = True
        return MaskResult(mask, fallback, pred[:, 0], pred[:, 1])

    def save(self, path: Path | str) -> None:
        save_npz(path, "costs", {"n_arms": np.int64(self.n_arms), "window": np.int64(self.window),
                                 "quantile": np.float64(self.quantile),
                                 "min_observations": np.int64(self.min_observations),
                                 "count": self.count, "mean": self.mean, "m2": self.m2,
                                 "recent": self.recent})

    @classmethod
    def load(cls, path: Path | str) -> "CostModel":
        z = load_npz(path, "costs")
        n, window = stored_scalar(z, path, "n_arms", int, 1, 10_000), stored_scalar(z, path, "window", int, 1, 100_000)
        cm = cls(n, window=window, quantile=stored_scalar(z, path, "quantile", float, 1e-9, 1.0),
                 min_observations=stored_scalar(z, path, "min_observations", int, 1))
        cm.count[:] = stored_array(z, path, "count", (n,), counts=True)
        cm.mean[:] = stored_array(z, path, "mean", (n, 2))
        cm.m2[:] = stored_array(z, path, "m2", (n, 2))
        recent = stored_array(z, path, "recent", (n, window, 2), finite=False)   # NaN: an empty slot
        held = (~np.isnan(recent[:, :, 0])).sum(axis=1)
        if np.isinf(recent).any() or (recent < 0).any() or not np.array_equal(held, np.minimum(cm.count, window)):
            raise PolicyError(f"{path}: negative, infinite or missing costs stored (the window does not hold "
                              f"the observations the counts say); the file is damaged: restore it or delete it "
                              f"(costs are learned again)")
        cm.recent[:] = recent
        return cm
