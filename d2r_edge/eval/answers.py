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

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from d2r_edge.detector import Gate
from d2r_edge.errors import InputError
from d2r_edge.eval.context import (
    ACCEPT_METHODS,
    CHOSEN_ARM_METHODS,
    FIXED_ARMS,
    POLICY_METHODS,
    VOTE_METHODS,
    Context,
    EvalSettings,
    Method,
    PolicySpec,
    parse_methods,
)
from d2r_edge.eval.detection import DETECTOR_FILE, fit_detector
from d2r_edge.eval.method_cv import methods_cv
from d2r_edge.eval.methods import arm_flips, best_fixed_arm, labeled_fixed_arm, run_method, train_arm_table
from d2r_edge.eval.outcomes import AttemptStore, CachedGenerator
from d2r_edge.eval.querysets import EvalQuery, QuerySet, load_queryset
from d2r_edge.eval.report import write_report
from d2r_edge.eval.split import Split
from d2r_edge.generate.openai_compat import GeneratorError
from d2r_edge.jsonl import loads as json_line
from d2r_edge.repair import ARM_NAMES, ARMS
from d2r_edge.retrieval.retriever import Retriever
from d2r_edge.signals import Entailment
from d2r_edge.tasks import Task

# re-exported: the CLI and callers build settings and parse methods from here
__all__ = ["Context", "EvalQuery", "EvalSettings", "FIXED_ARMS", "Method", "POLICY_METHODS", "PolicySpec",
           "evaluate", "load_splits", "open_context", "parse_methods"]

# (query text, compute every allowed arm of a failing query?) pairs -> stored attempts; the caller
# picks where they run (this process by default, or engine.ray_eval.RayAttempts)
AttemptComputer = Callable[[object, EvalSettings, list[tuple[str, bool]], Context], None]

log = logging.getLogger(__name__)


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


def _load_each(paths, split: Split, limit: int, skip: frozenset[str], task: Task) -> list[QuerySet]:
    """At most `limit` queries from each file (files of different kinds, e.g. HotpotQA distractor and fullwiki)."""
    return [qs for path in paths for qs in _load((path,), split, limit, skip, task)]


def load_splits(s: EvalSettings) -> tuple[list[QuerySet], list[QuerySet]]:
    """Train and test query sets, disjoint: a file given for both skips the training ids in test."""
    if s.train_limit_per_file is not None:     # each file its own slice (files of different kinds)
        train = _load_each(s.train, s.split, s.train_limit_per_file, frozenset(), s.task)
    else:
        train = _load(s.train, s.split, s.train_limit, frozenset(), s.task)
    train_ids = frozenset(q.id for qs in train for q in qs.queries)
    if s.test_limit_per_file is not None:      # each file's next N after its training queries
        test = _load_each(s.test, s.split, s.test_limit_per_file, train_ids, s.task)
        return train, test
    limit = None if s.test_limit is None else s.test_limit + s.test_offset
    test = _load(s.test, s.split, limit, train_ids, s.task)
    skip, available = s.test_offset, sum(len(qs.queries) for qs in test)
    for qs in test:     # a later slice of the same files; a set left empty keeps its documents for the KB
        dropped = min(skip, len(qs.queries))
        qs.queries, skip = qs.queries[dropped:], skip - dropped
    if not any(qs.queries for qs in test):
        raise InputError(f"--test-offset {s.test_offset} leaves no test query ({available} after the training "
                         f"slice); give a smaller offset")
    overlap = train_ids & {q.id for qs in test for q in qs.queries}
    if overlap:
        raise InputError(f"train and test share {len(overlap)} query id(s), e.g. {sorted(overlap)[0]!r}")
    return train, test


FEVER_DEV = "fever/dev.jsonl"


