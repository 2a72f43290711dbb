"""Held-out figures of the offline models, computed through the runtime (ONNX int8 and fp32)."""

from __future__ import annotations

import re

import numpy as np
from d2r_edge_export.finetune_data import PairSets, heldout_probe
from d2r_edge_export.nli_general import CON, ENT, ID2LABEL, NEU

from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder
from d2r_edge.onnx.manifest import Manifest, Variant
from d2r_edge.retrieval.bm25 import BM25Index

_WORD = re.compile(r"\w+")
_NEG = {"not", "no", "never", "nor", "none", "nobody", "nothing", "only", "incapable", "unable", "refused",
        "failed", "without"}


def _f1s(pred: np.ndarray, gold: np.ndarray) -> dict:
    out = {}
    for lab, name in ID2LABEL.items():
        tp = np.sum((pred == lab) & (gold == lab))
        prec = tp / max(1, np.sum(pred == lab))
        rec = tp / max(1, np.sum(gold == lab))
        out[name] = float(2 * prec * rec / max(1e-9, prec + rec))
    return out


def _overlap_features(premise: str, hyp: str) -> tuple[float, bool]:
    p, h = set(_WORD.findall(premise.lower())), _WORD.findall(hyp.lower())
    overlap = sum(w in p for w in h) / max(1, len(h))
    return overlap, bool((set(h) & _NEG) ^ (p & _NEG))


def lexical_baseline(train: list, val: list) -> np.ndarray:
    """Overlap below t -> neutral; else a negation mismatch -> contradiction; else entailment (t fit on train)."""
    def predict(rows, t):
        out = []
        for p, h, _ in rows:
            ov, neg = _overlap_features(p, h)
            out.append(NEU if ov < t else (CON if neg else ENT))
        return np.array(out)
    gold = np.array([lab for _, _, lab in train])
    best = max(np.linspace(0.1, 0.95, 18), key=lambda t: float(np.mean(predict(train, t) == gold)))
    return predict(val, best)


def validate_nli(manifest: Manifest, sets: PairSets) -> dict:
    val = sets.nli_val
    gold = np.array([lab for _, _, lab in val])
    pairs = [(p, h) for p, h, _ in val]
    models = {v: NLI(manifest, variant=v) for v in (Variant.INT8, Variant.FP32)}   # int8 as served
    preds = {v: m.score(pairs).argmax(axis=1) for v, m in models.items()}
    rescored = models[Variant.INT8].rescored_pairs
    raw_int8 = NLI(manifest, variant=Variant.INT8, near_tie_fp32=False).score(pairs).argmax(axis=1)
    majority = np.bincount([lab for _, _, lab in sets.nli_train]).argmax()
    lex = lexical_baseline(sets.nli_train, val)
    table = {}
    for name, pred in (("model_int8", preds[Variant.INT8]), ("model_fp32", preds[Variant.FP32]),
                       ("majority_class", np.full(len(gold), majority)), ("lexical_overlap", lex)):
        table[name] = {"accuracy": float(np.mean(pred == gold)), "f1": _f1s(pred, gold)}
    # the held-out claims mutated (negation flipped, number changed): a model that ignores
    # "not" or the numbers scores about 0.5 here whatever its accuracy above
    probe = {}
    for kind, rows in heldout_probe(val).items():
        pg = np.array([lab for _, _, lab in rows])
        pred = models[Variant.INT8].score([(p, h) for p, h, _ in rows]).argmax(axis=1)
        probe[kind] = {"pairs": len(rows), "model_int8_accuracy": float(np.mean(pred == pg)),
                       "lexical_overlap_accuracy": float(np.mean(lexical_baseline(sets.nli_train, rows) == pg))}
    # general ability: held-out MultiNLI / ANLI dev pairs (never trained on; export/nli_general.py)
    general = {}
    for group, rows in (sets.general.heldout.items() if sets.general else ()):
        pg = np.array([lab for _, _, lab in rows])
        pairs_g = [(p, h) for p, h, _ in rows]
        general[group] = {"pairs": len(rows), **{
            f"model_{v.value}_accuracy": float(np.mean(m.score(pairs_g).argmax(axis=1) == pg))
            for v, m in models.items()}}
    return {"heldout_fever_pairs": len(val), "heldout_general": general,
            "gold_counts": {ID2LABEL[k]: int(np.sum(gold == k)) for k in ID2LABEL},
            "table": table,
            "int8_fp32_label_agreement": float(np.mean(preds[Variant.INT8] == preds[Variant.FP32])),
            "int8_rescore_margin": models[Variant.INT8].rescore_margin,
            "int8_share_rescored_fp32": rescored / max(1, len(pairs)),
            "int8_raw_fp32_label_agreement": float(np.mean(raw_int8 == preds[Variant.FP32])),
            "model_int8_raw_accuracy": float(np.mean(raw_int8 == gold)),
            "mutation_probe": probe}


