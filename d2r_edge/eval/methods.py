"""The methods of the answer evaluation, each a choice among the shared outcomes.

`naive` keeps the first answer; `paraphrase` / `expansion` / `best_fixed` apply one
arm to every failing query (where the UNVERIFIED rule allows it; `best_fixed` the arm of
the best mean Eq. 2 reward on the training queries, `best_fixed_labeled` the arm that
fixed the most training answers net of those it broke); the policy methods
are trained by Alg. 2 through the real pipeline and then frozen; `oracle` takes the
best outcome post hoc. The `*_accept` methods keep the repaired answer only where the
comparator fitted on the training queries trusts it more than the first
(d2r_edge.accept); their records say `kept` and why.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from d2r_edge.accept import Comparator, Kept, pair_features
from d2r_edge.config import Budget, RewardQuality
from d2r_edge.detector import record_signals
from d2r_edge.errors import InputError
from d2r_edge.eval.context import (CHOSEN_ARM_METHODS, FIXED_ARMS, POLICY_METHODS, VOTE_METHODS, Context, EvalQuery,
                                   Method, QueryFailed)
from d2r_edge.generate.openai_compat import GeneratorError
from d2r_edge.pipeline import attempt_seconds
from d2r_edge.repair import ARM_NAMES, ARMS
from d2r_edge.runner import RecordLog
from d2r_edge.signals import Entailment, FailureType
from d2r_edge.vote import cheapest_fitting, tally

log = logging.getLogger(__name__)


def _record(ctx: Context, q: EvalQuery, method: Method, first, final, arm: int | None, cost,
            budget: Budget, extra: dict | None = None) -> dict:
    fa, la = ctx.answer(first), ctx.answer(final)
    c1, f1_first = ctx.score(q, fa)
    c2, f1_final = ctx.score(q, la)
    _, p_wrong, signals = ctx.pipeline.assess(first, ctx.fitted_on(q))
    budget = budget.for_attempt(attempt_seconds(first))    # a relative budget: this query's bound
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
        "over_budget": None if cost is None else budget.exceeded_by(cost.latency_s, cost.mem_growth_mib),
        "budget_latency_s": budget.latency_s,       # this query's bound (relative budgets differ by query)
        "gold": q.label if ctx.settings.task.fact_verification else list(q.answers),
        "first_passages": [p.doc_id for p in first.passages],
        "gold_docs": sorted(q.gold_doc_ids), "p_wrong": p_wrong,
        "detector_signals": None if signals is None else record_signals(signals),
        **(extra or {}),
    }


def _fixed(ctx: Context, q: EvalQuery, method: Method, arm: int, accepting=None) -> dict:
    """`accepting`: the pipeline with the comparator (the *_accept methods), which keeps or reverts the repair."""
    first = ctx.first(q)
    if not ctx.repairs(first, ctx.fitted_on(q)) or not ctx.allowed(first)[arm]:
        # a baseline whose arm the UNVERIFIED rule forbids, or the loaded models cannot run,
        # leaves the answer as it was
        why = ctx.pipeline.arms.reason(arm)
        return _record(ctx, q, method, first, first, None, None, ctx.pipeline.budget,
                       {"arm_unavailable": {ARM_NAMES[arm]: why}} if why else None)
    final, cost = ctx.arm_outcome(q, arm)
    if accepting is None:
        return _record(ctx, q, method, first, final, arm, cost, ctx.pipeline.budget)
    decision = accepting.accept_or_revert(first, final, arm, None, training_query=ctx.fitted_on(q))
    kept = final if decision.kept is Kept.REPAIRED else first
    return _record(ctx, q, method, first, kept, arm, cost, ctx.pipeline.budget,
                   {"kept": decision.kept.value, "accept": decision.to_record()})


COMPARATOR_FILE = "comparator.json"


def comparator(ctx: Context) -> Comparator:
    """The accept/revert comparator, fitted once per evaluation and kept on the context."""
    if ctx.comparator is None:
        ctx.comparator = fit_comparator(ctx)
    return ctx.comparator


def fit_comparator(ctx: Context) -> Comparator:
    """The accept/revert comparator from the training queries: every allowed arm of each gated one, each
    repair that changed whether the answer was right a row (d2r_edge.accept); saved in --out."""
    p = ctx.pipeline
    if p.detector is None:
        raise InputError("the accept methods compare the detector's P(wrong) of both answers, and the training "
                         "queries could not fit a detector (see the warning above): give more --train queries")
    fv = ctx.settings.task.fact_verification
    rows, better = [], []
    for q in ctx.train:
        first = ctx.first(q)
        if not ctx.repairs(first, training_query=q.text):
            continue
        right_first = ctx.score(q, ctx.answer(first))[0] >= 1.0
        p_first = p.detector.assess(first, fv, q.text)[0]          # out of fold, as a test query's
        for arm in np.flatnonzero(ctx.allowed(first)):
            second, _ = ctx.arm_outcome(q, int(arm))
            right_second = ctx.score(q, ctx.answer(second))[0] >= 1.0
            if right_second != right_first:
                rows.append(pair_features(first, second, int(arm), p_first, p.detector.assess(second, fv)[0], fv))
                better.append(right_second)
    comp = Comparator.fit(rows, better, ctx.settings.task.value)
    comp.save(ctx.settings.out / COMPARATOR_FILE)
    log.info("accept/revert comparator: %d training pairs (%d fixes, %d breaks), threshold %.3f", len(rows),
             sum(better), len(better) - sum(better), comp.threshold)
    return comp


def _oracle(ctx: Context, q: EvalQuery) -> dict:
    """Post-hoc: every allowed arm is tried and the best outcome counts; keeping the first
    answer is a candidate too, so the oracle bounds every fixed-arm method from above."""
    first = ctx.first(q)
    if not ctx.repairs(first, ctx.fitted_on(q)):
        return _record(ctx, q, Method.ORACLE, first, first, None, None, ctx.pipeline.budget)
    best = (ctx.score(q, ctx.answer(first)), 1, 0.0)
    choice = (first, None, None)
    for arm in np.flatnonzero(ctx.allowed(first)):
        final, cost = ctx.arm_outcome(q, int(arm))
        key = (ctx.score(q, ctx.answer(final)), 0, -cost.latency_s)
        if key > best:
            best, choice = key, (final, int(arm), cost)
    return _record(ctx, q, Method.ORACLE, first, choice[0], choice[1], choice[2], ctx.pipeline.budget)


def arm_latencies(ctx: Context) -> np.ndarray:
    """Median measured latency of each arm over the gated training queries where it is allowed (nan:
    never): what the vote methods rank arms by, as a live cost model would after those repairs."""
    seen: list[list[float]] = [[] for _ in ARMS]
    for q in ctx.train:
        first = ctx.first(q)
        if not ctx.repairs(first, training_query=q.text):
            continue
        for arm in np.flatnonzero(ctx.allowed(first)):
            seen[arm].append(ctx.arm_outcome(q, int(arm))[1].latency_s)
    return np.array([np.median(v) if v else np.nan for v in seen])


def _vote(ctx: Context, q: EvalQuery, method: Method, arm_s: np.ndarray) -> dict:
    """d2r_edge.vote over the stored outcomes: the k cheapest allowed arms that fit this query's budget,
    weighted by 1 - the detector's P(wrong); the record's cost is the arms' summed latency."""
    p = ctx.pipeline
    first = ctx.first(q)
    if not ctx.repairs(first, ctx.fitted_on(q)):
        return _record(ctx, q, method, first, first, None, None, p.budget)
    fv = ctx.settings.task.fact_verification
    spent_s = attempt_seconds(first)
    predicted = np.where(np.isnan(arm_s), spent_s, arm_s)
    arms = cheapest_fitting(ctx.allowed(first), predicted, VOTE_METHODS[method], p.budget.for_attempt(spent_s).latency_s)
    if not arms:
        return _record(ctx, q, method, first, first, None, None, p.budget)
    outs = [ctx.arm_outcome(q, a) for a in arms]
    attempts = [first] + [a for a, _ in outs]
    weights = [1.0 - p.detector.assess(a, fv, ctx.fitted_on(q) if a is first else None)[0] for a in attempts]
    answers = [ctx.answer(a) for a in attempts]
    ballot = tally(q.text, answers, weights, fv, getattr(p.diagnoser, "nli", None))
    cost = replace(outs[0][1], latency_s=sum(c.latency_s for _, c in outs),
                   mem_growth_mib=max(c.mem_growth_mib for _, c in outs))
    arm = arms[ballot.winner - 1] if ballot.winner else arms[0]
    return _record(ctx, q, method, first, attempts[ballot.winner], arm, cost, p.budget,
                   {"kept": (Kept.REPAIRED if ballot.winner else Kept.FIRST).value,
                    "vote": ballot.to_record(answers, [ARM_NAMES[a] for a in arms])})


