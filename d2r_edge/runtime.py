"""`Runtime`: d2r-edge in a Python application, loaded once, answering one query at a time.

    from d2r_edge import Runtime, RunSettings, Task

    rt = Runtime(RunSettings(kb=Path("demo-out/kb"), models=Path("models/offline"), task=Task.QA))
    res = rt.answer("Who designed the Millbrook footbridge?", deadline_s=2.0)
    answer, why, own_ms = res.answer, res.failure, res.latency_ms["overhead"]
    diag = rt.verify("Who designed the Millbrook footbridge?", "Ada Marsh")   # an app's own answer

The same settings as `d2r-edge run` (`RunSettings`), the same record (`Result.record`); `run` and
`serve` are layers over it. Thread-safe: by default one query is answered at a time (the models'
sessions already use every core) and concurrent callers queue; `RunSettings.parallel_requests` > 1
answers that many at once (the policy and a refresh are then behind a lock, the refresh arms are
off), and with `micro_batch_pairs` their NLI pairs are merged into shared model calls.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import d2r_edge.deadline as deadline
from d2r_edge.app import build_pipeline, logged_updates, save_policy
from d2r_edge.deadline import DeadlineExceeded
from d2r_edge.diagnose import Diagnosis, Label, shared_words
from d2r_edge.errors import InputError
from d2r_edge.latency import split_ms
from d2r_edge.pipeline import Pipeline
from d2r_edge.policy import updates_of
from d2r_edge.retrieval.retriever import Passage, evidence_text
from d2r_edge.signals import FailureType
from d2r_edge.tasks import Task

log = logging.getLogger(__name__)

MAX_QUERY_CHARS = 4000        # the models read ~512 tokens; longer text is an input error, not a truncation


@dataclass(frozen=True)
class PassageRef:
    doc_id: str
    title: str
    score: float | None                  # None: given by the caller, not retrieved
    text: str = field(repr=False, default="")


@dataclass(frozen=True)
class Result:
    """One answered query: the final answer and why it is trusted (or was repaired).

    `latency_ms`: d2r_edge.latency's split: the stages embed / retrieve / generate / diagnose of
    the first attempt, gate, repair (the whole repair action, its own generation included and
    named in `repair_generate`) and other sum to `total`; `overhead` = total minus the generator's
    time in both attempts (what d2r-edge itself costs). The `budget` (per repair action, generator
    included) limits `repair`; a `deadline_s` limits `total`."""

    id: str
    query: str
    task: Task
    answer: str
    first_answer: str
    failure: FailureType                 # the first answer's diagnosis (Alg. 1)
    final_failure: FailureType
    repaired: bool
    arm: str | None
    passages: tuple[PassageRef, ...]     # what the final answer read
    diagnosis: Diagnosis                 # the final attempt's
    p_wrong: float | None
    latency_ms: dict
    skipped: dict | None                 # repair_skipped: why a diagnosed failure was not repaired
    repair_error: str | None
    over_budget: bool
    record: dict                         # the `run` record (plus request_id)
    trusted: bool | None = None          # with a trust certificate: the final answer's P(wrong) <= its threshold
    abstained: bool = False              # untrusted and withheld (`answer` is then the stated abstention)


@dataclass(frozen=True)
class Verification:
    """`verify`: Algorithm 1 on an answer the application produced itself."""

    query: str
    answer: str
    label: Label | None
    diagnosis: Diagnosis
    passages: tuple[PassageRef, ...]
    latency_ms: dict

    @property
    def failure(self) -> FailureType:
        return self.diagnosis.failure


def _ms(seconds: float) -> float:
    return round(1000.0 * seconds, 3)


def _refs(passages: list[Passage]) -> tuple[PassageRef, ...]:
    return tuple(PassageRef(p.doc_id, p.title, float(p.score), p.text) for p in passages)


def check_query(text, what: str = "query") -> str:
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"the {what} must be a non-empty string, got {type(text).__name__}"
                         + ("" if not isinstance(text, str) else " (empty)"))
    if len(text) > MAX_QUERY_CHARS:
        raise InputError(f"the {what} has {len(text)} characters; at most {MAX_QUERY_CHARS} (the models "
                         f"read ~512 tokens)")
    return text.strip()


class Runtime:
    """Models, KB, policy, cost model and generator loaded once from `RunSettings`."""

    def __init__(self, settings, pipeline: Pipeline | None = None) -> None:
        self.settings = settings
        self.pipeline = pipeline if pipeline is not None else build_pipeline(settings)
        self.task: Task = self.pipeline.task
        # queries answered at once; the policy's own state is behind pipeline.state_lock
        self._slots = threading.BoundedSemaphore(settings.parallel_requests)

    def _task(self, task) -> Task:
        if task is None:
            return self.task
        try:
            task = Task(task)
        except ValueError:
            raise InputError(f"task must be one of {[t.value for t in Task]}, got {task!r}") from None
        if task is not self.task:
            raise InputError(f"this runtime was loaded for task {self.task.value!r} (its KG thresholds and "
                             f"policy are that task's); start another one with task {task.value!r}")
        return task

    def answer(self, query: str, task: Task | str | None = None, deadline_s: float | None = None,
               learn: bool = False, request_id: str | None = None) -> Result:
        """Retrieve, generate, diagnose and (where the diagnosis says so, and the budget and the
        deadline allow) repair. `learn`: Algorithm 2's label-free policy update after a repair.
        Raises InputError for a bad query, GeneratorError when the generator cannot answer, and
        DeadlineExceeded when `deadline_s` passes before a slot frees; the generator's calls and
        retries never wait past the deadline (a hung generator raises GeneratorError, timed_out)."""
        query = check_query(query, "claim" if self.task.fact_verification else "question")
        task = self._task(task)
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                       or not deadline_s > 0):
            raise InputError(f"deadline_s must be a number > 0, got {deadline_s!r}")
        rid = request_id or uuid.uuid4().hex
        with deadline.scope(deadline_s):      # from here: the wait for a slot counts against it
            if not self._slots.acquire(timeout=max(0.0, deadline.remaining_s() or 0.0) if deadline_s else None):
                raise DeadlineExceeded(f"the deadline ({deadline_s:.3f} s) passed while the query waited for "
                                       f"an answering slot (parallel_requests={self.settings.parallel_requests})"
                                       f"; give a longer deadline or raise parallel_requests")
            try:
                left_s = deadline.remaining_s()
                rec, first, final = self.pipeline.run_attempts(query, learn, left_s)
            finally:
                self._slots.release()
        record = {"id": rid, "request_id": rid, "epoch": None, "query": query, "gold_label": None,
                  "gold_answer": None, "task": task.value, **rec, "first_correct": None,
                  "final_correct": None, "error": None}
        repair = rec.get("repair") or {}
        return Result(
            id=rid, query=query, task=task, answer=rec["final_answer"], first_answer=rec["first_answer"],
            failure=first.diagnosis.failure, final_failure=final.diagnosis.failure, repaired=bool(repair),
            arm=repair.get("arm"), passages=_refs(final.passages), diagnosis=final.diagnosis,
            p_wrong=rec.get("p_wrong"), latency_ms=split_ms(rec), skipped=rec.get("repair_skipped"),
            repair_error=rec.get("repair_error"), over_budget=bool(repair.get("over_budget")), record=record,
            trusted=rec.get("trusted"), abstained=bool(rec.get("abstained")))

    def save_policy(self, path: Path) -> None:
        """The policy and its cost model, saved atomically (between two answers)."""
        with self.pipeline.state_lock:
            save_policy(self.pipeline, Path(path))

    def replay(self, repairs: list[dict]) -> int:
        """Apply logged online updates (`repair` objects of records answered with learn=True) that
        the loaded policy does not have yet, in order; returns how many."""
        done = 0
        with self.pipeline.state_lock:
            for rep in repairs:
                after = int(rep.get("policy_updates") or 0)
                if rep.get("x") is None or after <= updates_of(self.pipeline.policy):
                    continue
                updates = logged_updates(rep)
                # the record's updates end at `after`: those past the policy's count are missing
                missing = min(len(updates), after - updates_of(self.pipeline.policy))
                for u in updates[len(updates) - missing:]:
                    self.pipeline.policy.update(int(u["arm_index"]), np.asarray(rep["x"], dtype=float),
                                                float(u["reward"]))
                    self.pipeline.costs.observe(int(u["arm_index"]), float(u["latency_s"]),
                                                float(u["mem_growth_mib"]))
                    done += 1
        return done

    def verify(self, query: str, answer: str, passages: list | None = None, label: str | None = None) -> Verification:
        """Algorithm 1 on an answer the caller produced: no generation. `passages`: the evidence
        the answer was built from (strings, or {"text", "title"?} objects); retrieved from the KB
        when not given. Fact verification: `label` is the verdict (SUPPORTS / REFUTES / NOT ENOUGH
        INFO); an `answer` that is itself a verdict is taken as the label, and the response judged
        is then the evidence sentence closest to the claim."""
        t0 = time.perf_counter()
        query = check_query(query, "claim" if self.task.fact_verification else "question")
        if not isinstance(answer, str):
            raise InputError(f"the answer must be a string, got {type(answer).__name__}")
        parsed = Label.parse(label) if label is not None else None
        if label is not None and parsed is None:
            raise InputError(f"label must be SUPPORTS, REFUTES or NOT ENOUGH INFO, got {label!r}")
        fv = self.task.fact_verification
        if fv and parsed is None and Label.parse(answer) is not None:
            parsed, answer = Label.parse(answer), ""
        pipe = self.pipeline
        with self._slots:
            if passages is None:
                found = pipe.retriever.retrieve(query, pipe.default.retrieval)
                texts = [evidence_text(p, pipe.default.evidence_titles) for p in found]
                refs = _refs(found)
            else:
                refs = _given_passages(passages)
                texts = [evidence_text(Passage(-1, r.doc_id, r.title, r.text, 0.0), pipe.default.evidence_titles)
                         for r in refs]
            retrieved = time.perf_counter()
            if fv and not answer.strip():
                answer = _closest_sentence(query, texts)
            diag = pipe.diagnoser.diagnose(query, texts, answer, parsed, fv)
        done = time.perf_counter()
        return Verification(query, answer, parsed, diag, refs,
                            {"retrieve": _ms(retrieved - t0), "diagnose": _ms(done - retrieved),
                             "total": _ms(done - t0)})


def _given_passages(passages) -> tuple[PassageRef, ...]:
    if not isinstance(passages, list) or not passages:
        raise InputError("passages must be a non-empty list of strings or {\"text\", \"title\"} objects "
                         "(leave it out to retrieve from the KB)")
    if len(passages) > 50:
        raise InputError(f"at most 50 passages, got {len(passages)}")
    out = []
    for i, p in enumerate(passages):
        if isinstance(p, str):
            p = {"text": p}
        if not isinstance(p, dict) or not isinstance(p.get("text"), str) or not p["text"].strip():
            raise InputError(f"passages[{i}] must be a non-empty string or an object with a non-empty "
                             f"\"text\" string")
        title = p.get("title", "")
        if not isinstance(title, str):
            raise InputError(f"passages[{i}].title must be a string")
        text = check_query(p["text"], f"passages[{i}].text")
        out.append(PassageRef(str(p.get("id", f"given-{i}")), title, None, text))
    return tuple(out)


def _closest_sentence(claim: str, texts: list[str]) -> str:
    from d2r_edge.generate.extractive import sentences

    sents = [s for t in texts for s in sentences(t)]
    return max(sents, key=lambda s: shared_words(s, claim)) if sents else ""
