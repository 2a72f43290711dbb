"""One query: retrieve -> generate -> diagnose -> (select -> repair -> diagnose -> reward)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np

import d2r_edge.deadline as deadline
from d2r_edge.accept import Comparator, Decision, Kept, delivered
from d2r_edge.budget import CostModel, Measurement, Meter
from d2r_edge.config import Budget, RewardConfig, RewardQuality
from d2r_edge.consistency import majority
from d2r_edge.detector import Detector, Gate, first_answer, record_signals
from d2r_edge.diagnose import Diagnoser, Diagnosis, Label
from d2r_edge.errors import RECOVERABLE, ConfigError
from d2r_edge.generate.base import Generation
from d2r_edge.policy import updates_of
from d2r_edge.policy.explore import Explorer
from d2r_edge.policy.features import ContextBuilder
from d2r_edge.policy.reward import reward
from d2r_edge.repair import (
    ARM_NAMES,
    ARMS,
    IS_RETRIEVAL,
    ArmAvailability,
    PipelineConfig,
    PromptStyle,
    allowed_arms,
)
from d2r_edge.retrieval.retriever import Passage, Retriever, evidence_text
from d2r_edge.selective import Certificate
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task
from d2r_edge.vote import cheapest_fitting, tally

log = logging.getLogger(__name__)


@dataclass
class Attempt:
    passages: list[Passage]
    generation: Generation
    diagnosis: Diagnosis
    timings_s: dict[str, float]

    def summary(self) -> dict:
        d = self.diagnosis
        return {"passages": [p.doc_id for p in self.passages], "label": d.label.value if d.label else None,
                "gated_label": d.gated_label.value if d.gated_label else None,
                "response": self.generation.response, "failure": d.failure.value, "e_q": d.e_q.value,
                "e_r": d.e_r.value, "kg": d.kg.value, "nli_q": d.passage_probs_q, "nli_r": d.passage_probs_r,
                **({"samples": list(self.generation.samples), "consistency": d.consistency}
                   if self.generation.samples else {}),
                **({"reader": {k: v for k, v in d.reader.items() if k != "seconds"}} if d.reader else {}),
                "timings_s": self.timings_s}


STAGES = ("embed_query_s", "refresh_s", "retrieve_s", "generate_s", "diagnose_s")


def stage_seconds(timings_s: dict) -> float:
    """The sum of an attempt's recorded stage times (an Attempt's `timings_s`, or a record's)."""
    return sum(timings_s.get(k, 0.0) for k in STAGES)


def attempt_seconds(a: "Attempt") -> float:
    """An attempt's recorded stage times: what a relative budget (Budget.latency_x) multiplies."""
    return stage_seconds(a.timings_s)


class AttemptMemo(Protocol):
    """Outcomes of (query, effective config) computed once and reused (`d2r-edge eval answers`)."""

    def get(self, query: str, cfg: PipelineConfig, metered: bool) -> tuple[Attempt, Measurement | None] | None:
        """The stored attempt; with `metered`, only one stored with its measured cost."""
        ...

    def put(self, query: str, cfg: PipelineConfig, attempt: Attempt, cost: Measurement | None) -> None:
        ...


