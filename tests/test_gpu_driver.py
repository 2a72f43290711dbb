"""Issue 38's device check (benchmarks/gpu/driver.py) on a machine without a GPU: every section runs
and says what it fell back to; the masking section acts on measured device-memory growth."""

from __future__ import annotations

import json

from benchmarks.gpu.driver import main, masking


def test_the_check_runs_without_a_gpu_and_says_so(tmp_path, tiny_models):
    assert main(["--out", str(tmp_path), "--quick", "--models", str(tiny_models)]) == 0
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(r) == {"env", "meter", "masking", "onnx", "select"}
    assert r["env"]["cpus"] >= 1 and "onnxruntime" in r["env"]["versions"]
    if r["meter"]["memory_kind"] == "host":                   # no NVML here: RSS, and nothing allocated on a GPU
        assert "no CUDA device" in r["meter"]["allocations"] and r["masking"]["skipped"]
        assert all("skipped" in v for v in r["onnx"].values()) or "skipped" in r["onnx"]
    assert r["meter"]["read_us"] > 0
    for d in ("d147", "d786"):
        assert 0 < r["select"][d]["select_p50_us"] <= r["select"][d]["select_p90_us"]


def test_masking_acts_on_measured_growth():
    rows = [{"allocated_mib": a, "meter_growth_mib": g} for a, g in ((1, 2.0), (4, 4.0), (16, 16.0), (64, 64.0))]
    m = masking({"allocations": rows}, budget_mib=6.0)
    assert [a["allowed"] for a in m["arms"]] == [True, True, False, False] and m["fallback"] is False
    none_fit = masking({"allocations": rows[2:]}, budget_mib=6.0)     # nothing fits: the cheapest stays
    assert [a["allowed"] for a in none_fit["arms"]] == [True, False] and none_fit["fallback"] is True
