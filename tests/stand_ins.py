"""Stand-ins shared by tests: a deterministic, varied NLI so every failure type and repair occur."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


def hash_nli_scores(pairs) -> np.ndarray:
    """(premise, hypothesis) pairs -> 3-way probabilities from a hash of the pair."""
    out = []
    for p, h in pairs:
        v = np.frombuffer(hashlib.sha256(f"{p}|{h}".encode()).digest()[:12], dtype=np.uint32)
        logits = (v % 1000) / 250.0
        e = np.exp(logits - logits.max())
        out.append(e / e.sum())
    return np.asarray(out, dtype=np.float32).reshape(-1, 3)


def install_hash_nli() -> None:
    """A `RayConfig.worker_setup` hook: every NLI in this process scores with `hash_nli_scores`."""
    from d2r_edge.onnx.encoders import NLI

    NLI.score = lambda self, pairs: hash_nli_scores(pairs)


def profile_without(models: Path, out: Path, roles: dict[str, str]) -> Path:
    """A copy of an exported profile (files linked, not copied) whose manifest lacks `roles`,
    each listed under `absent` with its reason, as `offline-quick` lists its reranker."""
    import json

    data = json.loads((models / "manifest.json").read_text(encoding="utf-8"))
    out.mkdir(parents=True, exist_ok=True)
    for name in roles:
        data["roles"].pop(name)
    data.setdefault("absent", {}).update(roles)
    for raw in data["roles"].values():
        src, dst = models / raw["directory"], out / raw["directory"]
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src.resolve(), target_is_directory=True)
    (out / "manifest.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    return out


class HashNLI:
    """Replaces a loaded NLI: same labels, `hash_nli_scores` outputs (failures and repairs occur)."""

    def __init__(self, real):
        self.labels = real.labels

    def score(self, pairs):
        return hash_nli_scores(pairs)


def fever_world(tmp: Path, models: Path, shared_data: Path, n_docs: int, n_queries: int) -> tuple[Path, Path]:
    """A KB of the first `n_docs` FEVER dev evidence documents (the models' embedder) and a query
    file of the first `n_queries` claims with their labels: (kb directory, queries file)."""
    import json

    from d2r_edge.eval.datasets import fever_evidence, write_docs
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase

    docs, _ = fever_evidence(shared_data / "fever" / "dev.jsonl", limit=n_docs)
    kb = tmp / "kb"
    KnowledgeBase.build(write_docs(docs, tmp / "docs.jsonl"), kb, Embedder(load_manifest(models)))
    queries = tmp / "q.jsonl"
    with open(queries, "w") as fh:
        for line in (shared_data / "fever" / "dev.jsonl").read_text().splitlines()[:n_queries]:
            row = json.loads(line)
            fh.write(json.dumps({"id": row["id"], "claim": row["question"], "label": row["label"]}) + "\n")
    return kb, queries


class ScriptedServer:
    """An OpenAI-compatible stand-in on loopback (HTTP/1.1, keep-alive): answers POSTs from `replies`
    in order - (status, body) or (status, body, headers); body a dict, raw text, or a function of the
    request's headers returning either - and keeps each request's JSON in `seen`, its headers in
    `seen_headers`, its arrival (time.monotonic) in `seen_at`; `connections` counts TCP connections.
    GET /v1/models answers `models` (llama.cpp's shape). It listens on two ports, `url` and `other_url`:
    one server behind two URLs. Use as a context manager."""

    def __init__(self) -> None:
        self.models: dict = {"object": "list", "data": [{"id": "/srv/models/m.gguf", "object": "model",
                                                         "meta": {"n_params": 494032768, "size": 491400064}}]}
        self.models_asked = 0
        self.replies: list[tuple] = []
        self.seen: list[dict] = []
        self.seen_headers: list[dict] = []
        self.seen_at: list[float] = []
        self.connections = 0

    def __enter__(self) -> "ScriptedServer":
        import http.server
        import json
        import threading
        import time

        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True     # headers and body are two writes: no delayed-ACK wait

            def log_message(self, *a):
                pass

            def setup(self):
                outer.connections += 1
                super().setup()

            def do_GET(self):
                outer.models_asked += 1
                found = self.path.rstrip("/").endswith("/models")
                data = json.dumps(outer.models if found else {"error": "not found"}).encode()
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                outer.seen_at.append(time.monotonic())
                outer.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                outer.seen_headers.append(dict(self.headers))
                code, body, *rest = outer.replies.pop(0)
                if callable(body):
                    body = body(self.headers)
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                for name, value in (rest[0] if rest else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._srvs = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), H) for _ in range(2)]
        for srv in self._srvs:
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, daemon=True).start()
        self.url, self.other_url = (f"http://127.0.0.1:{srv.server_port}/v1" for srv in self._srvs)
        return self

    def __exit__(self, *exc) -> None:
        for srv in self._srvs:
            srv.shutdown()
            srv.server_close()


def quoting_the_key(headers) -> dict:
    """A provider's 401 body: it quotes back the key it was sent (as real ones do)."""
    key = (headers.get("Authorization") or "").removeprefix("Bearer ")
    return {"error": {"message": f"Incorrect API key provided: {key}. You can find your API key at "
                                 f"https://example.invalid/keys", "type": "invalid_request_error",
                      "code": "invalid_api_key"}}


class HangingServer:
    """A loopback port that accepts connections and never answers (a hung upstream)."""

    def __enter__(self) -> "HangingServer":
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        return self

    def __exit__(self, *exc) -> None:
        self._sock.close()


def longer(ci: int, full: int) -> int:
    """How many times the default examples a `slow` fuzz search runs: `full` under `.ci/run --full`
    (D2R_FULL=1), else `ci`."""
    import os

    return full if os.environ.get("D2R_FULL") == "1" else ci


def search_longer(test_file: str, examples: int, *extra_args: str, **env: str) -> None:
    """Run a fuzz module's default properties again in a fresh pytest with `examples` per property (the
    `slow` step's longer search); fails with the output's tail when any property fails."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-m",
                           "not slow", *extra_args],
                          env={**os.environ, "D2R_FUZZ_EXAMPLES": str(examples), **env},
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:]


DEMO = Path(__file__).resolve().parent.parent / "d2r_edge" / "data" / "demo"


def demo_questions() -> list[str]:
    import json

    return [json.loads(line)["question"] for line in (DEMO / "questions.jsonl").read_text().splitlines()]


class QueryGatedNLI(HashNLI):
    """`hash_nli_scores`, except that every premise is neutral to a hypothesis whose hash is 0 mod 3: the
    questions (claims) so marked are diagnosed insufficient_evidence whatever was retrieved, so failures
    and repairs occur on any KB and any random-weight generator."""

    def __init__(self, real):
        super().__init__(real)
        self.neutral = [name.lower() for name in real.labels].index("neutral")

    def score(self, pairs):
        out = hash_nli_scores(pairs)
        for i, (_, h) in enumerate(pairs):
            if hashlib.sha256(h.encode()).digest()[0] % 3 == 0:
                out[i] = 0.0
                out[i, self.neutral] = 1.0
        return out


def make_runtime(kb: Path, models: Path, task=None, **kw):
    """A Runtime on `kb` with random-weight `models` whose diagnoser scores with `QueryGatedNLI` (some
    questions always fail the evidence check, so repairs occur); the generator keeps the model's NLI."""
    from d2r_edge.app import RunSettings
    from d2r_edge.runtime import Runtime
    from d2r_edge.tasks import Task

    rt = Runtime(RunSettings(kb=kb, models=models, task=task or Task.QA, allow_random_weights=True, **kw))
    rt.pipeline.diagnoser.nli = QueryGatedNLI(rt.pipeline.diagnoser.nli)
    return rt


class Live:
    """An app served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app) -> None:
        import socket

        import uvicorn

        self.app = app
        # proto IPPROTO_TCP, as serve's own socket: asyncio sets TCP_NODELAY only on such sockets, and a
        # keep-alive client then waits out a delayed ACK (~40 ms) per response
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))

    def __enter__(self) -> "Live":
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


class StubGenerator:
    """A generator that answers every prompt "some text" / SUPPORTS (the pipeline tests' generator)."""

    name = "stub"

    def generate(self, task, style, query, passages, sample=True):
        from d2r_edge.diagnose import Label
        from d2r_edge.generate.base import Generation

        return Generation("some text", Label.SUPPORTS, "raw")


class ScoreByCall:
    """A retriever of one passage whose score (what top_score_detector reads) is `score(query, n)` on
    the query's n-th retrieval (1: the first attempt, later: repairs)."""

    kb = None

    def __init__(self, score) -> None:
        self.score, self.calls = score, {}

    def embed(self, query):
        return np.ones(4)

    def retrieve(self, query, cfg, query_vec=None):
        from d2r_edge.retrieval.retriever import Passage

        self.calls[query] = self.calls.get(query, 0) + 1
        return [Passage(0, "d0", "T", "some text", float(self.score(query, self.calls[query])))]


def top_score_detector():
    """A FEVER detector that reads only the top retrieval score: 3 -> P(wrong) ~ 0.99, 1 -> ~ 0.01."""
    from d2r_edge.detector import Detector, feature_names

    names = feature_names(True)
    w = np.zeros(len(names))
    w[names.index("ret_top1")] = 5.0
    return Detector(names, "fever", np.zeros(len(names)), np.ones(len(names)), w, -10.0, 0.5)


class RomeRetriever:
    """One passage about Rome for every query; counts its retrievals."""

    kb = None

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, query):
        return np.ones(4)

    def retrieve(self, query, cfg, query_vec=None):
        from d2r_edge.retrieval.retriever import Passage

        self.calls += 1
        return [Passage(0, "d0", "Rome", "Rome is the capital of Italy.", 1.0)]
