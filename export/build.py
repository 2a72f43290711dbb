"""`d2r-edge export`: a profile's roles -> models/<profile>/ with a verified manifest.

All sources are resolved before anything is exported (an unreachable hub id
fails in seconds, not after an hour of exporting the other roles). The
profile is written to a temporary directory and swapped in atomically: an
interrupted export leaves the previous profile untouched.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
import tomllib
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

from d2r_edge_export import convert, parity
from d2r_edge_export.parity_data import load_parity_set
from d2r_edge_export.sources import ResolvedSource, resolve
from d2r_edge_export.specs import SPECS, RoleSpec, spec_for

from d2r_edge.errors import ConfigError, UnknownProfileError
from d2r_edge.onnx.manifest import (
    MANIFEST_FORMAT_VERSION,
    MANIFEST_NAME,
    Role,
    Variant,
    load_manifest,
    sha256_file,
)

log = logging.getLogger(__name__)

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
PROFILES_FILE = MODELS_DIR / "profiles.toml"
_GENERATION_KEYS = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id",
                    "forced_bos_token_id", "forced_eos_token_id", "min_length",
                    "no_repeat_ngram_size", "num_beams", "max_length", "max_new_tokens",
                    "length_penalty", "early_stopping")


@dataclass(frozen=True)
class ExportRequest:
    profile: str
    overrides: dict[str, str] = field(default_factory=dict)
    models_dir: Path = MODELS_DIR
    profiles_file: Path = PROFILES_FILE
    variants: tuple[Variant, ...] = (Variant.FP32, Variant.INT8, Variant.FP16)
    data_dir: Path | None = None
    seed: int = 0
    random_init: str | None = None     # build this real-size random config for the role it serves
    finetune: object | None = None     # export.finetune.FinetuneSettings for finetune: sources
    # score at most this many pairs / questions per held-out set and calibrate int8 on at most this
    # many pairs: a faster build whose validation figures are noisier (recorded in the manifest)
    heldout_limit: int | None = None
    # pairs (half FEVER, half HotpotQA) the parity check runs through PyTorch and every variant in
    # one padded batch; the real-size random exports of the benchmarks use a few (their weights are
    # noise, their cost is what is measured: 64 pairs took 3.5 of deberta-v3-base's 4.3 minutes)
    parity_inputs: int = 64


def _profile_table(name: str, profiles_file: Path) -> dict:
    try:
        table = tomllib.loads(profiles_file.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read profiles from {profiles_file}: {exc}") from None
    if name not in table:
        raise UnknownProfileError(
            f"unknown profile {name!r}; profiles in {profiles_file.name}: {', '.join(table)}"
        )
    return table[name]


def load_profile(name: str, profiles_file: Path = PROFILES_FILE) -> dict[str, str]:
    """role -> source of a profile (its `description` and `finetune` keys are not roles)."""
    return {k: v for k, v in _profile_table(name, profiles_file).items() if k not in ("description", "finetune")}


def profile_finetune_preset(name: str, profiles_file: Path = PROFILES_FILE) -> str:
    """The fine-tuning preset a profile names (`finetune = "quick"`), "full" by default."""
    return str(_profile_table(name, profiles_file).get("finetune", "full"))


def parse_role_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, source = item.partition("=")
        if not sep or not source:
            raise ConfigError(f"--role takes NAME=SOURCE, got {item!r}")
        spec_for(name)  # unknown role -> UnknownRoleError
        out[name] = source
    return out


def _tools() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime-gpu",
                 "onnxruntime", "tokenizers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


CALIBRATION_PAIRS = 1000     # pairs that choose the int8 mixed-precision tier and the NLI's rescore margin
# NLI int8: pairs whose int8 top-2 probability margin is below the chosen margin are rescored
# in fp32 at run time (encoders.NLI). The smallest margin reaching RESCORE_TARGET on the
# calibration pairs wins; the target sits above the role's 0.99 because the calibration pairs
# (training-split FEVER/HotpotQA) are easier than the held-out FEVER pairs
RESCORE_MARGINS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2)
RESCORE_TARGET = 0.995


def _file_entry(path: Path, root: Path) -> tuple[str, dict]:
    return str(path.relative_to(root)), {"sha256": sha256_file(path), "size_bytes": path.stat().st_size}


def _max_length(checkpoint: Path, spec: RoleSpec, cfg: dict) -> int:
    limits = [spec.default_max_length_tokens, int(cfg.get("max_position_embeddings") or 10**6)]
    st = checkpoint / "sentence_bert_config.json"
    if st.is_file():
        limits.append(int(json.loads(st.read_text()).get("max_seq_length") or 10**6))
    return min(limits)


def _write_tokenizer(checkpoint: Path, out: Path, max_length: int) -> None:
    """tokenizer.json without fixed padding, truncating at the role's max length."""
    from tokenizers import Tokenizer

    src = checkpoint / "tokenizer.json"
    if not src.is_file():  # sentencepiece-only checkpoints: let transformers convert
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(checkpoint), use_fast=True).save_pretrained(str(out / ".tok"))
        src = out / ".tok" / "tokenizer.json"
    tok = Tokenizer.from_file(str(src))
    tok.no_padding()
    tok.enable_truncation(max_length)
    tok.save(str(out / "tokenizer.json"))
    shutil.rmtree(out / ".tok", ignore_errors=True)