def check_unseen_by_finetuning(s: EvalSettings) -> None:
    """Refuses test queries the models' fine-tuning may have seen: a test file that one of the
    manifest's fine-tuned roles trained on (same sha256) is tested on its held-out side only, unless
    the export left that file out (`d2r-edge export --finetune-exclude FILE`, recorded per role).
    FEVER's dev file is refused on any side by models that trained on part of it (exports before
    issue 50): its held-out claims share their evidence with the trained ones."""
    import hashlib

    path = Path(s.models) / "manifest.json"
    try:
        roles = json.loads(path.read_text(encoding="utf-8")).get("roles") or {}
    except (OSError, ValueError):
        return          # the pipeline's own manifest check reports an unreadable manifest
    trained: dict[str, tuple[str, str]] = {}       # sha256 -> (role, file) of a file a role trained on
    for role, entry in roles.items():
        training = (entry or {}).get("training") or {}
        left_out = set(((training.get("split") or {}).get("excluded_files") or {}).values())
        for name, digest in (training.get("data_files_sha256") or {}).items():
            if digest not in left_out:
                trained.setdefault(digest, (role, name))
    if not trained:
        return
    for test in s.test:
        digest = hashlib.sha256(Path(test).read_bytes()).hexdigest()
        if digest in trained and trained[digest][1] == FEVER_DEV:
            # models exported before issue 50: their held-out FEVER claims share evidence sentences
            # (the NLI's premises, with labels) with the claims they trained on
            role, name = trained[digest]
            raise InputError(f"the {role} model was fine-tuned on {name}'s claims, and FEVER writes several claims "
                             f"from the same evidence: its held-out claims are not unseen whatever --split says. "
                             f"Re-export the models (d2r-edge export --profile NAME), which leaves {name} out whole")
        if s.split is Split.HELDOUT:
            continue
        if digest in trained:
            role, name = trained[digest]
            raise InputError(f"test file {test} is {name}, which the {role} model was fine-tuned on (outside its "
                             f"held-out 20%): with --split {s.split.value} its test queries may have been seen. "
                             f"Use --split heldout, or export the models with --finetune-exclude {name}")


def kb_documents(s: EvalSettings, sets: list[QuerySet]) -> list:
    """Every document of the train and test files (+ --extra-docs), once each, in order."""
    from d2r_edge.retrieval.docs import read_documents

    docs, seen = [], set()
    for qs in sets:
        for d in qs.documents:
            if d.id not in seen:
                seen.add(d.id)
                docs.append(d)
    for path in s.extra_docs:
        for d in read_documents(path, known_ids=frozenset(seen)).documents:
            if d.id not in seen:
                seen.add(d.id)
                docs.append(d)
    return docs


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


def _form(run) -> str:
    return str(getattr(run.qa_hypothesis, "value", run.qa_hypothesis))


def fingerprint(s: EvalSettings, kb_input_sha256: str) -> dict:
    """What the stored attempts, policies and records depend on (the test slice may grow).

    The stored attempts name passages by chunk id in the KB, so the KB's input documents are
    part of it by content (`kb_input_sha256`), not only by file path: an input file edited in
    place would otherwise decode old attempts onto other passages."""
    from d2r_edge.onnx.manifest import sha256_file

    run = s.run
    manifest = s.models / "manifest.json"
    return {"task": s.task.value, "models_manifest_sha256": sha256_file(manifest) if manifest.is_file() else None,
            "variant": str(getattr(run.variant, "value", run.variant)), "generator": run.generator,
            "llm": run.model if run.generator == "openai" else None,
            "qa_hypothesis": _form(run),
            # a relative budget (latency_x) joins the list; an absolute one keeps the old fingerprint
            "budget": [run.budget.latency_s, run.budget.device_mem_mib]
                      + ([run.budget.latency_x] if run.budget.relative else []), "alpha": run.alpha, "seed": run.seed,
            "query_dim": run.query_dim, "epochs": s.epochs, "split": s.split.value,
            "train": [str(p) for p in s.train], "train_limit": s.train_limit,
            # (absent when unset or off: older folders keep their fingerprint)
            **({"train_limit_per_file": s.train_limit_per_file} if s.train_limit_per_file is not None else {}),
            **({"test_limit_per_file": s.test_limit_per_file} if s.test_limit_per_file is not None else {}),
            **({"self_consistency": [run.self_consistency, run.sample_temperature]}
               if getattr(run, "self_consistency", 0) else {}),
            **({"self_check_samples": True} if getattr(run, "self_check_samples", False) else {}),
            # which arms the methods may pick on UNVERIFIED answers (the records differ without the rule)
            **({"unverified_rule": False} if not getattr(run, "unverified_rule", True) else {}),
            "test": [str(p) for p in s.test], "test_offset": s.test_offset,
            "evidence_titles": run.evidence_titles, "arms": list(ARM_NAMES), "gate": run.gate.value,
            "extra_docs": [str(p) for p in s.extra_docs], "kb_input_sha256": kb_input_sha256,
            # the query files by content: an --out folder moved to another machine, its data under other
            # paths, resumes (the paths above may then differ, the contents may not)
            "files_sha256": {k: [sha256_file(Path(p)) if Path(p).is_file() else None for p in paths]
                             for k, paths in (("train", s.train), ("test", s.test), ("extra_docs", s.extra_docs))}}