def arm_rewards(ctx: Context, queries: list[EvalQuery]) -> np.ndarray:
    """Mean Eq. 2 reward of each arm over the failing queries where it is allowed (nan: never)."""
    sums, counts = _arm_reward_sums(ctx, queries)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _arm_reward_sums(ctx: Context, queries: list[EvalQuery]) -> tuple[np.ndarray, np.ndarray]:
    """(sum of Eq. 2 rewards, gated queries where the arm is allowed) per arm."""
    from d2r_edge.policy.reward import reward
    from d2r_edge.signals import KGStatus

    sums, counts = np.zeros(len(ARMS)), np.zeros(len(ARMS))
    p = ctx.pipeline
    for _, first, arm, a, cost in ctx.gated_arm_outcomes(queries, training=True):
        d = a.diagnosis
        sums[arm] += reward(no_failure=d.failure is FailureType.NO_FAILURE,
                            kg_consistent=d.kg is KGStatus.CONSISTENT,
                            nli_entailed=d.e_r is Entailment.ENTAILMENT, latency_s=cost.latency_s,
                            device_mem_mib=cost.mem_growth_mib, budget=p.budget.for_attempt(attempt_seconds(first)),
                            cfg=p.reward_cfg, p_wrong=p.repaired_p_wrong(a))
        counts[arm] += 1
    return sums, counts


