"""`d2r-edge eval answers`: does diagnose-and-repair make answers better than plain RAG?

Every method runs on the same test queries with the same generator (the rows of
the paper's Table 1). The work is shared: first attempts and every arm's outcome
on a failing query live in one `AttemptStore`, so each method is a choice among
outcomes computed once, and the policies are trained (Alg. 2) and run through the
real `Pipeline` with that store as its memo. All of it lives under `--out` and a
rerun resumes: stored attempts, generator answers and per-method records are
reused, nothing finished is redone.

Refresh arms: an evaluation has no stream of new documents, so the refresh arms
equal their non-refresh twins (the pipeline's effective config drops `refresh`)
and are computed once; the report says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

import numpy as np

from d2r_edge.config import BUDGET_PRESETS, Budget, RewardConfig
from d2r_edge.errors import InputError
from d2r_edge.eval.metrics import exact_match, fever_label, token_f1
from d2r_edge.eval.outcomes import AttemptStore, CachedGenerator
from d2r_edge.eval.querysets import EvalQuery, QuerySet, load_queryset
from d2r_edge.eval.split import Split
from d2r_edge.repair import ARM_NAMES, ARMS, allowed_arms
from d2r_edge.retrieval.retriever import Retriever
from d2r_edge.runner import RecordLog
from d2r_edge.signals import Entailment, FailureType
from d2r_edge.tasks import Task

log = logging.getLogger(__name__)


class Method(str, Enum):
    NAIVE = "naive"
    PARAPHRASE = "paraphrase"
    EXPANSION = "expansion"
    BEST_FIXED = "best_fixed"
    LINUCB = "linucb"
    THOMPSON = "thompson"
    ORACLE = "oracle"
    LINUCB_UNWEIGHTED = "linucb_unweighted"
    LINUCB_UNCONSTRAINED = "linucb_unconstrained"
    LINUCB_STRINGENT = "linucb_stringent"
    LINUCB_RELAXED = "linucb_relaxed"


@dataclass(frozen=True)
class PolicySpec:
    kind: str
    reward: RewardConfig = RewardConfig()
    budget_preset: str | None = None       # None: the run's budget


POLICY_METHODS = {
    Method.LINUCB: PolicySpec("linucb"),
    Method.THOMPSON: PolicySpec("thompson"),
    Method.LINUCB_UNWEIGHTED: PolicySpec("linucb", RewardConfig(cost_weighting=False)),
    Method.LINUCB_UNCONSTRAINED: PolicySpec("linucb", RewardConfig(gates=False)),
    Method.LINUCB_STRINGENT: PolicySpec("linucb", budget_preset="stringent"),
    Method.LINUCB_RELAXED: PolicySpec("linucb", budget_preset="relaxed"),
}
FIXED_ARMS = {Method.PARAPHRASE: "prompt_paraphrase", Method.EXPANSION: "dense_k20"}


def parse_methods(text: str | None) -> tuple[Method, ...]:
    if not text:
        return tuple(Method)
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        try:
            out.append(Method(name))
        except ValueError:
            raise InputError(f"unknown method {name!r}; choose from {', '.join(m.value for m in Method)}") from None
    if not out:
        raise InputError("--methods is empty; give a comma-separated list or leave it out for all")
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class EvalSettings:
    task: Task
    train: tuple[Path, ...]
    test: tuple[Path, ...]
    models: Path
    out: Path
    train_limit: int | None = None
    test_limit: int | None = None
    split: Split = Split.HELDOUT
    methods: tuple[Method, ...] = tuple(Method)
    extra_docs: tuple[Path, ...] = ()
    run: object = None                     # app.RunSettings template: generator, budgets, seed, models
    epochs: int = 2
    bootstrap_resamples: int = 10_000


# --- queries and the knowledge base ---------------------------------------------------

def _load(paths, split: Split, limit: int | None, skip: frozenset[str], task: Task) -> list[QuerySet]:
    sets, left = [], limit
    for path in paths:
        if left is not None and left <= 0:
            break
        qs = load_queryset(path, split, left, skip)
        if qs.layout.is_fever != task.fact_verification:
            raise InputError(f"{path} is a {qs.layout.value} file but --task is {task.value}; "
                             f"use FEVER files with --task fever and QA files with --task qa")
        sets.append(qs)
        if left is not None:
            left -= len(qs.queries)
    return sets


def load_splits(s: EvalSettings) -> tuple[list[QuerySet], list[QuerySet]]:
    """Train and test query sets, disjoint: a file given for both skips the training ids in test."""
    train = _load(s.train, s.split, s.train_limit, frozenset(), s.task)
    train_ids = frozenset(q.id for qs in train for q in qs.queries)
    test = _load(s.test, s.split, s.test_limit, train_ids, s.task)
    overlap = train_ids & {q.id for qs in test for q in qs.queries}
    if overlap:
        raise InputError(f"train and test share {len(overlap)} query id(s), e.g. {sorted(overlap)[0]!r}")
    return train, test


def build_kb(s: EvalSettings, sets: list[QuerySet], embedder):
    """The KB of every document of the train and test files (+ --extra-docs), cached under --out."""
    from d2r_edge.retrieval.docs import read_documents
    from d2r_edge.retrieval.kb import KnowledgeBase

    docs, seen = [], set()
    for qs in sets:
        for d in qs.documents:
            if d.id not in seen:
                seen.add(d.id)
                docs.append({"id": d.id, "title": d.title, "text": d.text})
    for path in s.extra_docs:
        for d in read_documents(path, known_ids=frozenset(seen)).documents:
            if d.id not in seen:
                seen.add(d.id)
                docs.append({"id": d.id, "title": d.title, "text": d.text})
    s.out.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    digest = hashlib.sha256(text.encode()).hexdigest()
    docs_path, stamp, kb_dir = s.out / "kb-docs.jsonl", s.out / "kb.input-sha256", s.out / "kb"
    if stamp.is_file() and stamp.read_text().strip() == digest and (kb_dir / "manifest.json").is_file():
        return KnowledgeBase.open(kb_dir, embedder)
    docs_path.write_text(text, encoding="utf-8")
    kb = KnowledgeBase.build(docs_path, kb_dir, embedder)
    stamp.write_text(digest + "\n")
    return kb


# --- the shared outcomes --------------------------------------------------------------

class _MemoRetriever(Retriever):
    """Query embeddings kept in memory: every method and epoch embeds the same queries."""

    def __init__(self, kb, embedder, reranker=None) -> None:
        super().__init__(kb, embedder, reranker)
        self._vecs: dict[str, np.ndarray] = {}

    def embed(self, query: str) -> np.ndarray:
        v = self._vecs.get(query)
        if v is None:
            v = self._vecs[query] = super().embed(query)
        return v


@dataclass
class Context:
    """What the methods share: the base pipeline (memo, cached generator) and the queries."""

    settings: EvalSettings
    pipeline: object
    store: AttemptStore
    generator: CachedGenerator
    train: list[EvalQuery]
    test: list[EvalQuery]
    kb_stats: dict = field(default_factory=dict)

    def first(self, q: EvalQuery):
        return self.pipeline.metered_attempt(q.text, self.pipeline.default, metered=False)[0]

    def arm_outcome(self, q: EvalQuery, arm: int):
        return self.pipeline.metered_attempt(q.text, ARMS[arm].apply(self.pipeline.default))

    def allowed(self, first) -> np.ndarray:
        return allowed_arms(first.diagnosis.unverified, self.settings.task.restrict_unverified)

    def answer(self, attempt) -> str:
        return self.pipeline.answer(attempt)

    def score(self, q: EvalQuery, answer: str) -> tuple[float, float]:
        """(correct, F1): FEVER 3-way label match twice, QA SQuAD EM and token F1."""
        if self.settings.task.fact_verification:
            ok = float(fever_label(answer) == fever_label(q.label))
            return ok, ok
        return exact_match(answer, q.answers), token_f1(answer, q.answers)


def open_context(s: EvalSettings) -> Context:
    from tqdm import tqdm

    from d2r_edge.app import build_pipeline

    train_sets, test_sets = load_splits(s)
    run = replace(s.run, task=s.task, kb=s.out / "kb", models=s.models)
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest

    embedder = Embedder(load_manifest(s.models), variant=run.variant, allow_random_weights=run.allow_random_weights)
    kb = build_kb(s, train_sets + test_sets, embedder)
    p = build_pipeline(run)
    p.retriever = _MemoRetriever(p.retriever.kb, p.retriever.embedder, p.retriever.reranker)
    gen = CachedGenerator(p.generator, s.out / "generations.jsonl")
    p.generator, p.refresh = gen, None
    store = AttemptStore(s.out / "attempts.jsonl", p.retriever.kb.chunks)
    p.memo = store
    ctx = Context(s, p, store, gen, [q for qs in train_sets for q in qs.queries],
                  [q for qs in test_sets for q in qs.queries], kb.stats())
    todo = ctx.train + ctx.test
    for q in tqdm(todo, desc="first attempts + every allowed arm of failing queries", disable=None):
        first = ctx.first(q)
        if first.diagnosis.failure is FailureType.NO_FAILURE:
            continue
        for arm in np.flatnonzero(ctx.allowed(first)):
            ctx.arm_outcome(q, int(arm))
    log.info("outcomes: %d stored attempts (%d generator calls, %d served from cache)",
             len(store), gen.calls, gen.hits)
    return ctx


# --- the methods --------------------------------------------------------------------

def _record(ctx: Context, q: EvalQuery, method: Method, first, final, arm: int | None, cost,
            budget: Budget, extra: dict | None = None) -> dict:
    fa, la = ctx.answer(first), ctx.answer(final)
    c1, f1_first = ctx.score(q, fa)
    c2, f1_final = ctx.score(q, la)
    return {
        "id": q.id, "method": method.value, "first_failure": first.diagnosis.failure.value,
        "first_answer": fa, "final_answer": la, "first_correct": c1, "final_correct": c2,
        "first_f1": f1_first, "final_f1": f1_final,
        "final_entailed": final.diagnosis.e_r is Entailment.ENTAILMENT,
        "final_failure": final.diagnosis.failure.value,
        "arm": None if arm is None else ARM_NAMES[arm], "repaired": arm is not None,
        "latency_s": None if cost is None else cost.latency_s,
        "mem_growth_mib": None if cost is None else cost.mem_growth_mib,
        "memory_kind": None if cost is None else cost.memory_kind.value,
        "over_budget": None if cost is None else bool(cost.latency_s > budget.latency_s
                                                      or cost.mem_growth_mib > budget.device_mem_mib),
        "gold": q.label if ctx.settings.task.fact_verification else list(q.answers),
        "first_passages": [p.doc_id for p in first.passages],
        "gold_docs": sorted(q.gold_doc_ids), **(extra or {}),
    }


def _fixed(ctx: Context, q: EvalQuery, method: Method, arm: int) -> dict:
    first = ctx.first(q)
    if first.diagnosis.failure is FailureType.NO_FAILURE or not ctx.allowed(first)[arm]:
        # a baseline whose arm the UNVERIFIED rule forbids leaves the answer as it was
        return _record(ctx, q, method, first, first, None, None, ctx.pipeline.budget)
    final, cost = ctx.arm_outcome(q, arm)
    return _record(ctx, q, method, first, final, arm, cost, ctx.pipeline.budget)


def _oracle(ctx: Context, q: EvalQuery) -> dict:
    """Post-hoc: every allowed arm is tried and the best outcome counts; keeping the first
    answer is a candidate too, so the oracle bounds every fixed-arm method from above."""
    first = ctx.first(q)
    if first.diagnosis.failure is FailureType.NO_FAILURE:
        return _record(ctx, q, Method.ORACLE, first, first, None, None, ctx.pipeline.budget)
    best = (ctx.score(q, ctx.answer(first)), 1, 0.0)
    choice = (first, None, None)
    for arm in np.flatnonzero(ctx.allowed(first)):
        final, cost = ctx.arm_outcome(q, int(arm))
        key = (ctx.score(q, ctx.answer(final)), 0, -cost.latency_s)
        if key > best:
            best, choice = key, (final, int(arm), cost)
    return _record(ctx, q, Method.ORACLE, first, choice[0], choice[1], choice[2], ctx.pipeline.budget)


def arm_rewards(ctx: Context, queries: list[EvalQuery]) -> np.ndarray:
    """Mean Eq. 2 reward of each arm over the failing queries where it is allowed (nan: never)."""
    from d2r_edge.policy.reward import reward
    from d2r_edge.signals import KGStatus

    sums, counts = np.zeros(len(ARMS)), np.zeros(len(ARMS))
    p = ctx.pipeline
    for q in queries:
        first = ctx.first(q)
        if first.diagnosis.failure is FailureType.NO_FAILURE:
            continue
        for arm in np.flatnonzero(ctx.allowed(first)):
            a, cost = ctx.arm_outcome(q, int(arm))
            d = a.diagnosis
            sums[arm] += reward(no_failure=d.failure is FailureType.NO_FAILURE,
                                kg_consistent=d.kg is KGStatus.CONSISTENT,
                                nli_entailed=d.e_r is Entailment.ENTAILMENT, latency_s=cost.latency_s,
                                device_mem_mib=cost.mem_growth_mib, budget=p.budget, cfg=p.reward_cfg)
            counts[arm] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def best_fixed_arm(ctx: Context) -> int:
    """The single arm with the best mean reward on the training queries (Table 1's best fixed)."""
    r = arm_rewards(ctx, ctx.train)
    if np.all(np.isnan(r)):
        return ARM_NAMES.index(FIXED_ARMS[Method.EXPANSION])
    return int(np.nanargmax(r))


def policy_pipeline(ctx: Context, method: Method):
    """A pipeline for one policy method: its own policy, cost model, budget and reward config."""
    from d2r_edge.app import load_policy

    spec = POLICY_METHODS[method]
    base = ctx.pipeline
    budget = BUDGET_PRESETS[spec.budget_preset] if spec.budget_preset else base.budget
    run = replace(ctx.settings.run, policy_kind=spec.kind, policy_path=None)
    policy, costs = load_policy(run, base.context.dim)
    return replace(base, policy=policy, costs=costs, budget=budget, reward_cfg=spec.reward, explorer=None)


def train_policy(ctx: Context, method: Method):
    """Alg. 2 on the training queries (online, `epochs` passes), outcomes from the shared store."""
    p = policy_pipeline(ctx, method)
    for _ in range(ctx.settings.epochs):
        for q in ctx.train:
            p.run(q.text, learn=True)
    path = ctx.settings.out / "policies" / f"{method.value}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    p.policy.save(path)
    return p


def _policy_record(ctx: Context, p, q: EvalQuery, method: Method) -> dict:
    rec = p.run(q.text, learn=False)
    first = ctx.first(q)
    if rec["repair"] is None:
        return _record(ctx, q, method, first, first, None, None, p.budget)
    arm = int(rec["repair"]["arm_index"])
    final, cost = ctx.arm_outcome(q, arm)
    return _record(ctx, q, method, first, final, arm, cost, p.budget,
                   {"cost_masked": rec["repair"]["cost_masked"], "mask_fallback": rec["repair"]["mask_fallback"]})


def run_method(ctx: Context, method: Method) -> list[dict]:
    """The method's per-query records on the test queries (resumed from its JSONL file)."""
    path = ctx.settings.out / "methods" / f"{method.value}.jsonl"
    rlog = RecordLog(path)
    done = {r["id"] for r in rlog.records}
    todo = [q for q in ctx.test if q.id not in done]
    try:
        if todo:
            if method is Method.NAIVE:
                make = lambda q: _record(ctx, q, method, ctx.first(q), ctx.first(q), None, None,  # noqa: E731
                                         ctx.pipeline.budget)
            elif method in FIXED_ARMS or method is Method.BEST_FIXED:
                arm = (ARM_NAMES.index(FIXED_ARMS[method]) if method in FIXED_ARMS else best_fixed_arm(ctx))
                make = lambda q: _fixed(ctx, q, method, arm)  # noqa: E731
            elif method is Method.ORACLE:
                make = lambda q: _oracle(ctx, q)  # noqa: E731
            else:
                p = train_policy(ctx, method)
                make = lambda q: _policy_record(ctx, p, q, method)  # noqa: E731
            for q in ctx.test:
                if q.id not in done:
                    rlog.append(make(q))
                elif method in POLICY_METHODS:
                    # replayed, not recorded: a sampling policy's random state then reaches the
                    # remaining queries as in an uninterrupted run
                    make(q)
    finally:
        rlog.close()
    by_id = {r["id"]: r for r in rlog.records}
    return [by_id[q.id] for q in ctx.test]


def evaluate(s: EvalSettings) -> dict:
    """Every method on the test queries, then report.md / summary.json / figures under `s.out`."""
    from d2r_edge.eval.report import write_report

    ctx = open_context(s)
    try:
        records = {m.value: run_method(ctx, m) for m in s.methods}
        run = ctx.settings.run
        gen = (f"extractive (NLI labels, extracted sentences)" if run.generator == "extractive"
               else f"{run.model} at {run.base_url}")
        extra = {"generator": gen, "models": str(s.models), "split": s.split.value,
                 "budget": {"latency_s": ctx.pipeline.budget.latency_s,
                            "device_mem_mib": ctx.pipeline.budget.device_mem_mib},
                 "train_files": [str(p) for p in s.train], "test_files": [str(p) for p in s.test],
                 "kb": ctx.kb_stats, "stored_attempts": len(ctx.store),
                 "generator_calls": ctx.generator.calls, "generator_cache_hits": ctx.generator.hits}
        if Method.BEST_FIXED in s.methods:
            extra["best_fixed_arm"] = ARM_NAMES[best_fixed_arm(ctx)]
        return write_report(ctx, records, extra)
    finally:
        ctx.store.close()
        ctx.generator.close()