def _rank_metrics(scores_per_q: list[np.ndarray], gold: list[list[int]], k: int = 3) -> dict:
    rec, mrr = [], []
    for s, g in zip(scores_per_q, gold):
        order = list(np.argsort(-s, kind="stable"))
        rec.append(len(set(order[:k]) & set(g)) / len(g))
        mrr.append(1.0 / (1 + min(order.index(i) for i in g)))
    return {f"recall@{k}": float(np.mean(rec)), "mrr": float(np.mean(mrr))}


def validate_reranker(manifest: Manifest, sets: PairSets) -> dict:
    """Recall@3 / MRR of the supporting paragraphs among each held-out question's 10."""
    qs = [q for q in sets.rerank_val if q["gold"]]
    ce = {v: CrossEncoder(manifest, variant=v) for v in (Variant.INT8, Variant.FP32)}
    emb = Embedder(manifest, variant=Variant.INT8)
    cross: dict[Variant, list] = {v: [] for v in ce}
    bm25s, bienc = [], []
    for q in qs:
        for v, model in ce.items():
            cross[v].append(model.score(q["question"], q["paragraphs"]))
        idx = BM25Index()
        idx.add(q["paragraphs"])
        bm25s.append(idx.scores(q["question"]))
        e = emb.encode([q["question"]] + q["paragraphs"])
        bienc.append(e[1:] @ e[0])
    gold = [q["gold"] for q in qs]
    top3 = [float(np.mean(set(np.argsort(-a)[:3]) == set(np.argsort(-b)[:3])))
            for a, b in zip(cross[Variant.INT8], cross[Variant.FP32])]
    return {"heldout_hotpotqa_questions": len(qs),
            "paragraphs_per_question": sorted({len(q["paragraphs"]) for q in qs}),
            "cross_encoder_int8": _rank_metrics(cross[Variant.INT8], gold),
            "cross_encoder_fp32": _rank_metrics(cross[Variant.FP32], gold),
            "int8_fp32_same_top3": float(np.mean(top3)) if top3 else None,
            "bm25": _rank_metrics(bm25s, gold), "minilm_bi_encoder": _rank_metrics(bienc, gold)}


def validate_reader(manifest: Manifest, sets) -> dict:
    """EM / token F1 of the reader on held-out questions (export/reader_data.py), reading all of each
    question's paragraphs (10 to 20, mostly distractors) as the runtime reads its top passages; the
    baseline answers with the title of the paragraph BM25 ranks first (bridge entities are titles)."""
    from d2r_edge.answers import exact_match, token_f1
    from d2r_edge.onnx.encoders import Reader

    qs = sets.val
    readers = {v: Reader(manifest, variant=v) for v in (Variant.INT8, Variant.FP32)}
    out: dict = {"heldout_questions": len(qs), "sources": {}}
    for v, reader in readers.items():
        spans = [reader.read(q.question, q.passages) for q in qs]
        em = [exact_match(s.text, q.answers) for s, q in zip(spans, qs)]
        f1 = [token_f1(s.text, q.answers) for s, q in zip(spans, qs)]
        conf = np.array([s.confidence for s in spans])
        out[f"reader_{v.value}"] = {"em": float(np.mean(em)), "f1": float(np.mean(f1)),
                                    "median_confidence": float(np.median(conf)) if len(conf) else None}
        if v is Variant.INT8:
            for src in sorted({q.source for q in qs}):
                idx = [i for i, q in enumerate(qs) if q.source == src]
                out["sources"][src] = {"questions": len(idx), "em": float(np.mean([em[i] for i in idx])),
                                       "f1": float(np.mean([f1[i] for i in idx]))}
            # does its confidence say when it is right? (the detector's use of it)
            right = np.array(em) > 0
            if right.any() and (~right).any():
                from d2r_edge.eval.detection import auroc

                out["confidence_auroc_right_vs_wrong"] = float(auroc(conf, right))
    titles = []
    for q in qs:
        idx = BM25Index()
        idx.add(list(q.passages))
        titles.append(q.passages[int(np.argmax(idx.scores(q.question)))].split("\n", 1)[0])
    out["bm25_top_title"] = {"em": float(np.mean([exact_match(t, q.answers) for t, q in zip(titles, qs)])),
                             "f1": float(np.mean([token_f1(t, q.answers) for t, q in zip(titles, qs)]))}
    return out
