"""REBEL decoding on ONNX Runtime vs transformers.generate, including early EOS."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import pytest

from d2r_edge.onnx.manifest import Variant, load_manifest
from d2r_edge.onnx.seq2seq import Seq2SeqModel, Triples

pytestmark = pytest.mark.export
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def eos_prone(tmp_path_factory):
    """A tiny REBEL-shaped BART whose EOS bias ends beams at different steps."""
    torch = pytest.importorskip("torch")
    from d2r_edge_export.build import ExportRequest, run_export
    from d2r_edge_export.tiny import build_random_model
    from transformers import BartForConditionalGeneration

    warnings.filterwarnings("ignore")
    logging.getLogger("optimum").setLevel(logging.ERROR)
    tmp = tmp_path_factory.mktemp("eos")
    base = build_random_model("tiny-bart-rebel", tmp / "base", seed=3)
    model = BartForConditionalGeneration.from_pretrained(str(base))
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] += 4.0
    ckpt = tmp / "ckpt"
    model.save_pretrained(str(ckpt))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (ckpt / f.name).write_bytes(f.read_bytes())
    profiles = tmp / "profiles.toml"
    profiles.write_text(f'[eos]\ntriples = "{ckpt}"\n')
    manifest = run_export(ExportRequest("eos", models_dir=tmp / "models", profiles_file=profiles,
                                        variants=(Variant.FP32, Variant.INT8)))
    return model, load_manifest(manifest.parent)


TEXTS = ["The old bridge was designed by two famous architects in the spring of 1902.",
         "A chemist", "Which place flows into the eastern sea?",
         "The museum is located near a quiet valley and was renamed after the royal family."]


def _generate(model, ort, texts, **kw):
    import torch

    ids, mask = ort.encode(texts)
    with torch.no_grad():
        return model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              do_sample=False, **kw).numpy()


@pytest.mark.parametrize("max_new", [6, 20])
def test_greedy_and_beam_match_generate_with_early_eos(eos_prone, max_new):
    model, manifest = eos_prone
    ort = Seq2SeqModel(manifest, variant=Variant.FP32)
    lengths = set()
    for text in TEXTS:
        for beams in (1, 3):
            want = _generate(model, ort, [text], num_beams=beams, max_new_tokens=max_new)
            got = ort.beam_search([text], num_beams=beams, max_new_tokens=max_new)
            assert np.array_equal(want, got), (text, beams, want, got)
            lengths.add(got.shape[1])
    batch_want = _generate(model, ort, TEXTS, num_beams=1, max_new_tokens=max_new)
    assert np.array_equal(batch_want, ort.greedy(TEXTS, max_new))
    if max_new == 20:
        assert min(lengths) < 1 + max_new, "no sequence ended early: EOS path untested"


def test_padded_batch_beam_search_matches_generate(eos_prone):
    model, manifest = eos_prone
    ort = Seq2SeqModel(manifest, variant=Variant.FP32)
    want = _generate(model, ort, TEXTS[:3], num_beams=3, max_new_tokens=12)
    assert np.array_equal(want, ort.beam_search(TEXTS[:3], num_beams=3, max_new_tokens=12))


def test_triples_api_shapes(eos_prone):
    _, manifest = eos_prone
    tri = Triples(Seq2SeqModel(manifest, variant=Variant.INT8))
    assert tri.extract([]) == []
    out = tri.extract(TEXTS[:2] + [""], max_new_tokens=8)
    assert len(out) == 3 and all(isinstance(t, list) for t in out)
    tri.model.warmup()