def _generation(checkpoint: Path, cfg: dict) -> dict:
    gen = dict(cfg)
    path = checkpoint / "generation_config.json"
    if path.is_file():
        gen.update(json.loads(path.read_text()))
    out = {k: gen.get(k) for k in _GENERATION_KEYS if gen.get(k) is not None}
    if isinstance(out.get("eos_token_id"), list):
        out["eos_token_id"] = out["eos_token_id"][0]
    return out


def export_role(role: Role, src: ResolvedSource, root: Path, variants: tuple[Variant, ...]) -> dict:
    """Export one role into root/<role>/ and return its manifest entry (parity added later)."""
    spec = SPECS[role]
    role_dir = root / role.value
    cfg = json.loads((src.directory / "config.json").read_text())
    variants = tuple(v for v in variants if v is not Variant.FP16 or spec.supports_fp16)
    t0 = time.perf_counter()
    fp32 = convert.to_onnx(src.directory, role_dir / Variant.FP32.value, spec.optimum_task)
    names = sorted(p.name for p in fp32)
    if names != sorted(spec.onnx_files):
        raise ConfigError(f"role {role.value}: exporter wrote {names}, expected {spec.onnx_files}")
    quant: dict = {}
    if Variant.INT8 in variants:
        preset = convert.cpu_preset()
        (role_dir / "int8").mkdir()
        counts = {p.name: convert.quantize_int8(p, role_dir / "int8" / p.name, preset) for p in fp32}
        quant = {"preset": preset.name, "per_channel": True, "reduce_range": preset.reduce_range,
                 "weight_type": "QInt8", "quantized_nodes": counts, "keep_fp32": convert.INT8_TIERS[0].name}
    if Variant.FP16 in variants:
        (role_dir / "fp16").mkdir()
        for p in fp32:
            convert.convert_fp16(p, role_dir / "fp16" / p.name)
    max_len = _max_length(src.directory, spec, cfg)
    _write_tokenizer(src.directory, role_dir, max_len)
    variant_meta = {}
    for v in variants:
        files = dict(_file_entry(p, role_dir) for p in sorted((role_dir / v.value).iterdir()))
        variant_meta[v.value] = {"files": files, **({"quantization": quant} if v is Variant.INT8 else {})}
    id2label = cfg.get("id2label") if role in (Role.NLI, Role.RERANKER) else None
    log.info("exported %s (%s) in %.1f s", role.value, src.spec, time.perf_counter() - t0)
    return {
        "role": role.value,
        "directory": role.value,
        "source": {"spec": src.spec, "kind": src.kind, "weights_sha256": src.weights_sha256()},
        "architecture": cfg.get("model_type", "unknown"),
        "task": spec.task,
        "id2label": id2label,
        "max_length_tokens": max_len,
        "opset": convert.OPSET,
        "weights": "random" if src.random_weights else "trained",
        "files": dict([_file_entry(role_dir / "tokenizer.json", role_dir)]),
        "variants": variant_meta,
        "generation": _generation(src.directory, cfg) if role is Role.TRIPLES else {},
    }


def spread(rows: list, n: int | None) -> list:
    """At most `n` rows, evenly spaced over the list (its sources and labels come in runs)."""
    if n is None or len(rows) <= n:
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


def limit_heldout(sets, n: int | None):
    """The held-out parts of `PairSets` (or the reader's `ReaderSets`), each cut to `n` rows by `spread`;
    training parts untouched."""
    if n is None:
        return sets
    if hasattr(sets, "val"):
        return replace(sets, val=spread(sets.val, n))
    general = sets.general
    if general is not None:
        general = replace(general, heldout={g: spread(rows, n) for g, rows in general.heldout.items()})
    return replace(sets, nli_val=spread(sets.nli_val, n), rerank_val=spread(sets.rerank_val, n), general=general)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _int8_agreement(manifest_dir: Path, role: Role, pairs: list[tuple[str, str]]) -> float:
    """int8 vs fp32 through the runtime classes (parity.agreement_vs_fp32)."""
    loaded = load_manifest(manifest_dir)
    raw = {"near_tie_fp32": False} if role is Role.NLI else {}    # int8 alone, before any rescoring
    fp32, int8 = (parity._ENCODERS[role](loaded, variant=v, session=parity.CPU, allow_random_weights=True, **raw)
                  for v in (Variant.FP32, Variant.INT8))
    return parity.agreement_vs_fp32(role, fp32, int8, pairs)