# settings that name files: a folder moved with its data elsewhere may differ in these alone
_PATH_KEYS = ("train", "test", "extra_docs")


def _moved(have: dict, want: dict, diff: list[str]) -> bool:
    """Only the files' paths differ, and the files are the same (by content, or for a folder written
    before contents were recorded, by name: the KB digest already matched the documents)."""
    if not diff or any(k not in _PATH_KEYS and k != "files_sha256" for k in diff):
        return False
    if "files_sha256" in have:
        return have["files_sha256"] == want["files_sha256"]
    return all([Path(p).name for p in have.get(k) or []] == [Path(p).name for p in want.get(k) or []]
               for k in _PATH_KEYS)


def _only_arms_the_task_cannot_use(have: dict, want: dict, diff: list[str], task: Task) -> bool:
    """Only the arm list differs, by arms this task never runs (FEVER: reader_span, which answers questions):
    what the folder holds is what this version would compute (records name arms, never index them)."""
    if diff != ["arms"] or not isinstance(have.get("arms"), list):
        return False
    never = {a.name for a in ARMS if a.reader_answer and task.fact_verification}
    return [a for a in want["arms"] if a not in never] == [a for a in have["arms"] if a not in never]


def _check_out(s: EvalSettings, kb_input_sha256: str) -> None:
    s.out.mkdir(parents=True, exist_ok=True)
    path, want = s.out / "settings.json", fingerprint(s, kb_input_sha256)
    if path.is_file():
        try:
            have = json_line(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError):
            have = None
        if not isinstance(have, dict):
            raise InputError(f"{path} is damaged (not a JSON object), so what {s.out} holds cannot be matched to "
                             f"these settings; use another --out, or delete {s.out} to start over")
        stamp = s.out / "kb.input-sha256"
        if "kb_input_sha256" not in have and stamp.is_file():
            # written before the digest was part of the settings: the KB's own stamp says it
            have["kb_input_sha256"] = stamp.read_bytes().decode("utf-8", "replace").strip()
        have.setdefault("gate", "paper")     # written before the gate could be chosen
        if have.get("kb_input_sha256") != kb_input_sha256:
            raise InputError(f"{s.out} holds attempts computed on other documents: a --train, --test or "
                             f"--extra-docs file changed since (the stored passages would be decoded against "
                             f"a different knowledge base); use another --out, or delete {s.out} to start over")
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        if _moved(have, want, diff):
            log.info("%s: the query files are the same under other paths (a moved folder); resuming", s.out)
            path.write_text(json.dumps(want, indent=1) + "\n", encoding="utf-8")
        elif _only_arms_the_task_cannot_use(have, want, diff, s.task):
            log.info("%s: written before the arms %s existed, which this task never uses; resuming", s.out,
                     ", ".join(sorted(set(want["arms"]) - set(have["arms"]))))
            path.write_text(json.dumps(want, indent=1) + "\n", encoding="utf-8")
        elif diff:
            raise InputError(f"{s.out} holds an evaluation with other settings ({', '.join(diff)} differ); "
                             f"use another --out, or delete {s.out} to start over")
    else:
        path.write_text(json.dumps(want, indent=1) + "\n", encoding="utf-8")


