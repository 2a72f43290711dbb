"""Parity of exported ONNX variants against the PyTorch source, through the runtime classes.

The figures go into the manifest; a miss beyond the role's bounds raises
ParityError, so an export that disagrees with its checkpoint never lands.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from d2r_edge_export.parity_data import DEFAULT_DATA_DIR, ParitySet  # noqa: F401 (re-exported)
from d2r_edge_export.specs import RoleSpec

from d2r_edge.errors import ParityError
from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder, Reader
from d2r_edge.onnx.manifest import Manifest, Role, Variant
from d2r_edge.onnx.seq2seq import Seq2SeqModel
from d2r_edge.onnx.session import Device, SessionConfig

log = logging.getLogger(__name__)

CPU = SessionConfig(device=Device.CPU)
_ENCODERS = {Role.NLI: NLI, Role.RERANKER: CrossEncoder, Role.EMBEDDER: Embedder, Role.READER: Reader}


def _torch_forward(model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    if hasattr(out, "start_logits"):        # a reader: start and end logits side by side
        return torch.cat([out.start_logits, out.end_logits], dim=-1).float().numpy()
    first = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return first.float().numpy()


def _mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float64)
    pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def _load_torch(role: Role, checkpoint: Path):
    from transformers import (AutoModel, AutoModelForQuestionAnswering, AutoModelForSeq2SeqLM,
                              AutoModelForSequenceClassification)

    cls = {Role.NLI: AutoModelForSequenceClassification, Role.READER: AutoModelForQuestionAnswering,
           Role.RERANKER: AutoModelForSequenceClassification,
           Role.EMBEDDER: AutoModel, Role.TRIPLES: AutoModelForSeq2SeqLM}[role]
    return cls.from_pretrained(str(checkpoint)).eval()


def _fail(role: Role, what: str, got: float, bound: float) -> None:
    raise ParityError(
        f"role {role.value}: {what} = {got:.6g} misses the bound {bound:g}; the export "
        f"disagrees with the checkpoint (re-export; if it persists, report the model)"
    )


# each role's agreement figure of a low-precision variant with fp32: (its key in the figures, its name in a failure)
_AGREEMENT = {Role.NLI: ("label_agreement_vs_fp32", "label agreement vs fp32"),
              Role.READER: ("span_agreement_vs_fp32", "span agreement vs fp32"),
              Role.RERANKER: ("pairwise_order_agreement_vs_fp32", "pairwise order agreement")}


def agreement_vs_fp32(role: Role, fp32, other, pairs: list[tuple[str, str]]) -> float:
    """Label agreement (NLI) or pairwise order agreement (reranker) of `other` with `fp32`.

    pairs are (passage, question); the reranker scores them as (question, passage); the reader
    agrees when it reads the same span from the passage.
    """
    if role is Role.READER:
        return float(np.mean([fp32.read(q, [p]).text == other.read(q, [p]).text for p, q in pairs]))
    if role is Role.NLI:
        return float(np.mean(fp32.score(pairs).argmax(axis=1) == other.score(pairs).argmax(axis=1)))
    a, b = (m.score_pairs([(q, p) for p, q in pairs]) for m in (fp32, other))
    i, j = np.triu_indices(len(a), k=1)
    return float(np.mean(np.sign(a[i] - a[j]) == np.sign(b[i] - b[j])))


def encoder_parity(manifest: Manifest, role: Role, spec: RoleSpec, checkpoint: Path,
                   data: ParitySet, variants: list[Variant], random_weights: bool = False) -> dict:
    """`random_weights`: a random reader's span logits nearly tie, so which span wins under int8 noise says
    nothing of the export; its agreement is recorded, not enforced (the logit bounds still are)."""
    model = _load_torch(role, checkpoint)
    cls = _ENCODERS[role]
    runs = {v: cls(manifest, variant=v, session=CPU, allow_random_weights=True) for v in variants}
    ref = runs[Variant.FP32]
    inputs = data.sentences if role is Role.EMBEDDER else data.pairs
    if role is Role.READER:
        inputs = [(q, p) for p, q in data.pairs]       # (question, passage), the passage cut
    truncate = "only_second" if role in (Role.RERANKER, Role.READER) else "only_first"
    encs = (ref._encode(texts=inputs) if role is Role.EMBEDDER
            else ref._encode(pairs=inputs, truncate=truncate))
    feeds = ref._feeds(encs)
    torch_out = _torch_forward(model, feeds)
    figures: dict = {"n_inputs": len(inputs), "set": data.name}
    width = 2 if role is Role.READER else 1
    outs = {v: np.concatenate(r.session.run(r.output_names[:width], {k: feeds[k] for k in r.input_names}), axis=-1)
            for v, r in runs.items()}
    for v, out in outs.items():
        if role is Role.EMBEDDER:
            a, b = _mean_pool(torch_out, feeds["attention_mask"]), _mean_pool(out, feeds["attention_mask"])
            cos = float(np.min(np.sum(a * b, axis=1)))
            fig = {"min_cosine_vs_torch": cos, "max_abs_diff_vs_torch": float(np.abs(a - b).max())}
            bound = 0.99999 if v is Variant.FP32 else (spec.int8_min_cosine if v is Variant.INT8 else 0.999)
            if cos < bound:
                _fail(role, f"{v.value} min cosine vs torch", cos, bound)
        else:
            diff = float(np.abs(out - torch_out).max())
            fig = {"max_abs_logit_diff_vs_torch": diff}
            if v is Variant.FP32 and diff > spec.fp32_max_abs_diff:
                _fail(role, "fp32 max abs logit diff", diff, spec.fp32_max_abs_diff)
            if v is Variant.FP16 and diff > spec.fp16_max_abs_diff * max(1.0, float(np.abs(torch_out).max())):
                _fail(role, "fp16 max abs logit diff", diff, spec.fp16_max_abs_diff)
        figures[v.value] = fig
    # label/ranking/span agreement of low-precision variants with fp32, via the public API
    if role in _AGREEMENT:
        key, what = _AGREEMENT[role]
        enforced = not (role is Role.READER and random_weights)
        for v in variants:
            if v is Variant.FP32:
                continue
            agree = agreement_vs_fp32(role, ref, runs[v], data.pairs)
            figures[v.value][key] = agree
            if agree < spec.int8_min_label_agreement and enforced:
                _fail(role, f"{v.value} {what}", agree, spec.int8_min_label_agreement)
    return figures


def _beam_parity(model, ort_model: Seq2SeqModel, texts: list[str], max_new_tokens: int) -> bool:
    """ORT beam search (3 beams) must give generate(num_beams=3)'s ids, row by row."""
    import torch

    for text in texts:
        ids, mask = ort_model.encode([text])
        got = ort_model.beam_search([text], num_beams=3, max_new_tokens=max_new_tokens)
        with torch.no_grad():
            want = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                  num_beams=3, do_sample=False, max_new_tokens=max_new_tokens).numpy()
        if want.shape != got.shape or not np.array_equal(want, got):
            raise ParityError(
                f"role triples: fp32 beam search (3 beams) differs from transformers.generate "
                f"({got.tolist()} vs {want.tolist()})"
            )
    return True


