"""What the answer evaluation's modules share: its methods, settings and the Context every
method reads outcomes from. `answers` (loading, outcomes, the run), `methods` and `report`
import this; it imports none of them."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

from d2r_edge.config import RewardConfig, RewardQuality
from d2r_edge.errors import InputError
from d2r_edge.eval.metrics import exact_match, fever_label, token_f1
from d2r_edge.eval.outcomes import AttemptStore, CachedGenerator
from d2r_edge.eval.querysets import EvalQuery
from d2r_edge.eval.split import Split
from d2r_edge.repair import ARMS
from d2r_edge.tasks import Task

__all__ = ["ACCEPT_METHODS", "CHOSEN_ARM_METHODS", "Context", "EvalQuery", "EvalSettings", "FIXED_ARMS", "Method",
           "POLICY_METHODS", "PolicySpec", "parse_methods"]


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
    LINUCB_DETECTOR = "linucb_detector"
    THOMPSON_DETECTOR = "thompson_detector"
    # accept or revert each repair with the comparator fitted on the training queries (d2r_edge.accept)
    BEST_FIXED_ACCEPT = "best_fixed_accept"
    # the single arm with the most training answers fixed net of those broken (gold labels, not Eq. 2's reward)
    BEST_FIXED_LABELED = "best_fixed_labeled"
    LINUCB_ACCEPT = "linucb_accept"
    THOMPSON_ACCEPT = "thompson_accept"
    # a P(right)-weighted vote of the k cheapest allowed arms that fit the budget, the first answer included
    VOTE_K2 = "vote_k2"
    VOTE_K3 = "vote_k3"


@dataclass(frozen=True)
class PolicySpec:
    kind: str
    reward: RewardConfig = RewardConfig()
    budget_factor: float = 1.0             # x the run's budget (paper: stringent 0.7, relaxed 1.5)
    accept: bool = False                   # accept or revert each repair (the comparator)


POLICY_METHODS = {
    Method.LINUCB: PolicySpec("linucb"),
    Method.THOMPSON: PolicySpec("thompson"),
    Method.LINUCB_UNWEIGHTED: PolicySpec("linucb", RewardConfig(cost_weighting=False)),
    Method.LINUCB_UNCONSTRAINED: PolicySpec("linucb", RewardConfig(gates=False)),
    Method.LINUCB_STRINGENT: PolicySpec("linucb", budget_factor=0.7),
    Method.LINUCB_RELAXED: PolicySpec("linucb", budget_factor=1.5),
    # the reward's quality from the calibrated detector (fitted on the training queries) instead of Alg. 1
    Method.LINUCB_DETECTOR: PolicySpec("linucb", RewardConfig(quality=RewardQuality.DETECTOR)),
    Method.THOMPSON_DETECTOR: PolicySpec("thompson", RewardConfig(quality=RewardQuality.DETECTOR)),
    Method.LINUCB_ACCEPT: PolicySpec("linucb", accept=True),
    Method.THOMPSON_ACCEPT: PolicySpec("thompson", accept=True),
}
ACCEPT_METHODS = (Method.BEST_FIXED_ACCEPT, Method.LINUCB_ACCEPT, Method.THOMPSON_ACCEPT)
VOTE_METHODS = {Method.VOTE_K2: 2, Method.VOTE_K3: 3}     # k arms per vote (d2r_edge.vote)
# what `--methods` means when left out: every method that needs nothing beyond the run's flags (the
# detector-reward policies need a detector the training queries can fit, the accept methods a comparator
# fitted on every allowed arm of the training queries, the votes a detector and those arms' latencies)
DEFAULT_METHODS = tuple(m for m in Method if m not in (Method.LINUCB_DETECTOR, Method.THOMPSON_DETECTOR,
                                                        Method.BEST_FIXED_LABELED, *ACCEPT_METHODS, *VOTE_METHODS))
# the methods that apply one arm chosen on the training queries' every-arm outcomes
CHOSEN_ARM_METHODS = (Method.BEST_FIXED, Method.BEST_FIXED_ACCEPT, Method.BEST_FIXED_LABELED)
FIXED_ARMS = {Method.PARAPHRASE: "prompt_paraphrase", Method.EXPANSION: "dense_k20"}


def parse_methods(text: str | None) -> tuple[Method, ...]:
    if not text:
        return DEFAULT_METHODS
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
    train_limit_per_file: int | None = None   # at most N from each --train file (instead of N in all)
    test_limit: int | None = None
    test_limit_per_file: int | None = None    # at most N from each --test file (after its training queries)
    test_offset: int = 0                   # skip the first N test queries (their documents stay in the KB)
    split: Split = Split.HELDOUT
    methods: tuple[Method, ...] = tuple(Method)
    extra_docs: tuple[Path, ...] = ()
    run: object = None                     # app.RunSettings template: generator, budgets, seed, models
    epochs: int = 2
    bootstrap_resamples: int = 10_000
    generation_cache: Path | None = None   # default OUT/generations.jsonl; share it between evaluations
    methods_cv_folds: int = 0              # >= 2: the methods' K-fold training CV (eval.method_cv); 0: off

    def __post_init__(self) -> None:
        if not self.train or not self.test:
            raise InputError("eval answers needs at least one --train and one --test file")
        if self.train_limit is not None and self.train_limit_per_file is not None:
            raise InputError("give --train-limit (queries in all) or --train-limit-per-file (from each file), "
                             "not both")
        if self.test_limit_per_file is not None and (self.test_limit is not None or self.test_offset):
            raise InputError("give --test-limit / --test-offset (queries in all) or --test-limit-per-file (from "
                             "each file), not both")
        for name in ("train_limit", "train_limit_per_file", "test_limit", "test_limit_per_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InputError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not isinstance(self.test_offset, int) or self.test_offset < 0:
            raise InputError(f"--test-offset must be an integer >= 0, got {self.test_offset!r}")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise InputError(f"--epochs must be an integer >= 1, got {self.epochs!r}")
        if not isinstance(self.bootstrap_resamples, int) or self.bootstrap_resamples < 100:
            raise InputError(f"--bootstrap must be an integer >= 100, got {self.bootstrap_resamples!r}")
        if not isinstance(self.methods_cv_folds, int) or self.methods_cv_folds < 0 or self.methods_cv_folds == 1:
            raise InputError(f"--methods-cv must be 0 (off) or an integer >= 2, got {self.methods_cv_folds!r}")
        if self.run is None:
            raise InputError("EvalSettings.run must be a RunSettings (generator, budgets, seed)")


class QueryFailed(Exception):
    """A method's pass over one query met a generator failure (a repair that could not be generated)."""


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
    train_files: dict[str, str] = field(default_factory=dict)    # query id -> the file it came from
    test_files: dict[str, str] = field(default_factory=dict)
    # query text -> the generator's error: one of its attempts failed after the client's retries.
    # Such a query is left out of every method (each compares the same queries) and recorded in
    # the summary; nothing of it is stored, so a rerun tries it again.
    failed: dict[str, str] = field(default_factory=dict)
    left_out: list[dict] = field(default_factory=list)           # {"split", "id", "error"} per query
    # what this invocation spent, per phase (outcomes, then each method): wall seconds and the new
    # generator answers / server requests (a sampled answer is 1 + N requests); a resumed run counts its own
    phases: dict[str, dict] = field(default_factory=dict)
    comparator: object = field(default=None, repr=False)    # the accept methods' (eval.methods.comparator)
    # a cross-validation over the training queries (eval.method_cv): its held-out queries are training
    # queries too, scored with their out-of-fold P(wrong)
    cv: bool = False

    @contextmanager
    def phase(self, name: str):
        """`with ctx.phase(name): ...` records the block's wall time and what the generator added in it."""
        t0, answers, requests = time.perf_counter(), self.generator.added, self.generator.requests
        yield
        self.phases[name] = {"wall_s": time.perf_counter() - t0, "answers_generated": self.generator.added - answers,
                             "server_requests": self.generator.requests - requests}

    def fail(self, text: str, exc: BaseException) -> None:
        self.failed.setdefault(text, f"{type(exc).__name__}: {exc}")

    def drop_failed(self) -> None:
        """Take the failed queries out of the training and test lists (noted in `left_out`)."""
        for split in ("train", "test"):
            keep = []
            for q in getattr(self, split):
                if q.text in self.failed:
                    self.left_out.append({"split": split, "id": q.id, "error": self.failed[q.text]})
                else:
                    keep.append(q)
            setattr(self, split, keep)

    def first(self, q: EvalQuery):
        return self.pipeline.metered_attempt(q.text, self.pipeline.default, metered=False)[0]

    def arm_outcome(self, q: EvalQuery, arm: int):
        return self.pipeline.metered_attempt(q.text, ARMS[arm].apply(self.pipeline.default))

    def fitted_on(self, q: EvalQuery) -> str | None:
        """The query's text where the detector was fitted on it (a cross-validation's held-out query), else None."""
        return q.text if self.cv else None

    def repairs(self, first, training_query: str | None = None) -> bool:
        """Whether the gate (Alg. 1's flags, or the calibrated detector) sends this first answer to repair.
        `training_query`: a training query's text (its out-of-fold P(wrong), Detector.assess)."""
        return self.pipeline.repairs(first, training_query)

    def allowed(self, first) -> np.ndarray:
        """The UNVERIFIED rule and the arms the loaded models can run (Pipeline.allowed)."""
        return self.pipeline.allowed(first.diagnosis)

    def gated_arm_outcomes(self, queries: list[EvalQuery], training: bool):
        """Each query the gate sends to repair, with each arm allowed for it: (query, first attempt, arm index,
        the arm's attempt, its cost). `training`: the queries are training ones (the gate reads their
        out-of-fold P(wrong))."""
        for q in queries:
            first = self.first(q)
            if not self.repairs(first, training_query=q.text if training else None):
                continue
            for arm in np.flatnonzero(self.allowed(first)):
                attempt, cost = self.arm_outcome(q, int(arm))
                yield q, first, int(arm), attempt, cost

    def answer(self, attempt) -> str:
        return self.pipeline.answer(attempt)

    def score(self, q: EvalQuery, answer: str) -> tuple[float, float]:
        """(correct, F1): FEVER 3-way label match twice, QA SQuAD EM and token F1."""
        if self.settings.task.fact_verification:
            ok = float(fever_label(answer) == fever_label(q.label))
            return ok, ok
        return exact_match(answer, q.answers), token_f1(answer, q.answers)