def shared_pipeline(run, out: Path, generation_cache: Path | None, read_only: bool = False):
    """The pipeline every method runs through: memo retriever, cached generator, stored attempts,
    no refresh source. `read_only`: a Ray worker's, which reads the driver's files and writes nothing."""
    from d2r_edge.app import build_pipeline

    p = build_pipeline(run)
    p.retriever = _MemoRetriever(p.retriever.kb, p.retriever.embedder, p.retriever.reranker)
    gen = CachedGenerator(p.generator, generation_cache or out / "generations.jsonl", read_only)
    p.generator, p.refresh = gen, None
    store = AttemptStore(out / "attempts.jsonl", p.retriever.kb.chunks, read_only)
    p.memo = store
    return p, store, gen


def compute_outcomes(p, text: str, every_arm: bool) -> str | None:
    """The first attempt of a query and, if it fails and `every_arm`, every allowed arm (into p.memo).

    Returns None, or the error of a generator that failed one of them after its retries (a
    timeout, a server error): the evaluation then leaves the query out and goes on, and a rerun
    computes what is missing (the attempts that did succeed are stored)."""
    try:
        first = p.metered_attempt(text, p.default, metered=False)[0]
        if not every_arm or not p.repairs(first):
            return None
        for arm in np.flatnonzero(p.allowed(first.diagnosis)):
            p.metered_attempt(text, ARMS[int(arm)].apply(p.default), first=first)
    except GeneratorError as exc:
        if exc.client_error:          # would meet every query: stop here
            raise
        log.warning("generator failure, the query is left out of this evaluation (a rerun retries it): %r: %s",
                    text[:80], exc)
        return f"{type(exc).__name__}: {exc}"
    return None


def compute_locally(run, s: EvalSettings, todo: list[tuple[str, bool]], ctx: Context) -> None:
    """The default AttemptComputer: every (query, every arm?) in this process, into the store."""
    from tqdm import tqdm

    for text, all_arms in tqdm(todo, desc="first attempts + every allowed arm of failing queries", disable=None):
        if text in ctx.failed:
            continue
        error = compute_outcomes(ctx.pipeline, text, all_arms)
        if error is not None:
            ctx.failed[text] = error