def seq2seq_parity(manifest: Manifest, checkpoint: Path, data: ParitySet,
                   variants: list[Variant], max_new_tokens: int = 24) -> dict:
    """fp32 greedy ids must equal transformers.generate(num_beams=1) exactly."""
    import torch

    model = _load_torch(Role.TRIPLES, checkpoint)
    texts = data.sentences[:4]
    figures: dict = {"set": data.name, "max_new_tokens": max_new_tokens}
    ref_ids = None
    for v in variants:
        ort_model = Seq2SeqModel(manifest, variant=v, session=CPU, allow_random_weights=True)
        cases = {"single": texts[:1], "padded_batch": texts}
        fig = {}
        for case, batch in cases.items():
            ids, mask = ort_model.encode(batch)
            got = ort_model.greedy(batch, max_new_tokens)
            if v is Variant.FP32:
                with torch.no_grad():
                    want = model.generate(input_ids=torch.from_numpy(ids),
                                          attention_mask=torch.from_numpy(mask),
                                          num_beams=1, do_sample=False,
                                          max_new_tokens=max_new_tokens).numpy()
                same = want.shape == got.shape and bool(np.array_equal(want, got))
                fig[f"{case}_greedy_ids_equal_generate"] = same
                if not same:
                    raise ParityError(
                        f"role triples: fp32 greedy ids differ from transformers.generate "
                        f"({case}: {got.tolist()[:1]} vs {want.tolist()[:1]})"
                    )
                if case == "padded_batch":
                    ref_ids = got
                    fig["beam3_ids_equal_generate"] = _beam_parity(model, ort_model, batch,
                                                                   max_new_tokens)
            elif case == "padded_batch" and ref_ids is not None:
                n = min(got.shape[1], ref_ids.shape[1])
                fig["token_agreement_vs_fp32"] = float(np.mean(got[:, :n] == ref_ids[:, :n]))
        figures[v.value] = fig
    return figures
