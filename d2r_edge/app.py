"""Assembles a Pipeline from files: exported models, a KB, a policy, a generator."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from d2r_edge.accept import Comparator
from d2r_edge.budget import CostModel, MemoryProbe, Meter
from d2r_edge.config import Budget, ContextConfig, ExplorationConfig, RewardConfig, RewardQuality
from d2r_edge.detector import Detector, Gate
from d2r_edge.diagnose import Diagnoser, ResponseNLI
from d2r_edge.errors import ConfigError, PolicyFileError
from d2r_edge.generate.registry import Encoders, build_generator
from d2r_edge.hypothesis import HypothesisForm
from d2r_edge.kg.check import KGChecker
from d2r_edge.kg.store import KG_DIR, TripleStore
from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder, Reader
from d2r_edge.onnx.manifest import Role, Variant, load_manifest
from d2r_edge.onnx.session import SessionConfig, on_cuda
from d2r_edge.onnx.sharing import MicroBatcher, PairCache
from d2r_edge.pipeline import Pipeline
from d2r_edge.policy import BestFixed, Explorer, LinUCB, ThompsonSampling, updates_of
from d2r_edge.policy.state import stored_kind
from d2r_edge.repair import (
    ARM_NAMES,
    ARMS,
    IS_RETRIEVAL,
    ArmAvailability,
    PipelineConfig,
    arm_availability,
)
from d2r_edge.retrieval.docs import read_documents
from d2r_edge.retrieval.kb import KnowledgeBase, PoolRefresh
from d2r_edge.retrieval.retriever import Retriever
from d2r_edge.selective import Certificate
from d2r_edge.tasks import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSettings:
    kb: Path
    models: Path
    task: Task
    variant: Variant = Variant.INT8
    allow_random_weights: bool = False
    generator: str = "extractive"
    base_url: str = "http://127.0.0.1:8080/v1"
    model: str = "local"
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 60.0
    self_consistency: int = 0              # openai generator: N more samples per answer (d2r_edge.consistency)
    sample_temperature: float = 0.7
    self_check: bool = False               # openai generator: P(True) of each first answer, one more request
    self_check_samples: bool = False       # ... with the self-consistency samples shown in it (Kadavath sec. 3.3)
    policy_path: Path | None = None
    # linucb | thompson | fixed; None: a --policy file's own kind, else the task's default (DEFAULT_POLICY_KIND)
    policy_kind: str | None = None
    alpha: float = 2.0
    budget: Budget = field(default_factory=Budget)
    reward: RewardConfig = field(default_factory=RewardConfig)
    exploration: ExplorationConfig = field(default_factory=ExplorationConfig)
    query_dim: int | None = 128
    refresh_pool: Path | None = None
    seed: int = 0
    qa_hypothesis: HypothesisForm = HypothesisForm.STATEMENT
    evidence_titles: bool = True           # passages as "title\ntext" (retrieval.retriever.evidence_text)
    intra_op_threads: int = 0              # ONNX Runtime threads per session; 0 = one per usable core
    create_policy: bool = False            # train: a --policy file that does not exist yet is started fresh
    gate: Gate = Gate.PAPER                # which first answers are repaired (d2r_edge.detector)
    detector_path: Path | None = None      # the calibrated detector (JSON); loaded when given
    accept_path: Path | None = None        # the accept/revert comparator (JSON, d2r_edge.accept); needs the detector
    unverified_rule: bool = True           # FEVER: UNVERIFIED first answers get retrieval arms only (the paper's)
    trust_path: Path | None = None         # the trust certificate (d2r-edge calibrate); needs the detector
    abstain_text: str | None = None        # set: untrusted answers are withheld (FEVER: NOT ENOUGH INFO; QA: this)
    vote_k: int = 0                        # >= 2: repair by a weighted vote of the k cheapest arms (d2r_edge.vote)
    nli_cache_pairs: int = 4096            # NLI scores of recent pairs kept (onnx/sharing.py); 0 = none
    parallel_requests: int = 1             # Runtime: queries answered at once (1 = one at a time)
    micro_batch_pairs: int = 0             # > 0: concurrent queries' NLI pairs merged up to this many
    micro_batch_wait_ms: float = 2.0       # ... or what arrived this long after the first
    # which (passage, response) pairs e_r scores; the same verdicts either way (diagnose.ResponseNLI).
    # A detector reads every pair's probabilities: with one (or --gate calibrated) every pair is scored.
    response_nli: ResponseNLI = ResponseNLI.UNTIL_ENTAILED

    def __post_init__(self) -> None:
        for name in ("nli_cache_pairs", "micro_batch_pairs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0 (0 = off), got {value!r}")
        if not isinstance(self.self_consistency, int) or self.self_consistency < 0:
            raise ConfigError(f"self_consistency must be an int >= 0, got {self.self_consistency!r}")
        if self.self_check and self.generator != "openai":
            raise ConfigError(f"--self-check asks an LLM about its own answer; the {self.generator} generator has "
                              f"none to ask (use --generator openai)")
        if self.self_check_samples and not (self.self_check and self.self_consistency):
            raise ConfigError("--self-check-samples shows the self-consistency samples in the self-check: give "
                              "--self-check and --self-consistency N (N >= 1) too")
        if self.self_consistency and self.generator != "openai":
            raise ConfigError(f"--self-consistency samples an LLM; the {self.generator} generator is deterministic "
                              f"(use --generator openai, or leave it at 0)")
        if not isinstance(self.parallel_requests, int) or self.parallel_requests < 1:
            raise ConfigError(f"parallel_requests must be an int >= 1, got {self.parallel_requests!r}")
        if not (isinstance(self.micro_batch_wait_ms, (int, float)) and 0 <= self.micro_batch_wait_ms <= 1000):
            raise ConfigError(f"micro_batch_wait_ms must be in [0, 1000], got {self.micro_batch_wait_ms!r}")
        try:
            object.__setattr__(self, "response_nli", ResponseNLI(self.response_nli))
        except ValueError:
            raise ConfigError(f"response_nli must be one of {[m.value for m in ResponseNLI]}, "
                              f"got {self.response_nli!r}") from None

    @property
    def needs_detector(self) -> bool:
        """The calibrated gate or the detector reward: a fitted detector must be loaded (train fits one)."""
        return self.gate is Gate.CALIBRATED or self.reward.quality is RewardQuality.DETECTOR

    @property
    def effective_response_nli(self) -> ResponseNLI:
        """UNTIL_ENTAILED leaves pairs unscored; a detector's features read them all."""
        if self.detector_path is not None or self.needs_detector:
            return ResponseNLI.ALL
        return self.response_nli