def train_arm_table(ctx: Context, flips: tuple[np.ndarray, np.ndarray]) -> dict[str, dict]:
    """What the fixed-arm methods choose from, per arm allowed on some gated training query: on how many
    (`n`), its mean Eq. 2 reward there (best_fixed's ranking) and the answers it fixed and broke by the
    gold labels (best_fixed_labeled's). An arm allowed on fewer queries (a prompt arm the UNVERIFIED
    rule keeps off) is ranked by its mean over those alone. `flips`: arm_flips(ctx, ctx.train)."""
    sums, counts = _arm_reward_sums(ctx, ctx.train)
    fixed, broken = flips
    return {ARM_NAMES[a]: {"n": int(counts[a]), "mean_reward": float(sums[a] / counts[a]),
                           "fixed": int(fixed[a]), "broken": int(broken[a])}
            for a in range(len(ARMS)) if counts[a]}


def best_fixed_arm(ctx: Context) -> int:
    """The single arm with the best mean reward on the training queries (Table 1's best fixed)."""
    r = arm_rewards(ctx, ctx.train)
    if np.all(np.isnan(r)):
        return ARM_NAMES.index(FIXED_ARMS[Method.EXPANSION])
    return int(np.nanargmax(r))


def arm_flips(ctx: Context, queries: list[EvalQuery]) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, broken) per arm over the gated queries where it is allowed: answers the arm turned from
    wrong to right and from right to wrong, by the gold labels (what eval answers scores methods by)."""
    fixed, broken = np.zeros(len(ARMS)), np.zeros(len(ARMS))
    for q, first, arm, a, _ in ctx.gated_arm_outcomes(queries, training=True):
        before, after = ctx.score(q, ctx.answer(first))[0], ctx.score(q, ctx.answer(a))[0]
        fixed[arm] += after > before
        broken[arm] += after < before
    return fixed, broken


def labeled_fixed_arm(ctx: Context, flips: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """The single arm with the most training answers fixed net of those broken (ties: fewer broken, then
    the lower index); Table 1's best fixed by outcome where Eq. 2's reward ranks by the NLI's entailment
    and latency (on HotpotQA the reward chose an arm that fixes nothing, docs/runs/qa-t1reader).
    `flips`: arm_flips(ctx, ctx.train) where the caller already has it."""
    fixed, broken = flips if flips is not None else arm_flips(ctx, ctx.train)
    if not (fixed + broken).any():
        return best_fixed_arm(ctx)
    return int(np.lexsort((np.arange(len(ARMS)), broken, -(fixed - broken)))[0])


def policy_pipeline(ctx: Context, method: Method):
    """A pipeline for one policy method: its own policy, cost model, budget and reward config."""
    from d2r_edge.app import load_policy

    spec = POLICY_METHODS[method]
    base = ctx.pipeline
    if spec.reward.quality is RewardQuality.DETECTOR and base.detector is None:
        raise InputError(f"--methods {method.value} rewards by the calibrated detector, which the training queries "
                         "could not fit (see the warning above): give more --train queries or leave it out")
    budget = base.budget.scaled(spec.budget_factor) if spec.budget_factor != 1.0 else base.budget
    run = replace(ctx.settings.run, policy_kind=spec.kind, policy_path=None)
    policy, costs = load_policy(run, base.context)
    return replace(base, policy=policy, costs=costs, budget=budget, reward_cfg=spec.reward, explorer=None,
                   comparator=comparator(ctx) if spec.accept else None, out_of_fold_always=ctx.cv)


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
    if rec.get("repair_error"):       # the chosen arm's generation failed: not "no repair"
        raise QueryFailed(rec["repair_error"])
    first = ctx.first(q)
    if rec["repair"] is None:
        return _record(ctx, q, method, first, first, None, None, p.budget)
    arm = int(rec["repair"]["arm_index"])
    final, cost = ctx.arm_outcome(q, arm)
    extra = {"cost_masked": rec["repair"]["cost_masked"], "mask_fallback": rec["repair"]["mask_fallback"]}
    if rec["repair"].get("accept") is not None:           # the comparator kept one of the two
        extra.update(kept=rec["repair"]["kept"], accept=rec["repair"]["accept"])
        final = final if rec["repair"]["kept"] == Kept.REPAIRED.value else first
    return _record(ctx, q, method, first, final, arm, cost, p.budget, extra)


_NUMBER = (int, float)
_OPTIONAL_NUMBER = (int, float, type(None))
# what the summary and report read from a method record, by type: a stored line without it is redone
_RECORD_FIELDS = {"id": str, "method": str, "first_failure": str, "final_failure": str, "first_answer": str,
                  "final_answer": str, "first_correct": _NUMBER, "final_correct": _NUMBER, "first_f1": _NUMBER,
                  "final_f1": _NUMBER, "final_entailed": bool, "repaired": bool, "arm": (str, type(None)),
                  "latency_s": _OPTIONAL_NUMBER, "mem_growth_mib": _OPTIONAL_NUMBER,
                  "memory_kind": (str, type(None)), "over_budget": (bool, type(None)), "gold": (str, list),
                  "first_passages": list, "gold_docs": list, "p_wrong": _OPTIONAL_NUMBER,
                  "detector_signals": (dict, type(None))}


def method_record_ok(method: Method):
    """A validator of stored method records (RecordLog `valid`)."""
    def ok(r: dict) -> bool:
        return (r.get("method") == method.value
                and all(k in r and isinstance(r[k], t) for k, t in _RECORD_FIELDS.items())
                and (r["arm"] is None or r["arm"] in ARM_NAMES) and r["repaired"] == (r["arm"] is not None)
                and isinstance(r.get("arm_unavailable") or {}, dict)
                and (method not in POLICY_METHODS or not r["repaired"]
                     or (isinstance(r.get("cost_masked"), list) and isinstance(r.get("mask_fallback"), bool))))
    return ok


def run_method(ctx: Context, method: Method) -> list[dict]:
    """The method's per-query records on the test queries (resumed from its JSONL file)."""
    path = ctx.settings.out / "methods" / f"{method.value}.jsonl"
    rlog = RecordLog(path, valid=method_record_ok(method))
    done = {r["id"] for r in rlog.records}
    todo = [q for q in ctx.test if q.id not in done]
    try:
        if todo:
            if method is Method.NAIVE:
                make = lambda q: _record(ctx, q, method, ctx.first(q), ctx.first(q), None, None,  # noqa: E731
                                         ctx.pipeline.budget)
            elif method in FIXED_ARMS or method in CHOSEN_ARM_METHODS:
                arm = (ARM_NAMES.index(FIXED_ARMS[method]) if method in FIXED_ARMS
                       else labeled_fixed_arm(ctx) if method is Method.BEST_FIXED_LABELED else best_fixed_arm(ctx))
                accepting = (replace(ctx.pipeline, comparator=comparator(ctx))
                             if method is Method.BEST_FIXED_ACCEPT else None)
                make = lambda q: _fixed(ctx, q, method, arm, accepting)  # noqa: E731
            elif method is Method.ORACLE:
                make = lambda q: _oracle(ctx, q)  # noqa: E731
            elif method in VOTE_METHODS:
                if ctx.pipeline.detector is None:
                    raise InputError(f"--methods {method.value} weights each answer by the detector's P(right), and "
                                     "the training queries could not fit a detector (see the warning above): give "
                                     "more --train queries or leave it out")
                arm_s = arm_latencies(ctx)
                make = lambda q: _vote(ctx, q, method, arm_s)  # noqa: E731
            else:
                p = train_policy(ctx, method)
                make = lambda q: _policy_record(ctx, p, q, method)  # noqa: E731
            for q in ctx.test:
                if q.text in ctx.failed:
                    continue
                try:
                    if q.id not in done:
                        rlog.append(make(q))
                    elif method in POLICY_METHODS:
                        # replayed, not recorded: a sampling policy's random state then reaches the
                        # remaining queries as in an uninterrupted run
                        make(q)
                except (GeneratorError, QueryFailed) as exc:
                    if getattr(exc, "client_error", False):      # a 4xx would meet every query: stop
                        raise
                    # generated on demand here (an arm no earlier pass computed): the query is left
                    # out of every method, and a rerun tries it again
                    log.warning("%s: generator failure on test query %s, left out: %s", method.value, q.id, exc)
                    ctx.fail(q.text, exc)
    finally:
        rlog.close()
    by_id = {r["id"]: r for r in rlog.records}
    return [by_id[q.id] for q in ctx.test if q.id in by_id and q.text not in ctx.failed]
