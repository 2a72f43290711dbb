"""Issue 38's device check, one process: what the GPU path does on a real GPU, written as JSON.

    python -m benchmarks.gpu.driver --out DIR [--models PROFILE_DIR]... [--reference REF] [--run-models DIR]
    python -m benchmarks.gpu.driver --write-reference REF --models PROFILE_DIR...   # on the build machine

Sections (each says what it could not do and why, instead of failing the others):

- `env`: the machine (nvidia-smi, driver, CUDA, torch / CuPy / ONNX Runtime versions, providers, cores).
- `meter`: d2r_edge's MemoryProbe + Meter (what measures a repair arm's device memory) around known CUDA
  allocations made with PyTorch (sizes 1..256 MiB): NVML's per-process growth vs what PyTorch reserved,
  the resolution, and how long one NVML read takes.
- `masking`: a CostModel fed those measured growths as arms, masked at a few-MiB budget (paper: 6 MB):
  does the mask act on real NVML figures?
- `onnx`: with ONNX Runtime's CUDA provider, each role (NLI, reranker, embedder) of each --models profile in
  fp16 on CUDA against fp32 on a CPU (label agreement / pair-order agreement / cosine, max difference,
  latency per batch of 32 demo pairs); fp32 runs there when its files were carried, else comes from
  --reference (`--write-reference` on the machine that built the profile); without CUDA, the providers there.
- `run`: a real `d2r-edge run` (demo KB, extractive generator, --run-models in fp16) in its own process, at a
  --budget-mib device-memory budget: per arm, what the meter recorded (kind, source, growth) and what the
  cost model masked.
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
import sys
import tempfile
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


ROLES = ("nli", "reranker", "embedder")


def _demo_dir() -> Path:
    """The demo documents and claims shipped inside the package."""
    import d2r_edge

    return Path(d2r_edge.__file__).parent / "data" / "demo"


def probe_inputs() -> tuple[list[tuple[str, str]], list[str]]:
    """32 (passage, claim) pairs and 32 texts from the bundled demo data: real sentences, same everywhere."""
    from d2r_edge.retrieval.docs import read_documents
    from d2r_edge.runner import load_queries

    demo = _demo_dir()
    passages = [d.indexed_text for d in read_documents(demo / "docs.jsonl").documents]     # as the KB indexes them
    claims = [q.text for q in load_queries(demo / "claims.jsonl")]
    pairs = [(passages[i % len(passages)], claims[(5 * i) % len(claims)]) for i in range(32)]
    texts = (passages + claims)[:32]
    return pairs, texts


def _encoder(role: str, manifest, variant, device, allow_random: bool = True):
    from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder
    from d2r_edge.onnx.session import SessionConfig

    cls = {"nli": NLI, "reranker": CrossEncoder, "embedder": Embedder}[role]
    return cls(manifest, variant=variant, allow_random_weights=allow_random, session=SessionConfig(device=device))


def _outputs(role: str, enc, pairs, texts) -> np.ndarray:
    if role == "nli":
        return enc.logits(pairs)
    if role == "reranker":
        return enc.score_pairs(pairs)
    return enc.encode(texts)


def _ms_per_batch(role: str, enc, pairs, texts, batches: int) -> float:
    _outputs(role, enc, pairs, texts)                       # warm-up (CUDA: kernels, arena)
    t0 = time.perf_counter()
    for _ in range(batches):
        _outputs(role, enc, pairs, texts)
    return (time.perf_counter() - t0) / batches * 1e3


def _profile_name(manifest, models: Path) -> str:
    return str(manifest.profile or models.name)


def compare(role: str, ref: np.ndarray, got: np.ndarray) -> dict:
    """How far `got` (fp16 on the device) is from `ref` (fp32 on a CPU), in the terms each role is used in."""
    ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    row = {"max_abs_diff": float(np.max(np.abs(ref - got)))}
    if role == "nli":
        row["label_agreement"] = float(np.mean(ref.argmax(1) == got.argmax(1)))
    elif role == "reranker":                   # order of every pair of passages, as reranking uses it
        i, j = np.triu_indices(len(ref), 1)
        row["pair_order_agreement"] = float(np.mean(np.sign(ref[i] - ref[j]) == np.sign(got[i] - got[j])))
    else:
        cos = np.sum(ref * got, axis=1) / np.maximum(np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1),
                                                     1e-12)
        row["min_cosine"], row["mean_cosine"] = float(cos.min()), float(cos.mean())
    return row


def write_reference(models: list[Path], out: Path, batches: int = 10) -> dict:
    """fp32 outputs on this machine's CPU for the probe inputs, with CPU latencies (fp32, int8) per role, and
    the demo run (`demo_run`, int8) of the first profile on this CPU.

    The device check carries only fp16 files of the big profiles (what one call may carry is small) and
    compares them with these outputs; `out`.npz holds arrays only (loaded without pickle)."""
    from d2r_edge.onnx.manifest import Variant, load_manifest
    from d2r_edge.onnx.session import Device

    pairs, texts = probe_inputs()
    arrays, meta = {}, {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                    "onnxruntime": _versions()["onnxruntime"]}, "roles": {}}
    for models_dir in models:
        manifest = load_manifest(models_dir)
        name = _profile_name(manifest, models_dir)
        for role in ROLES:
            row = {}
            for variant in (Variant.FP32, Variant.INT8):
                try:
                    enc = _encoder(role, manifest, variant, Device.CPU)
                except Exception as exc:
                    row[f"cpu_{variant.value}"] = f"unavailable ({type(exc).__name__})"
                    continue
                if variant is Variant.FP32:
                    arrays[f"{name}/{role}"] = _outputs(role, enc, pairs, texts)
                row[f"cpu_{variant.value}_ms_per_batch_of_32"] = _ms_per_batch(role, enc, pairs, texts, batches)
            meta["roles"][f"{name}/{role}"] = row
    if models:                # the loop on this CPU, int8 (what a CPU runs), beside the device's fp16 run
        with tempfile.TemporaryDirectory() as work:
            meta["run"] = demo_run(models[0], Path(work), variant="int8")
    np.savez(out.with_suffix(".npz"), **arrays)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return meta


def load_reference(path: Path | None) -> tuple[dict[str, np.ndarray], dict]:
    """write_reference's arrays (loaded without pickle) and metadata; empty when there is none."""
    if path is None or not path.with_suffix(".npz").is_file():
        return {}, {}
    with np.load(path.with_suffix(".npz"), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))