def costs_path(policy_path: Path) -> Path:
    return policy_path.with_name(policy_path.stem + ".costs.npz")


POLICY_KINDS = ("linucb", "thompson", "fixed")
# each task's default repair policy, chosen on training queries by `eval answers --methods-cv` (issue 51):
# FEVER's 150 training claims chose the best fixed arm (+6.0 points over naive, LinUCB -1.3); HotpotQA's 202
# training questions chose Thompson Sampling (+1.5 EM [-1.0, +4.0], LinUCB -1.0 [-4.0, +1.5]: within noise,
# docs/runs/qa-methods-cv)
DEFAULT_POLICY_KIND = {Task.FEVER: "fixed", Task.QA: "thompson"}


def policy_kind(s: RunSettings) -> str:
    """The kind asked for; else the kind stored in an existing --policy file; else the task's default."""
    if s.policy_kind is not None:
        if s.policy_kind not in POLICY_KINDS:
            raise ConfigError(f"policy kind must be one of {', '.join(POLICY_KINDS)}, got {s.policy_kind!r}")
        return s.policy_kind
    if s.policy_path is not None and s.policy_path.is_file():
        stored = stored_kind(s.policy_path)
        if stored in POLICY_KINDS:
            return stored
    return DEFAULT_POLICY_KIND[s.task]


