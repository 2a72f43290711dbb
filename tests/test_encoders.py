"""Runtime encoders: batching is invisible, labels come from id2label."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from d2r_edge.onnx.encoders import NLI, BatchConfig, CrossEncoder, Embedder, token_batches
from d2r_edge.onnx.manifest import Variant, load_manifest
from d2r_edge.onnx.seq2seq import Triple, parse_triples


@given(st.lists(st.integers(1, 300), max_size=60), st.integers(1, 2000), st.integers(1, 16))
def test_token_batches_cover_every_index_once_within_budget(lengths, budget, rows):
    cfg = BatchConfig(max_batch_tokens=budget, max_batch_rows=rows)
    batches = token_batches(lengths, cfg)
    seen = np.concatenate(batches) if batches else np.array([], dtype=int)
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= rows
        # a batch exceeds the budget only when a single item alone does
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= budget


def test_batched_scores_equal_one_by_one_in_caller_order(tiny_models, shared_data):
    from d2r_edge_export.parity_data import load_parity_set

    pairs = load_parity_set(shared_data, n_pairs=20).pairs
    manifest = load_manifest(tiny_models)
    small = NLI(manifest, variant=Variant.FP32, allow_random_weights=True,
                batch=BatchConfig(max_batch_tokens=600))
    single = np.stack([small.logits([p])[0] for p in pairs])
    batched = small.logits(pairs)
    assert np.allclose(batched, single, atol=1e-4)
    emb = Embedder(manifest, variant=Variant.FP32, batch=BatchConfig(max_batch_tokens=300))
    texts = [q for _, q in pairs]
    one = np.stack([emb.encode([t])[0] for t in texts])
    assert np.allclose(emb.encode(texts), one, atol=1e-5)
    assert np.allclose(np.linalg.norm(one, axis=1), 1.0, atol=1e-5)


def test_nli_labels_follow_id2label(tiny_models):
    nli = NLI(load_manifest(tiny_models), allow_random_weights=True)
    assert nli.labels == ["entailment", "neutral", "contradiction"]
    assert nli.entry.label_index("Contradiction") == 2


def test_cpu_token_budget_is_per_kind_of_input(tiny_models):
    """Pair encoders batch in 256 tokens on a CPU, the embedder in 512; an explicit budget wins."""
    from d2r_edge.onnx.session import Device, SessionConfig

    cpu, m = SessionConfig(device=Device.CPU), load_manifest(tiny_models)
    assert NLI(m, session=cpu, allow_random_weights=True).batch.max_batch_tokens == 256
    assert CrossEncoder(m, session=cpu, allow_random_weights=True).batch.max_batch_tokens == 256
    assert Embedder(m, session=cpu).batch.max_batch_tokens == 512
    mine = BatchConfig(max_batch_tokens=4096)
    assert NLI(m, session=cpu, batch=mine, allow_random_weights=True).batch.max_batch_tokens == 4096


def test_real_minilm_similarity_is_meaningful(tiny_models):
    emb = Embedder(load_manifest(tiny_models))
    v = emb.encode(["A cat sits on the mat.", "A kitten is sitting on a rug.",
                    "Quarterly revenue rose by four percent."])
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2


def test_cross_encoder_scores_each_passage(tiny_models):
    ce = CrossEncoder(load_manifest(tiny_models), allow_random_weights=True)
    scores = ce.score("who designed the bridge", ["the bridge", "a river", "the museum"])
    assert scores.shape == (3,) and np.isfinite(scores).all()


def test_parse_triples_reads_rebel_linearization():
    text = ("<s><triplet> Punta Cana <subj> Dominican Republic <obj> country "
            "<subj> Higüey <obj> located in <triplet> Higüey <subj> La Altagracia <obj> "
            "located in the administrative territorial entity</s>")
    assert parse_triples(text) == [
        Triple("Punta Cana", "country", "Dominican Republic"),
        Triple("Punta Cana", "located in", "Higüey"),
        Triple("Higüey", "located in the administrative territorial entity", "La Altagracia"),
    ]
    assert parse_triples("<triplet> only a head <obj> rel") == []
    assert parse_triples("") == []
    # hypothesis found it: a blank relation ("<s>" is noise) once slipped through at the next marker
    assert parse_triples("<triplet>0<subj>0<obj><s><triplet>") == []


@settings(max_examples=300)
@given(st.lists(st.one_of(st.sampled_from(["<triplet>", "<subj>", "<obj>", "<s>", "</s>",
                                           "<pad>", " ", "x"]), st.text(max_size=8)),
                max_size=40))
def test_parse_triples_never_raises(pieces):
    out = parse_triples("".join(pieces))
    assert all(t.head and t.relation and t.tail for t in out)


def test_int8_nli_rescores_exactly_its_near_ties_in_fp32(tiny_models, shared_data, tmp_path):
    """The manifest's fp32_rescore_margin sends pairs whose int8 top-2 margin is below it to fp32."""
    import json
    import shutil

    from d2r_edge_export.parity_data import load_parity_set

    from d2r_edge.onnx.encoders import top2_margin

    pairs = load_parity_set(shared_data, n_pairs=24).pairs
    prof = tmp_path / "tiny"
    shutil.copytree(tiny_models, prof)
    raw = NLI(load_manifest(prof), allow_random_weights=True)
    assert raw.fp32 is None and raw.rescore_margin == 0.0          # nothing recorded: int8 as is
    q = raw.logits(pairs)
    ref = NLI(load_manifest(prof), variant=Variant.FP32, allow_random_weights=True).logits(pairs)
    assert not np.allclose(q, ref, atol=1e-6)
    margin = float(np.median(top2_margin(q)))
    path = prof / "manifest.json"
    data = json.loads(path.read_text())
    data["roles"]["nli"]["variants"]["int8"]["quantization"]["fp32_rescore_margin"] = margin
    path.write_text(json.dumps(data))
    served = NLI(load_manifest(prof), allow_random_weights=True)
    out = served.logits(pairs)
    ties = top2_margin(q) < margin
    assert 0 < ties.sum() < len(pairs) and served.rescored_pairs == ties.sum()
    assert np.allclose(out[ties], ref[ties], atol=1e-5)
    assert np.array_equal(out[~ties], q[~ties])
    off = NLI(load_manifest(prof), allow_random_weights=True, near_tie_fp32=False)
    assert off.fp32 is None and np.array_equal(off.logits(pairs), q)
