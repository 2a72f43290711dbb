"""Issue 38's device check, one process: what the GPU path does on a real GPU, written as JSON.

    python -m benchmarks.gpu.driver --out DIR [--models PROFILE_DIR] [--quick]

Sections (each says what it could not do and why, instead of failing the others):

- `env`: the machine (nvidia-smi, driver, CUDA, torch / CuPy / ONNX Runtime versions, providers, cores).
- `meter`: d2r_edge's MemoryProbe + Meter (what measures a repair arm's device memory) around known CUDA
  allocations made with PyTorch (sizes 1..256 MiB): NVML's per-process growth vs what PyTorch reserved,
  the resolution, and how long one NVML read takes.
- `masking`: a CostModel fed those measured growths as arms, masked at a few-MiB budget (paper: 6 MB):
  does the mask act on real NVML figures?
- `onnx`: with ONNX Runtime's CUDA provider, each role of --models in fp16 on CUDA against fp32 on the
  CPU (label agreement, max logit difference, latency per batch); without it, the providers there.
- `select`: LinUCB select p50 at d = 147 / 786, 11 arms, after 300 updates, on this machine's CPU.

Without a GPU (CI, this VM) every section still runs and reports the CPU fallback, which is what
tests/test_gpu_driver.py checks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("benchmarks.gpu")
MIB = 1024 * 1024


def _versions() -> dict:
    out = {}
    for name in ("torch", "cupy", "onnxruntime", "numba", "pynvml"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as exc:  # not installed there, or broken
            out[name] = f"unavailable ({type(exc).__name__})"
    return out


def env() -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "versions": _versions()}
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    try:
        import onnxruntime as ort

        info["ort_providers"] = ort.get_available_providers()
    except Exception as exc:
        info["ort_providers"] = f"unavailable ({type(exc).__name__})"
    try:
        import torch

        info["torch_cuda"] = {"available": torch.cuda.is_available(), "cuda": torch.version.cuda,
                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    except Exception as exc:
        info["torch_cuda"] = f"unavailable ({type(exc).__name__})"
    return info


def _torch_cuda():
    try:
        import torch
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


def meter(sizes_mib=(1, 2, 4, 16, 64, 256), reads: int = 1000) -> dict:
    """Known allocations measured the way a repair arm is (Meter.measure around the work)."""
    from d2r_edge.budget import MemoryProbe, Meter

    probe = MemoryProbe(prefer_device=True)
    out = {"memory_kind": probe.kind.value, "memory_source": probe.source.value}
    t0 = time.perf_counter()
    for _ in range(reads):
        probe.read()
    out["read_us"] = (time.perf_counter() - t0) / reads * 1e6
    torch = _torch_cuda()
    if torch is None:
        out["allocations"] = "no CUDA device from PyTorch: nothing to allocate on a GPU (host RSS metered)"
        return out
    torch.zeros(1, device="cuda")            # the CUDA context first: its own memory is not an arm's
    torch.cuda.synchronize()
    m = Meter(probe)
    rows = []
    for size in sizes_mib:
        before_reserved = torch.cuda.memory_reserved()
        with m.measure() as w:
            x = torch.empty(size * MIB, dtype=torch.uint8, device="cuda")
            x.fill_(1)
            torch.cuda.synchronize()
            time.sleep(0.02)                 # a few sampler ticks inside the window
        reserved = (torch.cuda.memory_reserved() - before_reserved) / MIB
        rows.append({"allocated_mib": size, "torch_reserved_growth_mib": reserved,
                     "meter_growth_mib": w.result.mem_growth_mib, "samples": w.result.samples,
                     "latency_s": w.result.latency_s})
        del x
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    out["allocations"] = rows
    return out


def masking(meter_section: dict, budget_mib: float = 6.0) -> dict:
    """A cost model that saw each allocation as one arm (3 observations each), masked at `budget_mib`."""
    from d2r_edge.budget import CostModel
    from d2r_edge.config import Budget

    rows = meter_section.get("allocations")
    if not isinstance(rows, list):
        return {"skipped": "no device allocations were measured"}
    costs = CostModel(len(rows))
    for arm, r in enumerate(rows):
        for _ in range(3):
            costs.observe(arm, 0.01, max(0.0, float(r["meter_growth_mib"])))
    res = costs.mask(Budget(latency_s=3.0, device_mem_mib=budget_mib))
    return {"budget_mib": budget_mib, "arms": [{"allocated_mib": r["allocated_mib"], "allowed": bool(a)}
                                                for r, a in zip(rows, res.allowed)], "fallback": res.fallback}


def onnx_parity(models: Path | None, batches: int = 20) -> dict:
    """fp16 on CUDA vs fp32 on the CPU for each role of a profile; or why it cannot run here."""
    try:
        import onnxruntime as ort
    except Exception as exc:
        return {"skipped": f"onnxruntime unavailable ({type(exc).__name__})"}
    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return {"skipped": f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers: "
                           f"{', '.join(providers)}): the CPU build, or a GPU build whose CUDA/cuDNN libraries "
                           f"are not found"}
    if models is None or not (models / "manifest.json").is_file():
        return {"skipped": f"no exported profile at {models}"}
    from d2r_edge.onnx.encoders import NLI, CrossEncoder
    from d2r_edge.onnx.manifest import Variant, load_manifest
    from d2r_edge.onnx.session import Device, SessionConfig, on_cuda

    manifest = load_manifest(models)
    rng = np.random.default_rng(0)
    words = "the a city river band film born year capital album was is in of by".split()
    pairs = [(" ".join(rng.choice(words, 40)), " ".join(rng.choice(words, 12))) for _ in range(32)]
    out = {}
    for role, cls, score in (("nli", NLI, "score"), ("reranker", CrossEncoder, "score_pairs")):
        try:
            cpu = cls(manifest, variant=Variant.FP32, allow_random_weights=True,
                      session=SessionConfig(device=Device.CPU))
            gpu = cls(manifest, variant=Variant.FP16, allow_random_weights=True,
                      session=SessionConfig(device=Device.CUDA))
        except Exception as exc:
            out[role] = {"skipped": f"{type(exc).__name__}: {exc}"}
            continue
        a, b = np.asarray(getattr(cpu, score)(pairs)), np.asarray(getattr(gpu, score)(pairs))
        row = {"cuda_provider_loaded": on_cuda(gpu.session), "max_abs_diff": float(np.max(np.abs(a - b)))}
        if a.ndim == 2:
            row["label_agreement"] = float(np.mean(a.argmax(1) == b.argmax(1)))
        for name, enc in (("cpu_fp32", cpu), ("cuda_fp16", gpu)):
            getattr(enc, score)(pairs)
            t0 = time.perf_counter()
            for _ in range(batches):
                getattr(enc, score)(pairs)
            row[f"{name}_ms_per_batch_of_32"] = (time.perf_counter() - t0) / batches * 1e3
        out[role] = row
    return out


def select_bench(dims=(147, 786), arms: int = 11, updates: int = 300, calls: int = 2000) -> dict:
    from d2r_edge.policy import LinUCB

    out = {}
    rng = np.random.default_rng(0)
    for d in dims:
        pol = LinUCB(arms, d, 2.0)
        for _ in range(updates):
            x = rng.normal(size=d)
            pol.update(int(rng.integers(arms)), x, float(rng.random()))
        xs = rng.normal(size=(calls, d))
        pol.select(xs[0])
        times = np.empty(calls)
        for i in range(calls):
            t0 = time.perf_counter()
            pol.select(xs[i])
            times[i] = time.perf_counter() - t0
        out[f"d{d}"] = {"select_p50_us": float(np.median(times) * 1e6), "select_p90_us":
                        float(np.percentile(times, 90) * 1e6), "arms": arms, "updates": updates}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--models", type=Path, default=None, help="an exported profile (fp16 and fp32 variants)")
    ap.add_argument("--quick", action="store_true", help="fewer reads / calls (the CPU-fallback test)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"env": env()}
    sections = {"meter": lambda: meter(reads=50 if args.quick else 1000),
                "onnx": lambda: onnx_parity(args.models, batches=2 if args.quick else 20),
                "select": lambda: select_bench(updates=30 if args.quick else 300, calls=50 if args.quick else 2000)}
    for name, run in sections.items():
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except Exception as exc:      # one section's failure is reported, the others still run
            log.exception("section %s failed", name)
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        log.info("%s: %.1f s", name, time.perf_counter() - t0)
        if name == "meter":
            result["masking"] = masking(result["meter"])
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    log.info("wrote %s", args.out / "gpu_check.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