def load_policy(s: RunSettings, context):
    """The policy at `s.policy_path` and its cost model, checked against the contexts this run
    builds (`context`: a ContextBuilder); a fresh policy when there is no path, or when
    training (`s.create_policy`) to a file that does not exist yet."""
    kind = policy_kind(s)
    if s.policy_path is not None and s.policy_path.is_file():
        if kind == "thompson":
            pol = ThompsonSampling.load(s.policy_path, arm_names=ARM_NAMES)
        elif kind == "fixed":
            pol = BestFixed.load(s.policy_path, arm_names=ARM_NAMES)
        else:
            pol = LinUCB.load(s.policy_path, arm_names=ARM_NAMES)
            check_context(s.policy_path, pol.context, context.spec)     # says which setting differs
            if pol.dim != context.dim:
                raise PolicyFileError(f"{s.policy_path} scores {pol.dim}-dimensional contexts, this run builds "
                                      f"{context.dim}; run with the settings it was trained with or retrain it")
        cp = costs_path(s.policy_path)
        costs = CostModel.load(cp) if cp.is_file() else CostModel(len(ARM_NAMES))
        return pol, costs
    if s.policy_path is not None and not s.create_policy:
        raise PolicyFileError(f"no policy file at {s.policy_path}; train one with `d2r-edge train --policy "
                              f"{s.policy_path}`, or leave --policy out to run an untrained policy")
    if kind == "thompson":
        pol = ThompsonSampling(len(ARM_NAMES), seed=s.seed, arm_names=ARM_NAMES)
    elif kind == "fixed":
        pol = BestFixed(len(ARM_NAMES), arm_names=ARM_NAMES)
    else:
        pol = LinUCB(len(ARM_NAMES), context.dim, s.alpha, arm_names=ARM_NAMES)
    pol.context = context.spec
    return pol, CostModel(len(ARM_NAMES))


_CONTEXT_FLAGS = {"projection_seed": "--seed", "query_dim": "the query_dim setting", "p_wrong": "--gate",
                  "embedder": "--models (the profile whose embedder trained it)"}


def check_context(path: Path, saved: dict | None, current: dict) -> None:
    """A LinUCB policy scores contexts built exactly as in training, or not at all."""
    if saved is None:
        log.warning("%s was saved without its context settings (an older d2r-edge): cannot check that "
                    "this run builds contexts the same way; retrain it to get the check", path)
        return
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if diff:
        what = "; ".join(f"{k}: trained with {saved.get(k)!r}, this run {current.get(k)!r}" for k in diff)
        fix = ", ".join(_CONTEXT_FLAGS.get(k, k) for k in diff)
        raise PolicyFileError(f"{path} was trained on contexts built another way ({what}); run with the "
                              f"settings it was trained with ({fix}) or retrain it")


