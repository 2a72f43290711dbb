"""`d2r-edge doctor ...`: the trajectory mode's commands (Doctor-RAG)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FORMATS = ["auto", "react_fever", "reflexion", "fireact", "jsonl"]


def _doctor_models(args: argparse.Namespace):
    from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder
    from d2r_edge.onnx.manifest import Role, Variant, load_manifest

    manifest, v = load_manifest(Path(args.models)), Variant(args.variant)
    allow = args.allow_random_weights
    reranker = (CrossEncoder(manifest, variant=v, allow_random_weights=allow)
                if manifest.has(Role.RERANKER) else None)
    return (NLI(manifest, variant=v, allow_random_weights=allow),
            Embedder(manifest, variant=v, allow_random_weights=allow), reranker)


def _doctor_chat(args: argparse.Namespace):
    """The client's `complete`: repairs and the LLM diagnoser ask for JSON only where they say so, and
    never for token log-probabilities (nothing here reads them, and llama-cpp-python's server sorts
    the whole vocabulary for every generated token when they are asked for)."""
    from d2r_edge.generate.openai_compat import OpenAICompatible

    client = OpenAICompatible(args.base_url, args.model, args.api_key_env, args.timeout_s, logprobs=False)
    return lambda messages, max_tokens, stop=None, json_mode=False: client.complete(messages, max_tokens, stop,
                                                                                   json_mode)


def _open_kb(path, embedder):
    from d2r_edge.retrieval.kb import KnowledgeBase

    return KnowledgeBase.open(Path(path), embedder)


def cmd_doctor_diagnose(args: argparse.Namespace) -> int:
    from d2r_edge.doctor.commands import DiagnoseRequest, run_diagnose
    from d2r_edge.doctor.parse import TrajectoryFormat
    from d2r_edge.onnx.encoders import NLI
    from d2r_edge.onnx.manifest import Variant, load_manifest

    nli = NLI(load_manifest(Path(args.models)), variant=Variant(args.variant),
              allow_random_weights=args.allow_random_weights)
    req = DiagnoseRequest(Path(args.trajectories), Path(args.out), TrajectoryFormat(args.format), args.limit)
    llm = None
    if args.diagnoser == "llm":
        from d2r_edge.doctor.llm_diagnose import LLMDiagnoser

        llm = LLMDiagnoser(_doctor_chat(args))
    summary = run_diagnose(req, nli, llm)
    print(json.dumps({k: v for k, v in summary.items() if k != "skipped_lines"}, indent=1))
    print(f"records: {args.out}; summary: {args.out}.summary.json")
    return 0


def cmd_doctor_eval(args: argparse.Namespace) -> int:
    from d2r_edge.doctor.evaluate import (
        DoctorEvalSettings,
        parse_doctor_methods,
        run_doctor_eval,
    )
    from d2r_edge.doctor.kb import build_doctor_kb, kb_search
    from d2r_edge.doctor.parse import TrajectoryFormat

    s = DoctorEvalSettings(tuple(Path(p) for p in args.trajectories), Path(args.out),
                           parse_doctor_methods(args.methods), args.limit, TrajectoryFormat(args.format))
    nli, emb, reranker = _doctor_models(args)
    kb = (_open_kb(args.kb, emb) if args.kb else
          build_doctor_kb(list(s.trajectories), [Path(p) for p in args.extra_docs or []], s.out, emb, s.fmt))
    run_doctor_eval(s, nli, _doctor_chat(args), kb_search(kb, emb, reranker))
    print((s.out / "report.md").read_text(encoding="utf-8"))
    print(f"summary: {s.out / 'summary.json'}")
    return 0


def cmd_doctor_repair(args: argparse.Namespace) -> int:
    """Diagnose and repair with one method; one record per failed trajectory (resumable)."""
    from d2r_edge.doctor.evaluate import DoctorEvalSettings, run_doctor_eval
    from d2r_edge.doctor.kb import kb_search
    from d2r_edge.doctor.parse import TrajectoryFormat
    from d2r_edge.doctor.repair import Method

    out = Path(args.out)
    s = DoctorEvalSettings((Path(args.trajectories),), out.parent / f"{out.stem}.work", (Method(args.method),),
                           args.limit, TrajectoryFormat(args.format))
    nli, emb, reranker = _doctor_models(args)
    run_doctor_eval(s, nli, _doctor_chat(args), kb_search(_open_kb(args.kb, emb), emb, reranker))
    out.write_text((s.out / f"{args.method}.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    print(f"repairs: {out}; report: {s.out / 'report.md'}")
    return 0


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="OpenAI-compatible server")
    p.add_argument("--model", default="local", help="model name sent to the server")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    p.add_argument("--timeout-s", type=float, default=120.0)


def add_doctor_parser(sub, model_args) -> None:
    p = sub.add_parser("doctor", help="trajectory mode (Doctor-RAG): diagnose and repair failed agent trajectories")
    dr = p.add_subparsers(dest="what", required=True)
    p = dr.add_parser("diagnose", help="error type and earliest failing step of each failed trajectory "
                                       "(no LLM: the NLI and rules)")
    p.add_argument("--trajectories", required=True,
                   help="JSONL trajectories (ReAct-FEVER, Reflexion, FireAct, or the jsonl layout in "
                        "docs/results.md, Trajectory mode)")
    p.add_argument("--format", default="auto", choices=FORMATS)
    p.add_argument("--out", required=True, help="JSONL, one record per failed trajectory; resumable")
    p.add_argument("--limit", type=int, default=None, help="only the first N failed trajectories")
    p.add_argument("--diagnoser", default="nli", choices=["nli", "llm"],
                   help="llm: the paper's protocol as a prompt to --base-url/--model (each record keeps the "
                        "NLI diagnoser's call; the summary gives their agreement)")
    _server_args(p)
    model_args(p)
    p.set_defaults(func=cmd_doctor_diagnose)

    def with_llm(p):
        p.add_argument("--format", default="auto", choices=FORMATS)
        p.add_argument("--limit", type=int, default=None, help="only the first N failed trajectories (per file)")
        p.add_argument("--generator", default="openai", choices=["openai"],
                       help="repairs that write text need an LLM (an OpenAI-compatible server)")
        _server_args(p)
        model_args(p)

    p = dr.add_parser("repair", help="diagnose, then repair each failed trajectory from its culprit step")
    p.add_argument("--trajectories", required=True)
    p.add_argument("--kb", required=True, help="knowledge base for re-retrieval (d2r-edge index build)")
    p.add_argument("--method", default="drrag", choices=["drrag", "rerun", "stepwise", "no_taxonomy",
                                                          "no_localization"])
    p.add_argument("--out", required=True, help="JSONL, one repair record per failed trajectory")
    with_llm(p)
    p.set_defaults(func=cmd_doctor_repair)

    p = dr.add_parser("eval", help="DR-RAG vs rerun, step-wise retry and the ablations: report.md, summary.json")
    p.add_argument("--trajectories", required=True, action="append", help="repeatable")
    p.add_argument("--methods", default=None, help="comma list (default: drrag,rerun,stepwise,no_taxonomy,"
                                                   "no_localization)")
    p.add_argument("--kb", default=None, help="a built knowledge base; default: built under --out from the "
                                              "trajectories' observations and --extra-docs")
    p.add_argument("--extra-docs", action="append", help="query files whose paragraphs join the KB (repeatable)")
    p.add_argument("--out", required=True, help="directory; rerun with the same one to resume")
    with_llm(p)
    p.set_defaults(func=cmd_doctor_eval)