@dataclass
class Pipeline:
    task: Task
    retriever: Retriever
    generator: object
    diagnoser: Diagnoser
    policy: object                              # LinUCB or ThompsonSampling
    context: ContextBuilder
    costs: CostModel
    meter: Meter
    budget: Budget = field(default_factory=Budget)
    reward_cfg: RewardConfig = field(default_factory=RewardConfig)
    explorer: Explorer | None = None
    refresh: Callable[[], int] | None = None    # the refresh arm's source; returns docs added
    default: PipelineConfig = field(default_factory=PipelineConfig)
    memo: AttemptMemo | None = None
    arms: ArmAvailability = field(default_factory=ArmAvailability)   # what the loaded models can run
    gate: Gate = Gate.PAPER
    detector: Detector | None = None            # P(wrong): recorded when loaded, gates with Gate.CALIBRATED
    comparator: Comparator | None = None        # accept or revert each repair (d2r_edge.accept); needs the detector
    unverified_rule: bool = True                # FEVER: an UNVERIFIED first answer gets retrieval arms only
    trust: Certificate | None = None            # trusted: the final answer's P(wrong) <= its certified threshold
    abstain_text: str | None = None             # set: an untrusted final answer becomes this stated abstention
    vote_k: int = 0                             # >= 2: repair by a P(right)-weighted vote of the k cheapest arms
    # an evaluation's cross-validation over its training queries (eval.method_cv): every query is one the
    # detector was fitted on, so each gets its out-of-fold P(wrong), frozen or learning
    out_of_fold_always: bool = False
    # `d2r-edge train` with a full-information policy (the best fixed arm): every allowed arm of a repaired
    # query is tried and each updates the policy (the record's repair lists them under `updates`)
    learn_every_arm: bool = False
    # the policy (select/update) and a refresh, when queries run in parallel threads
    state_lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.trust is not None and self.detector is None:
            raise ConfigError("a trust certificate (--trust FILE) thresholds the detector's P(wrong): give the "
                              "detector it was calibrated on too (--detector FILE)")
        if self.vote_k and (self.vote_k < 2 or self.detector is None):
            raise ConfigError(f"--vote K runs K >= 2 arms and weights each answer by the detector's P(right): give "
                              f"K >= 2 and --detector FILE (got K={self.vote_k!r}, detector "
                              f"{'loaded' if self.detector is not None else 'missing'})")
        if self.abstain_text is not None and self.trust is None:
            raise ConfigError("--abstain withholds untrusted answers: give the trust certificate that says which "
                              "are trusted (--trust FILE, from d2r-edge calibrate)")

    def assess(self, first: Attempt, training_query: str | None = None) -> tuple[bool, float | None, dict | None]:
        """(repair this first answer?, P(wrong), the signals behind it). `paper`: Alg. 1 named a
        failure; `calibrated`: P(wrong) >= the detector's threshold, whatever Alg. 1 said.
        `training_query`: the query, while a policy learns from it: a query the detector was fitted
        on gets its out-of-fold P(wrong) (Detector.assess), as a test query would."""
        if self.detector is None:
            if self.gate is Gate.CALIBRATED:
                raise ConfigError("the calibrated gate needs a fitted detector: give --detector FILE (train "
                                  "--gate calibrated writes one beside the policy), or use --gate paper")
            return first.diagnosis.failure is not FailureType.NO_FAILURE, None, None
        p, signals = self.detector.assess(first, self.task.fact_verification, training_query)
        if self.gate is Gate.CALIBRATED:
            return p >= self.detector.threshold, p, signals
        return first.diagnosis.failure is not FailureType.NO_FAILURE, p, signals

    def repaired_p_wrong(self, second: Attempt) -> float | None:
        """The detector's P(wrong) of a repaired answer where the reward reads it (RewardQuality.DETECTOR),
        else None. A repair is never a row the detector was fitted on, so no out-of-fold lookup."""
        if self.reward_cfg.quality is not RewardQuality.DETECTOR:
            return None
        self._check_reward_detector()
        return self.detector.assess(second, self.task.fact_verification)[0]

    def _check_reward_detector(self) -> None:
        if self.reward_cfg.quality is RewardQuality.DETECTOR and self.detector is None:
            raise ConfigError("the detector reward (--reward-quality detector) needs a fitted detector: give "
                              "--detector FILE (train --reward-quality detector writes one), or use "
                              "--reward-quality alg1")

    def accept_or_revert(self, first: Attempt, second: Attempt, arm: int, p_wrong_first: float | None,
                         training_query: str | None = None) -> Decision | None:
        """With a comparator: whether the repaired answer or the first one stands (d2r_edge.accept)."""
        if self.comparator is None:
            return None
        if self.detector is None:
            raise ConfigError("accept/revert (--accept FILE) compares the detector's P(wrong) of both answers: "
                              "give --detector FILE too (eval answers writes both)")
        fv = self.task.fact_verification
        if p_wrong_first is None:
            p_wrong_first = self.detector.assess(first, fv, training_query)[0]
        p_wrong_second = self.detector.assess(second, fv)[0]
        return self.comparator.decide(first, second, arm, p_wrong_first, p_wrong_second, fv)

    def _fitted_on(self, query: str, learn: bool) -> str | None:
        """The query as the detector's training query (its out-of-fold P(wrong)) while a policy learns from
        it, or always in an evaluation's training cross-validation; else None (the detector's own P(wrong))."""
        return query if learn or self.out_of_fold_always else None

    def repairs(self, first: Attempt, training_query: str | None = None) -> bool:
        return self.assess(first, training_query)[0]

    def allowed(self, first: Diagnosis) -> np.ndarray:
        """The arms that may repair this first answer: the UNVERIFIED rule and the loaded models."""
        return allowed_arms(first.unverified, self.task.restrict_unverified and self.unverified_rule, self.arms.mask)

    def effective(self, cfg: PipelineConfig) -> PipelineConfig:
        """`cfg` with what cannot change the outcome taken out: refresh without a refresh source,
        the prompt style for a generator that has no prompt. Equal effective configs give equal
        attempts, so an arm that is a duplicate of another here is computed once."""
        if cfg.refresh and self.refresh is None:
            cfg = replace(cfg, refresh=False)
        if not getattr(self.generator, "prompt_sensitive", True) and cfg.prompt is not PromptStyle.SIMPLE:
            cfg = replace(cfg, prompt=PromptStyle.SIMPLE)
        return cfg

    def metered_attempt(self, query: str, cfg: PipelineConfig, query_vec: np.ndarray | None = None,
                        metered: bool = True, first: Attempt | None = None) -> tuple[Attempt, Measurement | None]:
        """One attempt with its measured cost; from the memo when it has this (query, config).
        `first`: the query's first attempt, which a voting arm reads instead of computing it again."""
        cfg = self.effective(cfg)
        if self.memo is not None:
            hit = self.memo.get(query, cfg, metered)
            if hit is not None:
                return hit
        with self.meter.measure() as m:
            a = self.attempt(query, cfg, query_vec, first)
        # an unmetered attempt (a first pass) still notes its memory growth: the context's
        # remaining-memory feature reads it, as the remaining-latency feature reads its times
        a.timings_s["mem_growth_mib"] = m.result.mem_growth_mib
        cost = m.result if metered else None
        replayed = a.generation.replayed_s
        if replayed > 0:   # a cached generator answer: count the time the real call took
            a.timings_s["generate_s"] += replayed
            if cost is not None:
                cost = replace(cost, latency_s=cost.latency_s + replayed)
        if self.memo is not None:
            self.memo.put(query, cfg, a, cost)
        return a, cost

    def attempt(self, query: str, cfg: PipelineConfig, query_vec: np.ndarray | None = None,
                first: Attempt | None = None) -> Attempt:
        """Retrieve, generate, diagnose with `cfg`. Self-consistency samples are drawn for the default
        configuration's attempt only (the first, which the detector gates; a repair is never gated
        again); a voting config (`majority`) reads them from `first` (or the memo) and generates nothing."""
        if cfg.majority:
            return self._vote(query, cfg, query_vec, first)
        if cfg.reader_answer:
            return self._read(query, cfg, query_vec, first)
        t = {}
        t0 = time.perf_counter()
        if cfg.refresh and self.refresh is not None:
            with self.state_lock:
                t["refresh_docs"] = float(self.refresh())
        t["refresh_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        passages = self.retriever.retrieve(query, cfg.retrieval, query_vec)
        t["retrieve_s"] = time.perf_counter() - t0
        texts = [evidence_text(p, cfg.evidence_titles) for p in passages]
        t0 = time.perf_counter()
        first_config = cfg == self.effective(self.default)
        gen = self.generator.generate(self.task, cfg.prompt, query, texts, sample=first_config)
        if first_config and getattr(self.generator, "self_check", False):
            gen = self._self_check(query, texts, gen)
        t["generate_s"] = time.perf_counter() - t0
        if gen.samples:            # the self-consistency signal's share of generate_s (replayed or live)
            t["samples_s"] = gen.samples_s
        if gen.p_true_s:           # the self-check's share of generate_s
            t["p_true_s"] = gen.p_true_s
        return self._diagnosed(query, passages, texts, gen, t)

    def _self_check(self, query: str, texts: list[str], gen: Generation) -> Generation:
        """The first answer's P(True) from the same model (the detector's self_check signal, issue 53);
        a failed request loses the signal, not the answer. Its time (a cached one's original time) is
        part of the generation's."""
        if self.task.fact_verification:
            answer = gen.label.value if gen.label is not None else Label.NOT_ENOUGH_INFO.value
        else:
            answer = gen.response
        shown = (gen.samples or ()) if getattr(self.generator, "self_check_samples", False) else ()
        t0 = time.perf_counter()
        try:
            p, took_s = self.generator.p_true(self.task, query, texts, answer, *((tuple(shown),) if shown else ()))
        except RECOVERABLE as exc:
            log.warning("self-check of %r failed, P(True) missing: %s", query[:60], exc)
            return gen
        wall_s = time.perf_counter() - t0
        # a replayed self-check (the evaluation's cache) counts the time the real request took
        return replace(gen, p_true=p, p_true_s=took_s, replayed_s=gen.replayed_s + max(0.0, took_s - wall_s))

    def _diagnosed(self, query: str, passages: list[Passage], texts: list[str], gen: Generation,
                   t: dict[str, float], first: Attempt | None = None) -> Attempt:
        """The attempt of `gen` on `passages`, diagnosed (its time into `t`). `first`: the attempt whose
        passages these are; its reader's span is reused (the same query on the same passages), not read again."""
        t0 = time.perf_counter()
        extra = {"samples": gen.samples} if gen.samples else {}      # (stand-in diagnosers take none)
        if first is not None and first.diagnosis.reader is not None:
            extra["read"] = {**first.diagnosis.reader, "seconds": 0.0}
        diag = self.diagnoser.diagnose(query, texts, gen.response, gen.label, self.task.fact_verification, **extra)
        t["diagnose_s"] = time.perf_counter() - t0
        if diag.reader is not None:        # the reader's share of diagnose_s
            t["reader_s"] = float(diag.reader.get("seconds", 0.0))
        return Attempt(passages, gen, diag, t)

    def _vote(self, query: str, cfg: PipelineConfig, query_vec: np.ndarray | None, first: Attempt | None) -> Attempt:
        """The `sample_majority` arm: the first attempt's passages, answered with the majority of its
        greedy answer and samples (d2r_edge.consistency.majority), then diagnosed again. Without
        samples (a failed or uncached sampling) the answer is the first one, unchanged."""
        if first is None:        # an evaluation's memo holds it; a live run hands it over
            first = self.metered_attempt(query, replace(cfg, majority=False), query_vec, metered=False)[0]
        t = {"refresh_s": 0.0, "retrieve_s": 0.0}
        t0 = time.perf_counter()
        g, fv = first.generation, self.task.fact_verification
        greedy = first_answer(fv, first)
        nli = getattr(self.diagnoser, "nli", None)
        winner = majority(query, greedy, g.samples, fv, nli) if g.samples else greedy
        gen = Generation(response=g.response if fv else winner, label=Label.parse(winner) if fv else None,
                         raw=g.raw, logprobs=g.logprobs if winner == greedy else None, samples=g.samples)
        t["generate_s"] = time.perf_counter() - t0
        texts = [evidence_text(p, cfg.evidence_titles) for p in first.passages]
        return self._diagnosed(query, list(first.passages), texts, gen, t, first)

    def _read(self, query: str, cfg: PipelineConfig, query_vec: np.ndarray | None, first: Attempt | None) -> Attempt:
        """The `reader_span` arm (issue 53): the first attempt's passages, answered with the span the
        reader read there (its diagnosis holds it), then diagnosed again. Where the reader found no
        answer (its no-answer score won, or it read nothing) the answer is the first one, unchanged."""
        if first is None:
            first = self.metered_attempt(query, replace(cfg, reader_answer=False), query_vec, metered=False)[0]
        t = {"refresh_s": 0.0, "retrieve_s": 0.0}
        t0 = time.perf_counter()
        g, span = first.generation, first.diagnosis.reader
        text = span["text"] if span and not span["no_answer"] and span["text"] else None
        gen = g if text is None else Generation(response=text, label=None, raw=text)
        t["generate_s"] = time.perf_counter() - t0
        texts = [evidence_text(p, cfg.evidence_titles) for p in first.passages]
        return self._diagnosed(query, list(first.passages), texts, gen, t, first)

    def run(self, query: str, learn: bool, deadline_s: float | None = None,
            grader: Callable[[str], bool] | None = None) -> dict:
        """Answer one query with at most one repair (Alg. 2 l.6-15); returns the record."""
        return self.run_attempts(query, learn, deadline_s, grader)[0]

    def run_attempts(self, query: str, learn: bool, deadline_s: float | None = None,
                     grader: Callable[[str], bool] | None = None) -> tuple[dict, Attempt, Attempt]:
        """`run`'s record with the first and the final attempt (the same one when not repaired).

        `deadline_s`: the whole query's wall-clock limit (generator included). A repair is then
        attempted only with an arm whose predicted cost fits in what the first attempt left: the
        cost model's prediction, or for an arm it has not measured yet, the first attempt's own
        time (a repair is one more retrieve-generate-diagnose). Otherwise the first answer stands
        and `repair_skipped` says why. Everything the query waits on (the generator's calls, their
        retries) is cut to the deadline too (`d2r_edge.deadline`).

        `grader`: whether an answer is right by the query's gold (training on labeled queries); the label
        reward (RewardQuality.LABEL) scores each repair with it."""
        with deadline.scope(deadline_s):
            return self._run_attempts(query, learn, deadline_s, grader)

    def _run_attempts(self, query: str, learn: bool, deadline_s: float | None,
                      grader: Callable[[str], bool] | None = None) -> tuple[dict, Attempt, Attempt]:
        t_start = time.perf_counter()
        q_vec = self.retriever.embed(query)   # once: both attempts and the context vector use it
        embed_s = time.perf_counter() - t_start
        first, _ = self.metered_attempt(query, self.default, q_vec, metered=False)
        first.timings_s["embed_query_s"] = first.timings_s.get("embed_query_s", embed_s)
        rec = {"first": first.summary(), "failure": first.diagnosis.failure.value, "repair": None}
        t_gate = time.perf_counter()
        repair, p_wrong, signals = self.assess(first, self._fitted_on(query, learn))
        if self.trust is not None and not repair and not self.trust.trusted(p_wrong):
            repair = True           # an answer that would be withheld or marked untrusted gets its repair first
            rec["repair_reason"] = "untrusted"
        rec["gate"], rec["gate_s"] = self.gate.value, time.perf_counter() - t_gate
        if p_wrong is not None:   # missing signals (no log-probabilities) are recorded as null
            rec["p_wrong"] = p_wrong
            rec["detector_threshold"] = self.detector.threshold
            rec["detector_signals"] = record_signals(signals)
        final = first
        allowed = self.allowed(first.diagnosis)
        if repair and allowed.any() and deadline_s is not None:
            left_s = deadline_s - (time.perf_counter() - t_start)
            fits, cheapest_s = self.fits_deadline(allowed, left_s, first)
            if not fits.any():
                rec["repair_skipped"] = {"reason": "the deadline leaves no time for a repair",
                                         "deadline_s": deadline_s, "left_s": left_s,
                                         "cheapest_predicted_s": cheapest_s}
                repair = False
            allowed = fits
        if repair and not allowed.any():
            # no arm both allowed and runnable with the loaded models: the first answer stands
            rec["repair_skipped"] = {"reason": "no allowed arm can run with the loaded models",
                                     "unavailable": dict(self.arms.unavailable)}
        elif repair:
            # the first pass's recorded stage times, not the wall clock: a memoized first
            # attempt then builds the same context vector (remaining budget) as a live one
            spent_s = attempt_seconds(first)
            self._check_reward_detector()       # a missing detector is a setting, not one query's failure
            if self.reward_cfg.quality is RewardQuality.LABEL and grader is None:
                raise ConfigError("the label reward (--reward-quality label) scores a repair by the query's gold "
                                  "label or answer: only `train` on labeled queries can use it; use "
                                  "--reward-quality alg1 or detector here")
            t_repair = time.perf_counter()
            try:
                repair_fn = self._vote_repair if self.vote_k else self._repair
                rec["repair"], final = repair_fn(query, q_vec, first, allowed, learn, spent_s, p_wrong, grader)
            except RECOVERABLE as exc:
                # the repair pass failed (generator down, ...): the first answer stands, and says so
                log.warning("repair of %r failed, keeping the first answer: %s", query[:60], exc)
                rec["repair_error"] = f"{type(exc).__name__}: {exc}"
            # wall time; a replayed generation (eval's cache) counts the time the real call took,
            # as the attempt's generate_s does, so the stages still sum to the total
            rec["repair_s"] = time.perf_counter() - t_repair + (rec["repair"] or {}).get("replayed_s", 0.0)
        rec["final"] = final.summary()
        rec["final_answer"] = self.answer(final)
        rec["first_answer"] = self.answer(first)
        if self.trust is not None:
            self._judge(rec, first, final, p_wrong)
        kb = getattr(self.retriever, "kb", None)
        if kb is not None:   # which KB answered: its version on disk, and what a refresh added in memory
            rec["kb_version"], rec["kb_docs_added_in_memory"] = kb.version, kb.session_docs
        replayed_s = first.generation.replayed_s + (rec["repair"] or {}).get("replayed_s", 0.0)
        rec["total_s"] = time.perf_counter() - t_start + replayed_s
        return rec, first, final

    def _judge(self, rec: dict, first: Attempt, final: Attempt, p_wrong_first: float) -> None:
        """The final answer judged against the trust certificate (d2r_edge.selective); untrusted and
        `abstain_text` set: the answer is withheld as a stated abstention (FEVER: NOT ENOUGH INFO).
        The certificate covers first answers (what it was calibrated on); a repaired answer is judged
        by the same threshold, and the record says it is outside the certificate."""
        repaired = final is not first
        p = self.detector.assess(final, self.task.fact_verification)[0] if repaired else p_wrong_first
        trusted = self.trust.trusted(p)
        rec["trusted"] = trusted
        rec["trust"] = {"p_wrong": p, **self.trust.to_record(), "judged": "repaired" if repaired else "first",
                        "certified": not repaired}
        rec["abstained"] = bool(self.abstain_text is not None and not trusted)
        if rec["abstained"]:
            rec["answer_withheld"] = rec["final_answer"]
            rec["final_answer"] = Label.NOT_ENOUGH_INFO.value if self.task.fact_verification else self.abstain_text

    def fits_deadline(self, allowed: np.ndarray, left_s: float, first: Attempt) -> tuple[np.ndarray, float]:
        """(allowed arms predicted to finish within `left_s`, the cheapest prediction among them)."""
        predicted = self.predicted_s(first)
        cheapest = float(predicted[allowed].min()) if allowed.any() else float("inf")
        return allowed & (predicted <= left_s), cheapest

    def predicted_s(self, first: Attempt) -> np.ndarray:
        """Each arm's predicted latency: the cost model's, or for an arm it has not measured yet, the first
        attempt's own time (a repair is one more retrieve-generate-diagnose)."""
        own_s = sum(first.timings_s.get(k, 0.0) for k in STAGES if k != "embed_query_s")
        predicted = self.costs.predict()[:, 0]
        return np.where(np.isnan(predicted), own_s, predicted)

    def answer(self, a: Attempt) -> str:
        return delivered(a, self.task.fact_verification)

    def _vote_repair(self, query: str, q_vec: np.ndarray, first: Attempt, allowed: np.ndarray, learn: bool,
                     spent_s: float, p_wrong: float | None = None,
                     grader: Callable[[str], bool] | None = None) -> tuple[dict, Attempt]:
        """d2r_edge.vote: the k cheapest allowed arms that fit the budget answer again; the P(right)-weighted
        vote over them and the first answer decides. No policy is consulted or updated."""
        t0 = time.perf_counter()
        budget = self.budget.for_attempt(spent_s)
        masked = self.costs.mask(budget, allowed)
        predicted = self.predicted_s(first)
        # the vote is one repair action: its arms together stay within the action's budget
        arms = cheapest_fitting(masked.allowed, predicted, self.vote_k, budget.latency_s) or \
            cheapest_fitting(allowed, predicted, 1, float("inf"))
        select_s = time.perf_counter() - t0
        fv = self.task.fact_verification
        if p_wrong is None:
            p_wrong = self.detector.assess(first, fv, self._fitted_on(query, learn))[0]
        attempts, costs = [first], []
        for arm in arms:
            a, cost = self.metered_attempt(query, ARMS[arm].apply(self.default), q_vec, first=first)
            self.costs.observe(arm, cost.latency_s, cost.mem_growth_mib)
            attempts.append(a)
            costs.append(cost)
        weights = [1.0 - p_wrong] + [1.0 - self.detector.assess(a, fv)[0] for a in attempts[1:]]
        answers = [self.answer(a) for a in attempts]
        ballot = tally(query, answers, weights, fv, getattr(self.diagnoser, "nli", None))
        latency_s = sum(c.latency_s for c in costs)
        mem_mib = max(c.mem_growth_mib for c in costs)
        arm = arms[ballot.winner - 1] if ballot.winner else arms[0]
        kept = Kept.REPAIRED if ballot.winner else Kept.FIRST
        final = attempts[ballot.winner]
        return {
            "allowed": [ARM_NAMES[i] for i in np.flatnonzero(allowed)],
            "cost_masked": [ARM_NAMES[i] for i in np.flatnonzero(allowed & ~masked.allowed)],
            "mask_fallback": masked.fallback, "arm": ARM_NAMES[arm], "arm_index": arm,
            "propensity": None, "explored": False, "latency_s": latency_s, "mem_growth_mib": mem_mib,
            "memory_kind": costs[0].memory_kind.value, "memory_source": costs[0].memory_source.value,
            "over_budget": budget.exceeded_by(latency_s, mem_mib), "budget": self.budget.describe(spent_s),
            "reward": None, "reward_quality": None, "p_wrong_after": None, "x": None,
            "policy_s": select_s,
            "is_retrieval_arm": bool(IS_RETRIEVAL[arm]), "unavailable": dict(self.arms.unavailable),
            "policy_updates": None,
            "generate_s": sum(a.timings_s.get("generate_s", 0.0) for a in attempts[1:]),
            "replayed_s": sum(a.generation.replayed_s for a in attempts[1:]),
            "kept": kept.value, "accept": None,
            "vote": ballot.to_record(answers, [ARM_NAMES[a] for a in arms]),
        }, final

    def _repair(self, query: str, q_vec: np.ndarray, first: Attempt, allowed: np.ndarray, learn: bool,
                spent_s: float, p_wrong: float | None = None,
                grader: Callable[[str], bool] | None = None) -> tuple[dict, Attempt]:
        t0 = time.perf_counter()
        d = first.diagnosis
        budget = self.budget.for_attempt(spent_s)     # this query's: latency_x times its first attempt
        remaining_s = max(0.0, budget.latency_s - spent_s)
        remaining_mib = max(0.0, budget.device_mem_mib - first.timings_s.get("mem_growth_mib", 0.0))
        x = self.context.build(q_vec, d.failure, d.kg, d.e_q, d.e_r, remaining_s, remaining_mib, budget,
                               p_wrong=p_wrong)
        masked = self.costs.mask(budget, allowed)
        every = learn and self.learn_every_arm and getattr(self.policy, "full_information", False)
        with self.state_lock:
            if every:
                arm, propensity, explored = -1, None, False      # chosen below, once every arm has been seen
            elif self.explorer is not None and learn:
                decision = self.explorer.decide(self.policy, x, masked.allowed)
                arm, propensity, explored = decision.arm, decision.propensity, decision.explored
            else:
                # keyed by the query when frozen: the choice does not depend on query order or worker
                key = None if learn else query
                arm, propensity, explored = self.policy.select(x, masked.allowed, key=key), None, False
        policy_s = time.perf_counter() - t0
        tried = {a: self._try_arm(query, q_vec, first, a, budget, p_wrong, learn, grader)
                 for a in ([int(i) for i in np.flatnonzero(masked.allowed)] if every else [arm])}
        t1 = time.perf_counter()
        updates_after, logged = None, []
        if learn:
            with self.state_lock:
                for a, (_, cost_a, _, r_a, _) in tried.items():
                    self.policy.update(a, x, r_a)
                    logged.append({"arm_index": a, "reward": r_a, "latency_s": cost_a.latency_s,
                                   "mem_growth_mib": cost_a.mem_growth_mib})
                if every:
                    arm = self.policy.select(x, masked.allowed)
                # the policy's update count with these: a restart replays the logged updates
                # its last checkpoint lacks (Runtime.replay)
                updates_after = updates_of(self.policy)
        policy_s += time.perf_counter() - t1
        second, cost, decision, r, p_wrong_after = tried[arm]
        return {
            "allowed": [ARM_NAMES[i] for i in np.flatnonzero(allowed)],
            "cost_masked": [ARM_NAMES[i] for i in np.flatnonzero(allowed & ~masked.allowed)],
            "mask_fallback": masked.fallback, "arm": ARM_NAMES[arm], "arm_index": arm,
            "propensity": propensity, "explored": explored, "latency_s": cost.latency_s,
            "mem_growth_mib": cost.mem_growth_mib, "memory_kind": cost.memory_kind.value,
            "memory_source": cost.memory_source.value,
            "over_budget": budget.exceeded_by(cost.latency_s, cost.mem_growth_mib),
            "budget": self.budget.describe(spent_s),
            "reward": r, "reward_quality": self.reward_cfg.quality.value, "p_wrong_after": p_wrong_after,
            "x": x.tolist() if learn else None, "policy_s": policy_s,
            "is_retrieval_arm": bool(IS_RETRIEVAL[arm]), "unavailable": dict(self.arms.unavailable),
            "policy_updates": updates_after, "generate_s": second.timings_s.get("generate_s", 0.0),
            "replayed_s": second.generation.replayed_s,     # of generate_s, a cached answer's original time
            "kept": Kept.REPAIRED.value if decision is None else decision.kept.value,
            "accept": None if decision is None else decision.to_record(),
            **({"updates": logged} if every else {}),
        }, (first if decision is not None and decision.kept is Kept.FIRST else second)

    def _try_arm(self, query: str, q_vec: np.ndarray, first: Attempt, arm: int, budget: Budget,
                 p_wrong: float | None, learn: bool, grader: Callable[[str], bool] | None = None
                 ) -> tuple[Attempt, Measurement, Decision | None, float, float | None]:
        """One repair with `arm`: (its attempt, cost, the accept/revert decision, its Eq. 2 reward - 0 when
        reverted -, its P(wrong)); its cost is observed by the cost model."""
        second, cost = self.metered_attempt(query, ARMS[arm].apply(self.default), q_vec, first=first)
        d2 = second.diagnosis
        p_wrong_after = self.repaired_p_wrong(second)
        decision = self.accept_or_revert(first, second, arm, p_wrong, training_query=self._fitted_on(query, learn))
        r = reward(no_failure=d2.failure is FailureType.NO_FAILURE,
                   kg_consistent=d2.kg is KGStatus.CONSISTENT,
                   nli_entailed=d2.e_r is Entailment.ENTAILMENT,
                   latency_s=cost.latency_s, device_mem_mib=cost.mem_growth_mib,
                   budget=budget, cfg=self.reward_cfg, p_wrong=p_wrong_after,
                   right=(bool(grader(self.answer(second))) if grader is not None
                          and self.reward_cfg.quality is RewardQuality.LABEL else None))
        if decision is not None and decision.kept is Kept.FIRST:
            r = 0.0         # a reverted repair gave the user nothing
        self.costs.observe(arm, cost.latency_s, cost.mem_growth_mib)
        return second, cost, decision, r, p_wrong_after