def build_pipeline(s: RunSettings) -> Pipeline:
    manifest = load_manifest(s.models)
    allow, session = s.allow_random_weights, SessionConfig(intra_op_threads=s.intra_op_threads)
    embedder = Embedder(manifest, variant=s.variant, session=session, allow_random_weights=allow)
    nli = NLI(manifest, variant=s.variant, session=session, allow_random_weights=allow)
    nli.warmup()
    if s.micro_batch_pairs:
        nli = MicroBatcher(nli, s.micro_batch_pairs, s.micro_batch_wait_ms)
    if s.nli_cache_pairs:
        nli = PairCache(nli, s.nli_cache_pairs)       # the generator and the diagnosis share its scores
    reranker = (CrossEncoder(manifest, variant=s.variant, session=session, allow_random_weights=allow)
                if manifest.has(Role.RERANKER) else None)
    # QA's independent answer check (issue 53); FEVER's claims are not questions
    reader = (Reader(manifest, variant=s.variant, session=session, allow_random_weights=allow)
              if manifest.has(Role.READER) and not s.task.fact_verification else None)
    kb = KnowledgeBase.open(s.kb, embedder)
    extractor, store = None, TripleStore.from_triples([], embedder)
    if manifest.has(Role.TRIPLES):
        from d2r_edge.onnx.seq2seq import Seq2SeqModel, Triples

        extractor = Triples(Seq2SeqModel(manifest, variant=s.variant, session=session,
                                         allow_random_weights=allow))
        if (kb.directory / KG_DIR / "triples.jsonl").is_file():
            store = TripleStore.load(kb.directory / KG_DIR)
        else:
            log.warning("%s has no triple store: every response triple will be MISSING "
                        "(run d2r-edge index kg --kb %s)", kb.directory, kb.directory)
    kg = KGChecker(store, extractor, embedder, s.task.kg_thresholds)
    generator = build_generator(s.generator, s, Encoders(nli, reranker, embedder))
    context = context_builder(embedder, s)
    policy, costs = load_policy(s, context)
    pool = None
    if s.refresh_pool is not None:
        pool = PoolRefresh(read_documents(s.refresh_pool, known_ids=kb.doc_ids).documents, seed=s.seed)

    def refresh() -> int:
        return kb.refresh(embedder, extra=pool.draw() if pool else None)

    embedder.warmup()
    arms = arm_availability(manifest.roles, manifest.absent,
                            samples=s.self_consistency if s.generator == "openai" else 0,
                            fact_verification=s.task.fact_verification)
    if s.parallel_requests > 1:
        arms = without_refresh(arms)
    for name, why in arms.unavailable.items():
        log.info("arm %s is off: %s", name, why)
    return Pipeline(task=s.task, retriever=Retriever(kb, embedder, reranker), generator=generator,
                    diagnoser=Diagnoser(nli, kg, s.qa_hypothesis, s.effective_response_nli, reader), policy=policy,
                    context=context, costs=costs,
                    meter=Meter(MemoryProbe(prefer_device=on_cuda(nli.session))), budget=s.budget,
                    reward_cfg=s.reward,
                    explorer=Explorer(IS_RETRIEVAL, s.exploration) if s.exploration.rate > 0 else None,
                    refresh=refresh, default=PipelineConfig(evidence_titles=s.evidence_titles), arms=arms,
                    gate=s.gate, detector=(Detector.load(s.detector_path, s.task.fact_verification)
                                           if s.detector_path is not None else None),
                    comparator=Comparator.load(s.accept_path) if s.accept_path is not None else None,
                    unverified_rule=s.unverified_rule,
                    trust=(Certificate.load(s.trust_path, s.detector_path) if s.trust_path is not None else None),
                    abstain_text=s.abstain_text, vote_k=s.vote_k)


def without_refresh(arms: ArmAvailability) -> ArmAvailability:
    """Queries answered in parallel: the refresh arms, which grow the KB in place under the other
    queries' searches, are off."""
    mask = arms.mask.copy()
    why = dict(arms.unavailable)
    for i, arm in enumerate(ARMS):
        if arm.refresh:
            mask[i] = False
            why.setdefault(arm.name, "queries answered in parallel (--parallel > 1): a refresh grows the KB "
                                     "in place; use --parallel 1 to run it")
    return ArmAvailability(mask, why)


def context_builder(embedder, s: RunSettings):
    from d2r_edge.policy.features import ContextBuilder

    return ContextBuilder(ContextConfig(embedding_dim=embedder.dim, query_dim=s.query_dim,
                                        projection_seed=s.seed, embedder_id=embedder.space_id,
                                        p_wrong=s.gate is Gate.CALIBRATED))


def detector_path(policy_path: Path) -> Path:
    """Where `train --gate calibrated` saves the detector: beside the policy."""
    return policy_path.with_name(policy_path.stem + ".detector.json")