def settle_rescore_margin(work: Path, manifest: dict, pairs: list[tuple[str, str]]) -> None:
    """The NLI's fp32 rescore margin for int8 near ties (see RESCORE_MARGINS), into the manifest."""
    import numpy as np

    from d2r_edge.onnx.encoders import NLI, top2_margin

    loaded = load_manifest(work)
    ref = NLI(loaded, variant=Variant.FP32, session=parity.CPU).logits(pairs).argmax(axis=1)
    q = NLI(loaded, variant=Variant.INT8, session=parity.CPU, near_tie_fp32=False).logits(pairs)
    margin, raw = top2_margin(q), q.argmax(axis=1)
    tried = []
    for d in RESCORE_MARGINS:
        agree = float(np.mean(np.where(margin < d, ref, raw) == ref))
        tried.append({"margin": d, "agreement": agree, "share_rescored": float(np.mean(margin < d))})
        if agree >= RESCORE_TARGET:
            break
    quant = manifest["roles"][Role.NLI.value]["variants"][Variant.INT8.value]["quantization"]
    quant["fp32_rescore_margin"] = tried[-1]["margin"]
    quant["fp32_rescore"] = {"pairs": len(pairs), "target": RESCORE_TARGET, "tried": tried,
                             "reached": tried[-1]["agreement"] >= RESCORE_TARGET}
    log.info("int8 nli: fp32 rescore below margin %.2f (%.1f%% of calibration pairs): agreement %.4f",
             tried[-1]["margin"], 100 * tried[-1]["share_rescored"], tried[-1]["agreement"])
    _write_json(work / MANIFEST_NAME, manifest)


def settle_int8(work: Path, manifest: dict, role: Role, pairs: list[tuple[str, str]]) -> None:
    """Keep the cheapest mixed-precision tier whose int8 agrees with fp32 on `pairs` >= the target.

    Tiers (convert.INT8_TIERS) move the most range-sensitive MatMuls back to
    fp32 one group at a time. The pairs are parity pairs outside the held-out
    split, so the choice never sees the validation data. If no tier reaches
    the target the last one stays, and the manifest says so.
    """
    spec, entry = SPECS[role], manifest["roles"][role.value]
    quant = entry["variants"][Variant.INT8.value]["quantization"]
    role_dir = work / role.value
    tried = {}
    for tier in convert.INT8_TIERS:
        if tier.name != quant["keep_fp32"]:
            preset = convert.PRESETS[quant["preset"]]
            quant["quantized_nodes"] = {
                p.name: convert.quantize_int8(p, role_dir / "int8" / p.name, preset, tier)
                for p in sorted((role_dir / "fp32").glob("*.onnx"))}
            quant["keep_fp32"] = tier.name
            entry["variants"][Variant.INT8.value]["files"] = dict(
                _file_entry(p, role_dir) for p in sorted((role_dir / "int8").iterdir()))
            _write_json(work / MANIFEST_NAME, manifest)
        tried[tier.name] = _int8_agreement(work, role, pairs)
        log.info("int8 %s, fp32 kept for %s: agreement %.4f on %d pairs", role.value, tier.name,
                 tried[tier.name], len(pairs))
        if tried[tier.name] >= spec.int8_target_agreement:
            break
    # a list, in the order tried (the manifest is written with sorted keys)
    quant["tier_agreement"] = {"pairs": len(pairs), "target": spec.int8_target_agreement,
                               "tried": [{"keep_fp32": k, "agreement": v} for k, v in tried.items()],
                               "reached": tried[quant["keep_fp32"]] >= spec.int8_target_agreement}
    _write_json(work / MANIFEST_NAME, manifest)