def open_context(s: EvalSettings, attempts: AttemptComputer | None = None) -> Context:
    """Queries, KB, the shared pipeline and every attempt the methods will read. `attempts`
    computes them elsewhere (a Ray pool, chosen by the caller); it then also computes every
    test query's arms, so no method's test pass computes anything here."""
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase

    check_unseen_by_finetuning(s)
    train_sets, test_sets = load_splits(s)
    docs = kb_documents(s, train_sets + test_sets)
    _check_out(s, KnowledgeBase.input_digest(docs))
    run = replace(s.run, task=s.task, kb=s.out / "kb", models=s.models)
    embedder = Embedder(load_manifest(s.models), variant=run.variant, allow_random_weights=run.allow_random_weights)
    kb = KnowledgeBase.cached(docs, s.out, embedder)
    p, store, gen = shared_pipeline(run, s.out, s.generation_cache)
    ctx = Context(s, p, store, gen, [q for qs in train_sets for q in qs.queries],
                  [q for qs in test_sets for q in qs.queries], kb.stats(),
                  {q.id: str(qs.path) for qs in train_sets for q in qs.queries},
                  {q.id: str(qs.path) for qs in test_sets for q in qs.queries})
    compute = attempts or compute_locally
    with ctx.phase("outcomes: first attempts, every allowed arm where the methods need it"):
        if run.gate is Gate.CALIBRATED:
            # the gate decides which queries are repaired, so the detector comes first: fitted on the
            # training queries' first attempts, saved, and handed to the workers by file
            compute(run, s, [(q.text, False) for q in ctx.train], ctx)
            ctx.drop_failed()
            p.detector = fit_detector(ctx)
            if p.detector is None:
                raise InputError("--gate calibrated: the training queries cannot fit a detector (see the warning "
                                 "above); give more --train queries or use --gate paper")
            run = replace(run, detector_path=s.out / DETECTOR_FILE)
        # every allowed arm of a failing query: on the test queries for the oracle and the arm
        # table, on the training queries for best_fixed; the policies pick among the same outcomes.
        every_arm = {q.id for q in ctx.test} if Method.ORACLE in s.methods or attempts is not None else set()
        if set(CHOSEN_ARM_METHODS) & set(s.methods) or set(ACCEPT_METHODS) & set(s.methods) \
                or set(VOTE_METHODS) & set(s.methods) \
                or s.methods_cv_folds:
            # best_fixed's choice, the accept/revert comparator's training pairs, the vote's arm latencies, the
            # methods' training CV (each fold's choices read them)
            every_arm |= {q.id for q in ctx.train}
        todo = [(q.text, q.id in every_arm) for q in ctx.train + ctx.test]
        compute(run, s, todo, ctx)
    ctx.drop_failed()
    _some_test_left(ctx)
    if p.detector is None:
        # Alg. 1's gate: the detector only scores (p_wrong in the records, its detection row)
        p.detector = fit_detector(ctx)
    log.info("outcomes: %d stored attempts (%d generator calls, %d served from cache)",
             len(store), gen.calls, gen.hits)
    return ctx


def evaluate(s: EvalSettings, attempts: AttemptComputer | None = None) -> dict:
    """Every method on the test queries, then report.md / summary.json / figures under `s.out`.
    `attempts`: where the attempts are computed (default: this process)."""
    ctx = open_context(s, attempts)
    try:
        records = {}
        for m in s.methods:
            with ctx.phase(f"method {m.value}"):
                records[m.value] = run_method(ctx, m)
        # a query one method could not finish (its repair's generation failed) is left out of all
        late = {q.id for q in ctx.test if q.text in ctx.failed}
        ctx.drop_failed()
        records = {m: [r for r in recs if r["id"] not in late] for m, recs in records.items()}
        _some_test_left(ctx)
        run = ctx.settings.run
        gen = ("extractive (NLI labels, extracted sentences)" if run.generator == "extractive"
               else f"{run.model} at {run.base_url}")
        extra = {"generator": gen, "models": str(s.models), "split": s.split.value,
                 "budget": ctx.pipeline.budget.describe(),
                 "train_files": [str(p) for p in s.train], "test_files": [str(p) for p in s.test],
                 "kb": ctx.kb_stats, "stored_attempts": len(ctx.store),
                 "generator_calls": ctx.generator.calls, "generator_cache_hits": ctx.generator.hits,
                 "generator_cache_hits_old_key": ctx.generator.legacy_hits,
                 "generator_cache_old_key_checked": ctx.generator.legacy_ok,
                 "generator_served_model": ctx.generator.served,
                 "unavailable_arms": dict(ctx.pipeline.arms.unavailable),
                 "generator_failures": _failures(ctx), "phases": ctx.phases,
                 "answers_per_query": _answers_per_query(ctx)}
        if Method.BEST_FIXED in s.methods:
            extra["best_fixed_arm"] = ARM_NAMES[best_fixed_arm(ctx)]
        if {Method.BEST_FIXED, Method.BEST_FIXED_LABELED} & set(s.methods):
            flips = arm_flips(ctx, ctx.train)
            extra["arms_on_train"] = train_arm_table(ctx, flips)
        if Method.BEST_FIXED_LABELED in s.methods:
            extra["best_fixed_labeled_arm"] = ARM_NAMES[labeled_fixed_arm(ctx, flips)]
            extra["arm_flips_on_train"] = {a: {"fixed": t["fixed"], "broken": t["broken"]}
                                           for a, t in extra["arms_on_train"].items() if t["fixed"] + t["broken"]}
        if s.methods_cv_folds:
            with ctx.phase("methods' training cross-validation"):
                extra["methods_train_cv"] = methods_cv(ctx, s.methods, s.methods_cv_folds)
        if not s.task.fact_verification:
            extra["qa_hypothesis"] = _form(run)
            extra["hypothesis_forms_on_train"] = hypothesis_forms(ctx)
        return write_report(ctx, records, extra)
    finally:
        ctx.store.close()
        ctx.generator.close()


