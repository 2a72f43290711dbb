"""What every method of an evaluation shares: attempts and generator calls, computed once.

`AttemptStore` is the pipeline's memo (`Pipeline.memo`): the outcome of one
(query, effective config) - passages, generation, diagnosis, stage times and the
metered cost of the attempt - appended to a JSONL file as soon as it exists. The
first attempt of a query is then the same object for every method, an arm that
two methods (or two training epochs) pick is computed once, and a killed
evaluation rerun with the same store redoes nothing that finished.

`CachedGenerator` keys each generator request (task, prompt style when the
generator has prompts, query, passages, and the model the server serves - not its
URL) and keeps the answer on disk, so a repeated request never reaches the LLM twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np

from d2r_edge.budget import Measurement, MemoryKind, MemorySource
from d2r_edge.diagnose import Diagnosis, Label
from d2r_edge.generate.base import Generation
from d2r_edge.pipeline import Attempt
from d2r_edge.repair import PipelineConfig
from d2r_edge.retrieval.retriever import Passage
from d2r_edge.runner import RecordLog, read_records
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import self_check_sha256, template_sha256

log = logging.getLogger(__name__)


def config_key(cfg: PipelineConfig) -> str:
    r = cfg.retrieval
    return (f"{r.kind.value}|k{r.top_k}|rerank{int(r.rerank)}:{r.rerank_top_n}|{cfg.prompt.value}"
            f"|refresh{int(cfg.refresh)}|titles{int(cfg.evidence_titles)}"
            + (f"|hop{r.second_hop}" if r.second_hop else "") + ("|majority" if cfg.majority else "")
            + ("|reader" if cfg.reader_answer else ""))


def _label(value) -> Label | None:
    return None if value is None else Label(value)


def attempt_to_json(a: Attempt) -> dict:
    d = a.diagnosis
    return {
        "passages": [[p.chunk_id, p.score] for p in a.passages],
        "generation": {"response": a.generation.response,
                       "label": a.generation.label.value if a.generation.label else None,
                       "raw": a.generation.raw,
                       "logprobs": None if a.generation.logprobs is None else list(a.generation.logprobs),
                       **({"samples": list(a.generation.samples)} if a.generation.samples is not None else {}),
                       **({"p_true": a.generation.p_true} if a.generation.p_true is not None else {})},
        "diagnosis": {"failure": d.failure.value, "e_q": d.e_q.value, "e_r": d.e_r.value, "kg": d.kg.value,
                      "label": d.label.value if d.label else None,
                      "gated_label": d.gated_label.value if d.gated_label else None,
                      "nli_q": d.passage_probs_q, "nli_r": d.passage_probs_r,
                      **({"consistency": d.consistency} if d.consistency is not None else {}),
                      **({"reader": d.reader} if d.reader is not None else {})},
        "timings_s": a.timings_s,
    }


def attempt_from_json(row: dict, chunks: list[dict]) -> Attempt:
    passages = []
    for chunk_id, score in row["passages"]:
        if isinstance(chunk_id, bool) or not 0 <= int(chunk_id) < len(chunks):
            raise IndexError(f"chunk {chunk_id!r} is not in the KB")
        c = chunks[int(chunk_id)]
        passages.append(Passage(int(c["chunk_id"]), c["doc_id"], c["title"], c["text"], float(score)))
    g, d = row["generation"], row["diagnosis"]
    diag = Diagnosis(FailureType(d["failure"]), Entailment(d["e_q"]), Entailment(d["e_r"]), KGStatus(d["kg"]),
                     _label(d["label"]), _label(d["gated_label"]), _probs(d["nli_q"]), _probs(d["nli_r"]),
                     _consistency(d), _reader(d))
    return Attempt(passages, Generation(_text(g["response"]), _label(g["label"]), _text(g["raw"]),
                                        logprobs=_logprobs(g), samples=_samples(g), p_true=_p_true(g)), diag,
                   {str(k): float(v) for k, v in dict(row["timings_s"]).items()})


def _reader(d: dict) -> dict | None:
    """A stored reader span (text, passage, confidence, no_answer, seconds); None where no reader ran."""
    r = d.get("reader")
    if r is None:
        return None
    if not (isinstance(r, dict) and isinstance(r.get("text"), str) and isinstance(r.get("no_answer"), bool)
            and isinstance(r.get("passage"), int) and not isinstance(r.get("passage"), bool)
            and _is_number(r.get("confidence")) and 0.0 <= r["confidence"] <= 1.0
            and _is_number(r.get("seconds", 0.0))):
        raise TypeError("reader is not a stored span")
    return dict(r)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value


def _probs(rows) -> list:
    """Per-passage NLI probabilities as stored ({label: p} per passage, None for a pair not scored),
    checked to be that."""
    if not isinstance(rows, list) or not all(r is None or (isinstance(r, dict) and all(map(_is_number, r.values())))
                                             for r in rows):
        raise TypeError("NLI probabilities are not a list of {label: probability}")
    return rows


def attempt_row_ok(chunks: list[dict]):
    """A validator of stored attempt rows (RecordLog `valid`): the row decodes against this KB."""
    def ok(row: dict) -> bool:
        cost_from_json(row["cost"])
        attempt_from_json(row["attempt"], chunks)
        return isinstance(row["query"], str) and isinstance(row["config"], str)
    return ok


def generation_row_ok(row: dict) -> bool:
    """A validator of stored generator answers: the row replays as a Generation (or, a self-check row,
    as a P(True))."""
    if row.get("self_check") is True:
        _p_true(row), float(row.get("latency_s") or 0.0)
        return isinstance(row["key"], str)
    _label(row["label"]), _logprobs(row), _samples(row), _p_true(row)
    float(row.get("latency_s") or 0.0), float(row.get("samples_s") or 0.0), float(row.get("p_true_s") or 0.0)
    return isinstance(row["key"], str) and isinstance(row["response"], str) and isinstance(row["raw"], str)


def _logprobs(row: dict) -> tuple[float, ...] | None:
    """Stored answer-token log-probabilities; None where none were given (or rows written before them)."""
    lp = row.get("logprobs")
    if lp is not None and not (isinstance(lp, list) and all(map(_is_number, lp))):
        raise TypeError("logprobs is not a list of numbers")
    return None if lp is None else tuple(float(v) for v in lp)


def _p_true(row: dict) -> float | None:
    """A stored self-check P(True); None where none was asked or readable (or rows written before it)."""
    p = row.get("p_true")
    if p is not None and not (_is_number(p) and 0.0 <= p <= 1.0):
        raise TypeError("p_true is not a probability")
    return None if p is None else float(p)


def _samples(row: dict) -> tuple[str, ...] | None:
    """Stored self-consistency samples; None where none were drawn (or rows written before them)."""
    s = row.get("samples")
    if s is not None and not (isinstance(s, list) and all(isinstance(v, str) for v in s)):
        raise TypeError("samples is not a list of strings")
    return None if s is None else tuple(s)


def _consistency(row: dict) -> dict | None:
    from d2r_edge.consistency import SIGNALS

    c = row.get("consistency")
    if c is not None and not (isinstance(c, dict) and set(c) == set(SIGNALS) and all(map(_is_number, c.values()))):
        raise TypeError(f"consistency is not {{{', '.join(SIGNALS)}: number}}")
    return None if c is None else {k: float(v) for k, v in c.items()}


def cost_to_json(m: Measurement | None) -> dict | None:
    if m is None:
        return None
    return {"latency_s": m.latency_s, "mem_growth_mib": m.mem_growth_mib, "memory_kind": m.memory_kind.value,
            "memory_source": m.memory_source.value, "samples": m.samples}


def cost_from_json(c: dict | None) -> Measurement | None:
    if c is None:
        return None
    m = Measurement(float(c["latency_s"]), float(c["mem_growth_mib"]), MemoryKind(c["memory_kind"]),
                    MemorySource(c["memory_source"]), int(c["samples"]))
    if not (np.isfinite(m.latency_s) and m.latency_s >= 0 and np.isfinite(m.mem_growth_mib)):
        raise ValueError(f"cost {c} is not a measurement")
    return m


class _RowLog:
    """The JSONL log behind a store: appended to, or for a read-only copy (a Ray worker's) read
    once and never written, what is added since kept in `new_rows` for the driver to store."""

    def __init__(self, path: Path, read_only: bool, valid) -> None:
        self.path = path
        self._log = None if read_only else RecordLog(path, valid=valid)
        self.records = read_records(path, valid) if read_only else self._log.records
        self.new_rows: list[dict] = []

    def append(self, row: dict) -> None:
        if self._log is None:
            self.new_rows.append(row)
        else:
            self._log.append(row)

    def take_new(self) -> list[dict]:
        rows, self.new_rows = self.new_rows, []
        return rows

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


def _attempt_key(row: dict) -> tuple[str, str, bool]:
    return row["query"], row["config"], row["cost"] is not None


class AttemptStore:
    """The pipeline memo, persisted: one JSONL line per (query, effective config).

    `read_only`: a Ray worker's copy. It reads the file the driver writes, never
    writes it, and keeps what it computes for the driver to `add` (`log.take_new()`).
    """

    def __init__(self, path: Path, chunks: list[dict], read_only: bool = False) -> None:
        self.chunks = chunks
        self.log = _RowLog(path, read_only, attempt_row_ok(chunks))
        # (query, config, metered): an attempt first computed unmetered (a first attempt) and
        # later asked for with its cost (an arm with the same effective config) is kept twice,
        # so the first attempt every method sees never changes
        self._rows: dict[tuple[str, str, bool], dict] = {_attempt_key(row): row for row in self.log.records}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, query: str, cfg: PipelineConfig, metered: bool) -> dict | None:
        key = config_key(cfg)
        row = self._rows.get((query, key, True))
        if not metered:
            row = self._rows.get((query, key, False)) or row
        return row

    def has(self, query: str, cfg: PipelineConfig, metered: bool) -> bool:
        """Whether `get` would answer, without decoding the attempt or counting a hit."""
        return self._row(query, cfg, metered) is not None

    def get(self, query: str, cfg: PipelineConfig, metered: bool) -> tuple[Attempt, Measurement | None] | None:
        row = self._row(query, cfg, metered)
        if row is None:
            self.misses += 1
            return None
        self.hits += 1
        return attempt_from_json(row["attempt"], self.chunks), cost_from_json(row["cost"])

    def put(self, query: str, cfg: PipelineConfig, attempt: Attempt, cost: Measurement | None) -> None:
        self.add({"query": query, "config": config_key(cfg), "attempt": attempt_to_json(attempt),
                  "cost": cost_to_json(cost)})

    def add(self, row: dict) -> None:
        """Keep one stored row (from `put`, or computed by a worker); a row already held is skipped."""
        key = _attempt_key(row)
        if key in self._rows:
            return
        self._rows[key] = row
        self.log.append(row)

    def close(self) -> None:
        self.log.close()


class CachedGenerator:
    """A generator whose answers are kept on disk by request.

    The key is what determines the answer: the model the server says it serves
    (`served_model()`: its id and file shape, not its URL), the sampling settings,
    the prompt template's hash, the task, the query and the passages. The same model
    behind another host or port replays; another model behind the same port does not.

    Caches written before that (issue 54) keyed the server's URL and the requested
    model name instead. They are still read under that old key, but only after one
    check: the first request found only there is asked of the server again, and the
    old answers are used only if the server gives the same one (at temperature 0 the
    same model does); else none of them is (`legacy_ok`), and every answer is fresh.
    A replayed old row is stored again under the new key.
    """

    def __init__(self, inner, path: Path, read_only: bool = False) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.prompt_sensitive = getattr(inner, "prompt_sensitive", True)
        served = getattr(inner, "served_model", None)
        self.served = served() if callable(served) else {"id": getattr(inner, "model", None)}
        sampling = {"temperature": getattr(inner, "temperature", None),
                    "max_tokens": getattr(inner, "max_tokens", None)}
        samples = ({"samples": inner.samples, "sample_temperature": inner.sample_temperature}
                   if getattr(inner, "samples", 0) else {})
        base = {"name": self.name, "served": self.served, **sampling}
        self.identity = json.dumps(base, sort_keys=True)
        self.sampled_identity = json.dumps({**base, **samples}, sort_keys=True) if samples else self.identity
        # the key before issue 54: the URL and the requested model name (read only, checked once)
        old = {"name": self.name, "model": getattr(inner, "model", None), "base_url": getattr(inner, "base_url", None),
               **sampling}
        self._legacy = (json.dumps(old, sort_keys=True),
                        json.dumps({**old, **samples}, sort_keys=True) if samples else json.dumps(old, sort_keys=True))
        self.legacy_ok: bool | None = None      # None: not checked yet
        self.log = _RowLog(path, read_only, generation_row_ok)      # read_only: new answers for the driver to `add`
        self._cache = {row["key"]: row for row in self.log.records}
        self.calls = self.hits = self.legacy_hits = 0
        self.added = self.requests = 0      # answers this process stored (local or from workers), their requests

    def _key(self, identity: str, task, style, query: str, passages: list[str]) -> str:
        # JSON mode is read per request: a server that rejects it changes the output format
        req = [identity, task.value, style.value if self.prompt_sensitive else None, query, passages,
               getattr(self.inner, "json_mode", None)]
        if self.prompt_sensitive:      # the template's text too: a changed prompt is another request
            req.append(template_sha256(task, style))
        return hashlib.sha256(json.dumps(req, ensure_ascii=False).encode()).hexdigest()

    def key(self, task, style, query: str, passages: list[str], sample: bool = True) -> str:
        return self._key(self.sampled_identity if sample else self.identity, task, style, query, passages)

    def legacy_key(self, task, style, query: str, passages: list[str], sample: bool = True) -> str:
        return self._key(self._legacy[1] if sample else self._legacy[0], task, style, query, passages)

    def generate(self, task, style, query: str, passages: list[str], sample: bool = True) -> Generation:
        key = self.key(task, style, query, passages, sample)
        row = self._cache.get(key)
        if row is None and self.legacy_ok is not False:
            old = self._cache.get(self.legacy_key(task, style, query, passages, sample))
            if old is not None and self.legacy_ok is None:
                gen = self._call(key, task, style, query, passages, sample)
                self.legacy_ok = gen.response == old["response"]
                log.info("generation cache %s: rows under the key before issue 54 %s (the server %s the "
                         "stored answer to one of them)", self.log.path, "are used" if self.legacy_ok else
                         "are not used", "repeated" if self.legacy_ok else "did not repeat")
                return gen
            if old is not None:
                self.legacy_hits += 1
                row = {**old, "key": key}
                self._cache[key] = row
                self.log.append(row)
        if row is not None:
            self.hits += 1
            # the replayed answer carries the time the real call took, so the attempt's
            # metered cost stays the generator's cost (rows written before this have none)
            return Generation(row["response"], _label(row["label"]), row["raw"],
                              replayed_s=float(row.get("latency_s") or 0.0), logprobs=_logprobs(row),
                              samples=_samples(row), samples_s=float(row.get("samples_s") or 0.0))
        return self._call(key, task, style, query, passages, sample)

    def _call(self, key: str, task, style, query: str, passages: list[str], sample: bool) -> Generation:
        self.calls += 1
        t0 = time.perf_counter()
        gen = self.inner.generate(task, style, query, passages, sample=sample)
        self.add({"key": key, "response": gen.response, "label": gen.label.value if gen.label else None,
                  "raw": gen.raw, "latency_s": time.perf_counter() - t0,
                  "logprobs": None if gen.logprobs is None else list(gen.logprobs),
                  **({"samples": list(gen.samples), "samples_s": gen.samples_s} if gen.samples is not None else {})})
        return gen

    @property
    def self_check(self) -> bool:
        return bool(getattr(self.inner, "self_check", False))

    @property
    def self_check_samples(self) -> bool:
        return bool(getattr(self.inner, "self_check_samples", False))

    def p_true(self, task, query: str, passages: list[str], answer: str,
               samples: tuple[str, ...] = ()) -> tuple[float | None, float]:
        """The inner generator's self-check, kept on disk beside the answers (a row of its own, keyed by
        the served model, the self-check prompt, the query, the passages and the answer, and the samples
        shown when there are any): a run that adds the self-check to cached answers pays only for it."""
        req = [self.identity, "self_check", self_check_sha256(task, bool(samples)), task.value, query, passages,
               answer] + ([list(samples)] if samples else [])
        key = hashlib.sha256(json.dumps(req, ensure_ascii=False).encode()).hexdigest()
        row = self._cache.get(key)
        if row is not None:
            self.hits += 1
            return _p_true(row), float(row.get("latency_s") or 0.0)
        self.calls += 1
        p, took_s = self.inner.p_true(task, query, passages, answer, *((samples,) if samples else ()))
        self.add({"key": key, "self_check": True, "p_true": p, "latency_s": took_s})
        return p, took_s

    def add(self, row: dict) -> None:
        if row["key"] in self._cache:
            return
        self.added += 1
        self.requests += 1 + len(row.get("samples") or ())
        self._cache[row["key"]] = row
        self.log.append(row)

    def close(self) -> None:
        self.log.close()