def run_export(req: ExportRequest) -> Path:
    """Export every role of a profile; returns the manifest path."""
    if req.heldout_limit is not None and req.heldout_limit < 1:
        raise ConfigError(f"--heldout-limit must be >= 1, got {req.heldout_limit}")
    if req.parity_inputs < 2 or req.parity_inputs % 2:
        raise ConfigError(f"--parity-inputs must be an even number >= 2 (half FEVER, half HotpotQA), "
                          f"got {req.parity_inputs}")
    if req.random_init:  # one real-size random model; the profile name only names the output
        from d2r_edge_export.tiny import RANDOM_MODELS

        if req.random_init not in RANDOM_MODELS:
            raise ConfigError(f"unknown --random-init {req.random_init!r}; known: "
                              f"{', '.join(sorted(RANDOM_MODELS))}")
        roles = {RANDOM_MODELS[req.random_init].role: f"random:{req.random_init}"}
    else:
        roles = load_profile(req.profile, req.profiles_file)
        roles.update(req.overrides)
    cache = req.models_dir / ".cache"
    absent = {r: s.removeprefix("absent:").strip() for r, s in roles.items() if s.startswith("absent:")}
    for r in absent:
        spec_for(r)
    # Resolve every source first: fail fast on an unreachable hub id or a bad directory.
    resolved = {Role(spec_for(r).role): resolve(r, s, cache, req.seed, req.data_dir, req.finetune)
                for r, s in roles.items() if r not in absent}
    final = req.models_dir / req.profile
    work = req.models_dir / f".{req.profile}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    manifest = {"format_version": MANIFEST_FORMAT_VERSION, "profile": req.profile,
                "created_unix_s": int(time.time()), "tools": _tools(), "roles": {}, "absent": absent}
    for role, src in resolved.items():
        manifest["roles"][role.value] = export_role(role, src, work, req.variants)
    _write_json(work / MANIFEST_NAME, manifest)
    calibration = load_parity_set(req.data_dir, n_pairs=min(CALIBRATION_PAIRS, req.heldout_limit or CALIBRATION_PAIRS),
                                  skip_heldout=True).pairs
    for role, src in resolved.items():
        if (role not in (Role.NLI, Role.RERANKER, Role.READER)
                or Variant.INT8.value not in manifest["roles"][role.value]["variants"]):
            continue
        if src.random_weights:
            # a random head's logits nearly tie, so int8 noise flips its labels whatever the
            # tier: agreement says nothing, and the search would only move MatMuls back to
            # fp32 and make the cost benchmarks measure a model nobody ships
            quant = manifest["roles"][role.value]["variants"][Variant.INT8.value]["quantization"]
            quant["tier_agreement"] = {"skipped": "random weights: labels are noise, all MatMuls stay int8"}
            continue
        settle_int8(work, manifest, role, calibration)
        if role is Role.NLI and Variant.FP32.value in manifest["roles"][role.value]["variants"]:
            settle_rescore_margin(work, manifest, calibration)
    # Parity through the runtime classes, against PyTorch; misses raise ParityError.
    data = load_parity_set(req.data_dir, n_pairs=req.parity_inputs)
    loaded = load_manifest(work)
    for role, src in resolved.items():
        t0 = time.perf_counter()
        variants = [Variant(v) for v in manifest["roles"][role.value]["variants"]]
        if role is Role.TRIPLES:
            figs = parity.seq2seq_parity(loaded, src.directory, data, variants)
        else:
            figs = parity.encoder_parity(loaded, role, SPECS[role], src.directory, data, variants,
                                         random_weights=src.random_weights)
        manifest["roles"][role.value]["parity"] = figs
        log.info("parity %s: %s (%.1f s)", role.value, json.dumps(figs), time.perf_counter() - t0)
    for role, src in resolved.items():
        if src.training is not None:
            from d2r_edge_export import finetune_eval
            from d2r_edge_export.finetune_data import build_pairs

            ts = src.training["settings"]   # the held-out sets depend on neither
            data_dir = Path(req.data_dir or parity.DEFAULT_DATA_DIR)
            if role is Role.READER:
                from d2r_edge_export.reader_data import build_reader_sets

                sets = build_reader_sets(data_dir, tuple(ts.get("exclude_files") or ()), ts["seed"])
                check = finetune_eval.validate_reader
            else:
                general = ts.get("nli_general_sources") if role is Role.NLI and ts.get("nli_general_epochs") else None
                sets = build_pairs(data_dir, ts["max_train_pairs"], ts["seed"],
                                   general_sources=general)     # FEVER-train pairs never enter the held-out sets
                check = finetune_eval.validate_nli if role is Role.NLI else finetune_eval.validate_reranker
            entry = manifest["roles"][role.value]
            entry["training"] = src.training
            entry["validation"] = {**check(loaded, limit_heldout(sets, req.heldout_limit)),
                                   "heldout_limit": req.heldout_limit}
            log.info("validation %s: %s", role.value, json.dumps(entry["validation"]))
    _write_json(work / MANIFEST_NAME, manifest)
    old = req.models_dir / f".{req.profile}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(work, final)
    shutil.rmtree(old, ignore_errors=True)
    return final / MANIFEST_NAME