def fit_detector_on_queries(pipeline: Pipeline, queries, path: Path) -> Detector:
    """The calibrated detector fitted on the first attempts of the labeled `queries` (FEVER labels, QA
    gold answers; unlabeled ones are skipped) and saved to `path`. The first attempts are computed
    here and again when the policy trains (they are not kept: a refresh arm changes the KB)."""
    from d2r_edge.detector import feature_groups, feature_matrix, feature_names, first_answer
    from d2r_edge.runner import correct

    fv = pipeline.task.fact_verification
    attempts, wrong, texts = [], [], []
    for q in queries:
        gold = {"label": q.label, "answer": q.answer}
        if (q.label if fv else q.answer) is None:
            continue
        a, _ = pipeline.metered_attempt(q.text, pipeline.default, pipeline.retriever.embed(q.text), metered=False)
        attempts.append(a)
        texts.append(q.text)
        wrong.append(not correct(pipeline.task, gold, first_answer(fv, a)))
    if not attempts:
        raise ConfigError("--gate calibrated fits its detector on labeled queries (FEVER label / QA answer), "
                          "and none of the training queries has one; add labels or use --gate paper")
    det = Detector.fit(feature_matrix(attempts, fv), np.array(wrong), feature_names(fv), pipeline.task.value,
                       keys=texts, groups=feature_groups(fv))
    det.save(path)
    log.info("detector fitted on %d labeled queries (%d wrong first answers), threshold %.3f: %s",
             len(attempts), sum(wrong), det.threshold, path)
    return det


def save_policy(pipeline: Pipeline, path: Path) -> None:
    pipeline.policy.save(path)
    pipeline.costs.save(costs_path(path))


def logged_updates(rep: dict) -> list[dict]:
    """The policy updates one record's repair made, in order: its arm's, or with a full-information policy in
    training every arm's (`updates`); each {arm_index, reward, latency_s, mem_growth_mib}, all with its `x`."""
    if rep.get("updates") is not None:
        return list(rep["updates"])
    return [{k: rep[k] for k in ("arm_index", "reward", "latency_s", "mem_growth_mib")}]


def replay_missing_updates(pipeline: Pipeline, records: list[dict]) -> int:
    """Updates logged before a crash but absent from the saved policy are applied again."""
    logged = [(u, r["repair"]["x"]) for r in records if r.get("repair") and r["repair"].get("x") is not None
              for u in logged_updates(r["repair"])]
    missing = len(logged) - updates_of(pipeline.policy)
    if missing < 0:
        raise PolicyFileError("the policy has more updates than the training log; use the log it was trained with")
    for u, x in logged[len(logged) - missing:]:
        pipeline.policy.update(u["arm_index"], np.asarray(x), u["reward"])
        pipeline.costs.observe(u["arm_index"], u["latency_s"], u["mem_growth_mib"])
    return missing


def train(pipeline: Pipeline, queries, out: Path, policy_path: Path, epochs: int = 2,
          save_every_updates: int = 50) -> list[dict]:
    """Alg. 2: online passes over the queries. The policy is saved every `save_every_updates`
    updates and at the end of each epoch; every update is in the training log first, so after
    a crash the ones the saved policy lacks are replayed from it (`replay_missing_updates`).
    A full-information policy (the best fixed arm) sees every allowed arm of each repaired query."""
    pipeline.learn_every_arm = bool(getattr(pipeline.policy, "full_information", False))
    from d2r_edge.runner import RecordLog, process, run_record_ok

    if not isinstance(save_every_updates, int) or save_every_updates < 1:
        raise ConfigError(f"save_every_updates must be an int >= 1, got {save_every_updates!r}")
    prior = RecordLog(out, valid=run_record_ok)
    prior.close()
    if replay_missing_updates(pipeline, prior.records):
        save_policy(pipeline, policy_path)
    records = prior.records
    pending = 0

    def on_update(rec: dict) -> None:
        nonlocal pending
        pending += 1
        if pending >= save_every_updates:
            save_policy(pipeline, policy_path)
            pending = 0

    for epoch in range(epochs):
        records = process(pipeline, queries, out, learn=True, epoch=epoch, on_update=on_update).records
        save_policy(pipeline, policy_path)
        pending = 0
    return records
