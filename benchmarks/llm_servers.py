"""What token log-probabilities and self-consistency samples cost, per LLM server.

    python -m benchmarks.llm_servers --model models/llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --claims 12 --samples 4 --out docs/runs/llm-servers.json

Starts each server on loopback with the same GGUF - llama-cpp-python's (`python -m
llama_cpp.server`) and llama.cpp's own `llama-server` (models/llm/bin, built by `bash .ci/setup-llm
llama-server`) - and answers the same FEVER dev claims through d2r-edge's client
(`OpenAICompatible`, the prompt `run` uses, five titled passages: the claim's evidence and four
other claims'): per claim the first answer (prompt not cached), then with the prompt cached a
greedy answer without and one with log-probabilities (alternating which goes first) and the
self-consistency samples (`--samples` more answers at temperature 0.7 to the same prompt).
Prints, and writes with --out, wall seconds (median, p90) and the paired log-prob overhead.
Not a pytest benchmark: it needs the LLM build and a GGUF, and takes minutes.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from d2r_edge.eval.datasets import fever_title
from d2r_edge.generate.openai_compat import OpenAICompatible
from d2r_edge.repair import PromptStyle
from d2r_edge.tasks import Task, build_prompt

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


def claims(n: int) -> list[tuple[str, list[str]]]:
    rows = [json.loads(line) for line in (DATA / "fever" / "dev.jsonl").open(encoding="utf-8")]
    rows = [r for r in rows if r.get("derived_evidence_sentences")][: n + 4]

    def passage(r):
        title, _, text = r["derived_evidence_sentences"][0]
        return f"{fever_title(title)}\n{text}"

    return [(r["question"], [passage(r)] + [passage(o) for o in rows[i + 1:i + 5]]) for i, r in enumerate(rows[:n])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    if kind == "llama-cpp-python":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", "4096", "--n_threads", str(threads)]
    else:
        cmd = [str(ROOT / "models" / "llm" / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
               "--port", str(port), "-c", "4096", "-t", str(threads), "--parallel", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{kind} did not come up on {url}")


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_s": statistics.median(xs), "p90_s": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
            "mean_s": statistics.fmean(xs), "n": len(xs)}


def measure(url: str, work: list[tuple[str, list[str]]], samples: int) -> dict:
    """Per claim: the first answer (its prompt not cached: what a run pays), then with the prompt
    cached, a greedy answer without and one with log-probabilities (in alternating order) and the
    `samples` answers at temperature 0.7: the cached calls differ only in what is decoded."""
    def client(**kw):
        return OpenAICompatible(url, "local", api_key_env=None, timeout_s=600, max_retries=0, **kw)

    plain, lp, sampler = client(logprobs=False), client(logprobs=True), client(logprobs=False, samples=samples)
    plain.generate(Task.FEVER, PromptStyle.SIMPLE, "A warm-up claim.", ["Warm-up\nNothing."])
    times: dict[str, list[float]] = {"first answer (prompt not cached)": [], "greedy, cached prompt": [],
                                     "greedy + log-probs, cached prompt": [],
                                     f"{samples} samples at 0.7, cached prompt": []}
    answers, overhead = [], []
    for i, (claim, passages) in enumerate(work):
        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0

        g, t = timed(lambda: plain.generate(Task.FEVER, PromptStyle.SIMPLE, claim, passages))
        times["first answer (prompt not cached)"].append(t)
        pair = [("greedy, cached prompt", plain), ("greedy + log-probs, cached prompt", lp)]
        got = {}
        for name, c in (pair if i % 2 == 0 else pair[::-1]):
            got[name], t = timed(lambda c=c: c.generate(Task.FEVER, PromptStyle.SIMPLE, claim, passages))
            times[name].append(t)
        overhead.append(times["greedy + log-probs, cached prompt"][-1] - times["greedy, cached prompt"][-1])
        prompt = build_prompt(Task.FEVER, PromptStyle.SIMPLE, claim, passages)
        drawn, t = timed(lambda: [sampler._sample(Task.FEVER, prompt, k) for k in range(samples)])
        times[f"{samples} samples at 0.7, cached prompt"].append(t)
        answers.append({"greedy": g.label.value if g.label else None,
                        "with_logprobs": got["greedy + log-probs, cached prompt"].logprobs is not None,
                        "samples": drawn})
    for c in (plain, lp, sampler):
        c.close()
    return {"times": {k: _stats(v) for k, v in times.items()}, "logprob_overhead": _stats(overhead),
            "answers": answers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--claims", type=int, default=12)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--servers", default="llama-cpp-python,llama-server")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = claims(args.claims)
    result = {"model": str(args.model), "claims": len(work), "threads": args.threads, "servers": {}}
    for kind in args.servers.split(","):
        proc, url = start(kind, Path(args.model), args.threads)
        try:
            result["servers"][kind] = measure(url, work, args.samples)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        r = result["servers"][kind]
        for name, st in [*r["times"].items(), ("log-prob overhead (paired)", r["logprob_overhead"])]:
            print(f"{kind:18s} {name:38s} median {st['median_s']:6.2f} s  p90 {st['p90_s']:6.2f} s  (n {st['n']})",
                  flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