def _answers_per_query(ctx: Context) -> dict:
    """Stored attempts per query (train + test; each one generator answer, but the voting arm's, plus N
    samples on a first attempt), and what this invocation generated."""
    n = len(ctx.train) + len(ctx.test)
    return {"stored_attempts_per_query": len(ctx.store) / n if n else None,
            "self_consistency_samples_per_first_answer": getattr(ctx.settings.run, "self_consistency", 0),
            "new_answers_this_run": ctx.generator.added, "server_requests_this_run": ctx.generator.requests}


def _some_test_left(ctx: Context) -> None:
    if not ctx.test and ctx.left_out:
        first = next(r for r in ctx.left_out if r["split"] == "test")
        raise GeneratorError(f"every test query's generation failed ({sum(r['split'] == 'test' for r in ctx.left_out)}"
                             f" of them; the first: {first['error']}); nothing to evaluate - check the generator "
                             f"server, then rerun with the same --out (what succeeded is kept)")


def _failures(ctx: Context) -> dict:
    """The queries left out after a generator failure, by split (ids and errors, the first 50)."""
    rows = ctx.left_out
    return {"train": sum(r["split"] == "train" for r in rows), "test": sum(r["split"] == "test" for r in rows),
            "queries": rows[:50]}


def hypothesis_forms(ctx: Context) -> dict:
    """QA: how well each hypothesis form's e_r separates right from wrong first answers, on the
    training queries (never the test slice): entailed-if-right, entailed-if-wrong, balanced accuracy."""
    from d2r_edge.diagnose import aggregate_nli
    from d2r_edge.hypothesis import HypothesisForm, hypothesis
    from d2r_edge.retrieval.retriever import evidence_text

    nli = ctx.pipeline.diagnoser.nli
    labels = [Entailment(n.lower()) for n in nli.labels]
    counts = {f: [0, 0, 0, 0] for f in HypothesisForm}     # entailed&right, right, entailed&wrong, wrong
    for q in ctx.train:
        first = ctx.first(q)
        answer = first.generation.response
        if not first.passages or not answer.strip():
            continue
        right = ctx.score(q, answer)[0] == 1.0
        for form in HypothesisForm:
            hyp = hypothesis(form, q.text, answer)
            probs = nli.score([(evidence_text(p, ctx.pipeline.default.evidence_titles), hyp)
                               for p in first.passages])
            entailed = aggregate_nli([labels[int(i)] for i in probs.argmax(axis=1)]) is Entailment.ENTAILMENT
            c = counts[form]
            c[0 if right else 2] += entailed
            c[1 if right else 3] += 1
    out = {}
    for form, (er, r, ew, w) in counts.items():
        tpr, fpr = (er / r if r else None), (ew / w if w else None)
        out[form.value] = {"right": r, "wrong": w, "entailed_if_right": tpr, "entailed_if_wrong": fpr,
                           "balanced_accuracy": None if tpr is None or fpr is None else (tpr + 1 - fpr) / 2}
    return out