def onnx_parity(models: list[Path], reference: tuple[dict, dict] = ({}, {}), batches: int = 20,
                device=None) -> dict:
    """fp16 on CUDA vs fp32 on a CPU for each role of each profile; or why it cannot run here.

    The fp32 side runs here when the profile's fp32 files are present, else comes from `reference`
    (load_reference: write_reference's outputs of the same inputs on the CPU where the profile was built)."""
    try:
        import onnxruntime as ort
    except Exception as exc:
        return {"skipped": f"onnxruntime unavailable ({type(exc).__name__})"}
    from d2r_edge.onnx.manifest import Variant, load_manifest
    from d2r_edge.onnx.session import Device, on_cuda, resolve_device

    if device is None:
        device, why = resolve_device(Device.AUTO)       # the runtime's own choice, and its reason
        if device is not Device.CUDA:
            return {"skipped": f"no CUDA for ONNX Runtime {ort.__version__} here: {why} (providers: "
                               f"{', '.join(ort.get_available_providers())})"}
    ref_arrays, ref_meta = reference
    pairs, texts = probe_inputs()
    out = {"device": device.value, "reference_machine": ref_meta.get("machine")}
    for models_dir in models:
        if not (models_dir / "manifest.json").is_file():
            out[str(models_dir)] = {"skipped": f"no exported profile at {models_dir}"}
            continue
        manifest = load_manifest(models_dir)
        name = _profile_name(manifest, models_dir)
        for role in ROLES:
            key = f"{name}/{role}"
            try:
                dev = _encoder(role, manifest, Variant.FP16, device)
            except Exception as exc:
                out[key] = {"skipped": f"fp16: {type(exc).__name__}: {str(exc)[:300]}"}
                continue
            got = _outputs(role, dev, pairs, texts)
            row = {"provider_loaded": dev.session.get_providers()[0], "cuda": on_cuda(dev.session)}
            try:
                cpu = _encoder(role, manifest, Variant.FP32, Device.CPU)
                ref, row["reference"] = _outputs(role, cpu, pairs, texts), "fp32 on this machine's CPU"
                row["here_cpu_fp32_ms_per_batch_of_32"] = _ms_per_batch(role, cpu, pairs, texts, max(2, batches // 4))
            except Exception as exc:
                if key not in ref_arrays:
                    out[key] = {**row, "skipped": f"no fp32 here ({type(exc).__name__}) and none in the reference"}
                    continue
                ref, row["reference"] = ref_arrays[key], "fp32 on the reference machine's CPU"
            row.update(compare(role, ref, got))
            row[f"{device.value}_fp16_ms_per_batch_of_32"] = _ms_per_batch(role, dev, pairs, texts, batches)
            for k, v in (ref_meta.get("roles", {}).get(key) or {}).items():
                row[f"reference_{k}"] = v
            out[key] = row
    return out


def demo_run(models: Path | None, work: Path, budget_mib: float = 6.0, variant: str = "fp16") -> dict:
    """A real `d2r-edge run` (demo KB, extractive generator) in its own process; what each repair arm's
    meter recorded: memory kind and source, growth per arm, which arms the cost model masked at `budget_mib`."""
    if models is None or not (models / "manifest.json").is_file():
        return {"skipped": f"no exported profile at {models}"}
    demo = _demo_dir()
    cli = [sys.executable, "-m", "d2r_edge.cli"]
    work.mkdir(parents=True, exist_ok=True)
    kb, records = work / "kb", work / "fever.jsonl"
    shutil.rmtree(kb, ignore_errors=True)
    records.unlink(missing_ok=True)
    common = ["--models", str(models), "--variant", variant, "--allow-random-weights"]
    steps = {"index_build": cli + ["index", "build", "--kb", str(kb), "--docs", str(demo / "docs.jsonl"), *common],
             "run": cli + ["run", "--kb", str(kb), "--task", "fever", "--queries", str(demo / "claims.jsonl"),
                           "--out", str(records), "--budget-mem-mib", str(budget_mib), *common]}
    out = {"budget_mib": budget_mib, "variant": variant}
    for name, cmd in steps.items():
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_log_tail"] = [line for line in proc.stderr.splitlines()
                                   if "ONNX Runtime on" in line or "device memory" in line or "Error" in line][-6:]
        if proc.returncode != 0:
            out[f"{name}_failed"] = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
            return out
    from d2r_edge.pipeline import stage_seconds
    from d2r_edge.runner import read_records

    reps, firsts, query_s = [], [], []
    for rec in read_records(records):
        first = (rec.get("first") or {}).get("timings_s") or {}
        if "mem_growth_mib" in first:
            firsts.append(first["mem_growth_mib"])
        query_s.append(stage_seconds(first) + ((rec.get("repair") or {}).get("latency_s") or 0.0))
        if rec.get("repair"):
            reps.append(rec["repair"])
    per_arm: dict[str, list[float]] = {}
    latency: dict[str, list[float]] = {}
    for rep in reps:
        per_arm.setdefault(rep["arm"], []).append(rep["mem_growth_mib"])
        latency.setdefault(rep["arm"], []).append(rep["latency_s"])
    out.update({
        "queries": len(query_s), "repairs": len(reps),
        "query_s": {"p50": float(np.median(query_s)) if query_s else None, "max": max(query_s, default=None)},
        "memory_kind": sorted({r.get("memory_kind") for r in reps}),
        "memory_source": sorted({str(r.get("memory_source")) for r in reps}),
        "first_attempt_mem_growth_mib": {"max": max(firsts, default=None),
                                         "nonzero": sum(1 for g in firsts if g > 0)},
        "per_arm_mem_growth_mib": {a: {"n": len(g), "min": min(g), "max": max(g)} for a, g in per_arm.items()},
        "cost_masked": sorted({a for r in reps for a in r.get("cost_masked", [])}),
        "mask_fallbacks": sum(1 for r in reps if r.get("mask_fallback")),
        "over_budget": sum(1 for r in reps if r.get("over_budget")),
        "repair_latency_s": {a: float(np.median(t)) for a, t in latency.items()},
    })
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


def _demo_run_keeping_records(args) -> dict:
    """demo_run in a scratch folder (its KB would overflow what the device tool brings back: 8 files), its
    records copied to OUT/run-records.jsonl."""
    with tempfile.TemporaryDirectory() as work:
        out = demo_run(args.run_models, Path(work), budget_mib=args.budget_mib,
                       variant="int8" if args.quick else "fp16")
        if (Path(work) / "fever.jsonl").is_file():
            shutil.copy(Path(work) / "fever.jsonl", args.out / "run-records.jsonl")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--models", type=Path, action="append", default=[],
                    help="an exported profile with fp16 files (repeatable): parity and latency per role")
    ap.add_argument("--reference", type=Path, default=None,
                    help="write_reference's output (path without suffix): fp32 CPU outputs for profiles "
                         "carried without their fp32 files")
    ap.add_argument("--write-reference", type=Path, default=None, metavar="PATH",
                    help="only write the fp32 CPU reference of --models to PATH.npz/.json and exit")
    ap.add_argument("--run-models", type=Path, default=None, help="profile for the real `d2r-edge run` section")
    ap.add_argument("--budget-mib", type=float, default=6.0, help="device-memory budget per repair (paper: 6 MB)")
    ap.add_argument("--quick", action="store_true", help="fewer reads / calls (the CPU-fallback test)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.write_reference is not None:
        write_reference(args.models, args.write_reference, batches=2 if args.quick else 10)
        log.info("wrote %s.npz/.json", args.write_reference)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"env": env()}
    reference = load_reference(args.reference)
    sections = {"meter": lambda: meter(reads=50 if args.quick else 1000),
                "onnx": lambda: onnx_parity(args.models, reference, batches=2 if args.quick else 20),
                "run": lambda: _demo_run_keeping_records(args),
                "select": lambda: select_bench(updates=30 if args.quick else 300, calls=50 if args.quick else 2000)}
    for name, run in sections.items():
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except Exception as exc:      # one section's failure is reported, the others still run
            log.exception("section %s failed", name)
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        log.info("%s: %.1f s", name, time.perf_counter() - t0)
        if name == "run" and isinstance(result["run"], dict) and reference[1]:
            result["run"]["reference_cpu_run"] = reference[1].get("run")
        if name == "meter":
            result["masking"] = masking(result["meter"], budget_mib=args.budget_mib)
        (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    log.info("wrote %s", args.out / "gpu_check.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
