"""Issue 38's device check (benchmarks/gpu/driver.py) on a machine without a GPU: every section runs
and says what it fell back to; the masking section acts on measured device-memory growth."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from benchmarks.gpu.driver import compare, load_reference, main, masking, onnx_parity, write_reference
from d2r_edge.onnx.session import Device


def test_the_check_runs_without_a_gpu_and_says_so(tmp_path, tiny_models):
    assert main(["--out", str(tmp_path), "--quick", "--models", str(tiny_models), "--run-models",
                 str(tiny_models)]) == 0
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(r) == {"env", "meter", "masking", "onnx", "run", "select"}
    # the real `d2r-edge run` ran in its own process on every demo claim and its records were read
    assert r["run"]["queries"] == 16 and "run_failed" not in r["run"] and r["run"]["budget_mib"] == 6.0
    # what comes back from the device is OUT's files alone, at most 8: the KB stays in a scratch folder
    assert (tmp_path / "run-records.jsonl").is_file() and len(list(tmp_path.rglob("*"))) <= 8
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


def test_parity_against_a_reference_made_elsewhere(tmp_path, tiny_models):
    """The device carries fp16 files only for big profiles: fp32 CPU outputs come from the reference file.
    Here the same code path runs with the fp16 files on the CPU provider."""
    ref = tmp_path / "ref"
    write_reference([tiny_models], ref, batches=1)
    meta = json.loads(ref.with_suffix(".json").read_text())
    assert set(meta["roles"]) == {"tiny/nli", "tiny/reranker", "tiny/embedder"}
    assert meta["run"]["queries"] == 16 and meta["run"]["variant"] == "int8" and meta["run"]["query_s"]["p50"] > 0
    carried = tmp_path / "tiny"                      # as carried: the NLI without its fp32 files
    shutil.copytree(tiny_models, carried)
    shutil.rmtree(carried / "nli" / "fp32")
    out = onnx_parity([carried], load_reference(ref), batches=1, device=Device.CPU)
    nli, emb = out["tiny/nli"], out["tiny/embedder"]
    assert nli["reference"] == "fp32 on the reference machine's CPU" and not nli["cuda"]
    assert emb["reference"] == "fp32 on this machine's CPU"
    assert nli["label_agreement"] >= 0.9 and nli["max_abs_diff"] < 0.05          # fp16 vs fp32, same weights
    assert emb["min_cosine"] > 0.999 and "reference_cpu_int8_ms_per_batch_of_32" in emb
    assert out["tiny/reranker"]["pair_order_agreement"] > 0.9


def test_compare_measures_what_each_role_is_used_for():
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5], [0.1, 0.0, 0.3]])
    flipped = logits.copy()
    flipped[2] = [0.3, 0.0, 0.1]
    row = compare("nli", logits, flipped)
    assert row["label_agreement"] == pytest.approx(2 / 3) and row["max_abs_diff"] == pytest.approx(0.2)
    assert compare("reranker", np.array([3.0, 2.0, 1.0]), np.array([1.0, 2.0, 3.0]))["pair_order_agreement"] == 0
    v = np.eye(3)
    assert compare("embedder", v, v)["min_cosine"] == pytest.approx(1.0)
