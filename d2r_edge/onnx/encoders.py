"""Encoder-only roles on ONNX Runtime: NLI, cross-encoder reranker, embedder.

Texts are tokenized with the exported `tokenizer.json`, sorted by length and
cut into batches under a token budget (padding to the longest in a batch),
then put back in the caller's order: callers never see batch boundaries.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from d2r_edge.errors import ConfigError, InputError
from d2r_edge.onnx.manifest import Manifest, Role, RoleEntry, Variant
from d2r_edge.onnx.session import SessionConfig, on_cuda, open_session, run

log = logging.getLogger(__name__)


# Measured on 2-core AVX-512 CPUs (20 NLI pairs of 64-333 tokens, deberta-v3-base
# int8). Session 1: a 256-token budget ran in 1.59 s, 512 in 1.74 s, 1024 in
# 1.99 s, one unbounded batch in 5.06 s. Another machine later: one pair per run
# 1.21 s, 256 1.20 s, 384 1.26 s, 512 1.36 s, 1024 1.37 s. So pair encoders
# (long passage + claim inputs, attention cost grows with the square of the
# padded length) batch in 256 tokens; MiniLM embedding of short chunks was
# fastest at 512-1024. Big batches spill the attention intermediates out of
# cache on a CPU; a GPU wants them big.
CPU_BATCH_TOKENS = 512
CPU_PAIR_BATCH_TOKENS = 256
CUDA_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class BatchConfig:
    """Token budget of one ONNX run (batch rows x padded length); None = by device."""

    max_batch_tokens: int | None = None
    max_batch_rows: int = 64

    def __post_init__(self) -> None:
        if (self.max_batch_tokens is not None and self.max_batch_tokens < 1) or self.max_batch_rows < 1:
            raise ConfigError("max_batch_tokens (or None) and max_batch_rows must be >= 1")

    def for_session(self, session, cpu_tokens: int = CPU_BATCH_TOKENS) -> "BatchConfig":
        if self.max_batch_tokens is not None:
            return self
        tokens = CUDA_BATCH_TOKENS if on_cuda(session) else cpu_tokens
        return BatchConfig(max_batch_tokens=tokens, max_batch_rows=self.max_batch_rows)


def check_text(text: object, index: int) -> str:
    """A text that can be UTF-8 encoded, or a typed error naming the item."""
    if not isinstance(text, str):
        raise InputError(f"item {index}: expected str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"item {index}: text is not valid Unicode ({exc.reason} at {exc.start}); "
            f"decode your input with errors='replace' first"
        ) from None
    return text


def load_tokenizer(entry: RoleEntry, max_length_tokens: int | None = None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(entry.tokenizer_path()))
    tok.no_padding()  # the packaged MiniLM tokenizer pads to a fixed 128 otherwise
    tok.enable_truncation(max_length_tokens or entry.max_length_tokens)
    return tok


def token_batches(lengths: Sequence[int], cfg: BatchConfig) -> list[np.ndarray]:
    """Index batches in ascending length order, each under the token budget."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    budget = cfg.max_batch_tokens or CPU_BATCH_TOKENS
    batches, current, longest = [], [], 0
    for idx in order:
        n = int(lengths[idx])
        grown = max(longest, n)
        if current and (grown * (len(current) + 1) > budget
                        or len(current) >= cfg.max_batch_rows):
            batches.append(np.asarray(current))
            current, grown = [], n
        current.append(int(idx))
        longest = grown
    if current:
        batches.append(np.asarray(current))
    return batches


class _Encoder:
    """Shared plumbing: one session, one tokenizer, feeds named by the model."""

    role: Role
    cpu_batch_tokens: int = CPU_BATCH_TOKENS

    def __init__(self, manifest: Manifest, *, variant: Variant = Variant.INT8,
                 session: SessionConfig = SessionConfig(), batch: BatchConfig = BatchConfig(),
                 allow_random_weights: bool = False) -> None:
        self.entry = manifest.role(self.role, allow_random_weights=allow_random_weights)
        paths = self.entry.variant_paths(variant)
        self.variant = variant
        self.session = open_session(paths["model.onnx"], session)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.tokenizer = load_tokenizer(self.entry)
        self._pair_toks: dict[str, object] = {}
        self._lock = threading.Lock()
        self.batch = batch.for_session(self.session, self.cpu_batch_tokens)
        self.pad_id = self._pad_id()

    def _pad_id(self) -> int:
        for token in ("[PAD]", "<pad>", "<PAD>"):
            idx = self.tokenizer.token_to_id(token)
            if idx is not None:
                return idx
        return 0

    def _encode(self, texts: Sequence[str] | None = None,
                pairs: Sequence[tuple[str, str]] | None = None,
                truncate: str = "only_first") -> list:
        """Encodings; for pairs, `truncate` names the member cut first (the passage)."""
        if pairs is None:
            texts = [check_text(t, i) for i, t in enumerate(texts or [])]
            return self.tokenizer.encode_batch(texts)
        pairs = [(check_text(a, i), check_text(b, i)) for i, (a, b) in enumerate(pairs)]
        tok = self._pair_tokenizer(truncate)
        try:
            return tok.encode_batch(pairs)
        except Exception:
            # Some member alone overflows: cut both for those (rare).
            out = []
            for a, b in pairs:
                try:
                    out.append(tok.encode(a, b))
                except Exception:
                    out.append(self._pair_tokenizer("longest_first").encode(a, b))
            return out

    def _pair_tokenizer(self, strategy: str):
        """A tokenizer whose pair truncation is `strategy`, made once per strategy and never changed:
        switching one shared tokenizer's truncation per call raced between threads."""
        tok = self._pair_toks.get(strategy)
        if tok is None:
            with self._lock:
                tok = self._pair_toks.get(strategy)
                if tok is None:
                    from tokenizers import Tokenizer

                    tok = Tokenizer.from_str(self.tokenizer.to_str())
                    tok.no_padding()
                    tok.enable_truncation(self.entry.max_length_tokens, strategy=strategy)
                    self._pair_toks[strategy] = tok
        return tok

    def _feeds(self, encs: list) -> dict[str, np.ndarray]:
        width = max(len(e.ids) for e in encs)
        ids = np.full((len(encs), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encs), width), dtype=np.int64)
        types = np.zeros((len(encs), width), dtype=np.int64)
        for row, enc in enumerate(encs):
            n = len(enc.ids)
            ids[row, :n] = enc.ids
            mask[row, :n] = 1
            types[row, :n] = enc.type_ids
        table = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return {name: table[name] for name in self.input_names}

    def _run(self, encs: list) -> list[tuple[np.ndarray, np.ndarray]]:
        """(first output, attention mask) per batch, with the batch's indices."""
        out = []
        for idx in token_batches([len(e.ids) for e in encs], self.batch):
            feeds = self._feeds([encs[i] for i in idx])
            result = run(self.session, self.output_names[:1], feeds)[0]
            out.append((idx, result, feeds["attention_mask"]))
        return out

    def warmup(self) -> None:
        """One small run so the first real call does not pay allocation costs."""
        self._run(self._encode(texts=["warm up"]))


class NLI(_Encoder):
    """3-way NLI cross-encoder; labels come from the manifest's `id2label`.

    int8 near ties: dynamic int8 moves the logits a little, which flips the
    label only where the top two probabilities nearly tie (every int8/fp32
    disagreement on the held-out FEVER pairs had an fp32 margin <= 0.10).
    When the export recorded `fp32_rescore_margin` for the int8 variant,
    pairs whose int8 top-2 probability margin is below it are scored again
    by the fp32 model (loaded with the int8 one, so no action pays for it;
    a few percent of the pairs). `near_tie_fp32=False` serves raw int8.
    """

    role = Role.NLI
    cpu_batch_tokens = CPU_PAIR_BATCH_TOKENS

    def __init__(self, manifest: Manifest, *, variant: Variant = Variant.INT8,
                 session: SessionConfig = SessionConfig(), batch: BatchConfig = BatchConfig(),
                 allow_random_weights: bool = False, near_tie_fp32: bool = True) -> None:
        super().__init__(manifest, variant=variant, session=session, batch=batch,
                         allow_random_weights=allow_random_weights)
        self.rescore_margin = 0.0
        self.fp32: NLI | None = None
        self.rescored_pairs = 0                 # how many pairs went to fp32 so far
        margin = self.entry.rescore_margin
        if near_tie_fp32 and variant is Variant.INT8 and margin > 0 and Variant.FP32 in self.entry.variants:
            self.fp32 = NLI(manifest, variant=Variant.FP32, session=session, batch=batch,
                            allow_random_weights=allow_random_weights, near_tie_fp32=False)
            self.rescore_margin = margin

    @property
    def labels(self) -> list[str]:
        return [self.entry.id2label[i] for i in sorted(self.entry.id2label)]

    def logits(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Raw logits, shape (n, n_labels), columns in `id2label` order."""
        pairs = list(pairs)
        n_labels = len(self.entry.id2label)
        if not pairs:
            return np.zeros((0, n_labels), dtype=np.float32)
        encs = self._encode(pairs=pairs)
        out = np.empty((len(pairs), n_labels), dtype=np.float32)
        for idx, logits, _ in self._run(encs):
            out[idx] = logits
        if self.fp32 is not None:
            ties = np.flatnonzero(top2_margin(out) < self.rescore_margin)
            if ties.size:
                out[ties] = self.fp32.logits([pairs[i] for i in ties])
                self.rescored_pairs += int(ties.size)
        return out

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Probabilities (softmax over labels), shape (n, n_labels); (premise, hypothesis)."""
        logits = self.logits(pairs).astype(np.float64)
        if logits.size == 0:
            return logits.astype(np.float32)
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        return (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """Softmax probability of the top label minus the runner-up's, per row."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = np.sort(p, axis=1)
    return top[:, -1] - top[:, -2]


class CrossEncoder(_Encoder):
    """1-logit relevance cross-encoder over (query, passage)."""

    role = Role.RERANKER
    cpu_batch_tokens = CPU_PAIR_BATCH_TOKENS

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        pairs = list(pairs)
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        out = np.empty(len(pairs), dtype=np.float32)
        # (query, passage) as ms-marco cross-encoders are trained: cut the passage
        encs = self._encode(pairs=pairs, truncate="only_second")
        for idx, logits, _ in self._run(encs):
            out[idx] = logits.reshape(len(idx), -1)[:, 0]
        return out

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """Relevance logit of each passage for the query (higher = more relevant)."""
        return self.score_pairs([(query, p) for p in passages])


class Embedder(_Encoder):
    """Mean-pooled, L2-normalized sentence vectors (sentence-transformers pooling)."""

    role = Role.EMBEDDER

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        encs = self._encode(texts=texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for idx, hidden, mask in self._run(encs):
            m = mask[..., None].astype(np.float32)
            pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
            norm = np.linalg.norm(pooled, axis=1, keepdims=True)
            out[idx] = pooled / np.maximum(norm, 1e-12)
        return out

    @property
    def dim(self) -> int:
        return int(self.session.get_outputs()[0].shape[-1])

    @property
    def space_id(self) -> str:
        """Which embedding space this is, for a policy's context spec: the exported weights'
        sha256, shared by every precision variant of one checkpoint (else the sha256 of the fp32
        graph files). An index pins more: retrieval.kb.embedder_fingerprint adds the variant."""
        src = self.entry.source
        if src.get("weights_sha256"):
            return f"weights:{src['weights_sha256']}"
        files = self.entry.variants.get(Variant.FP32) or self.entry.variants[self.variant]
        digest = hashlib.sha256("".join(files[n].sha256 for n in sorted(files)).encode()).hexdigest()
        return f"onnx:{digest}"


@dataclass(frozen=True)
class Span:
    """The reader's answer to a question: a span of one passage (issue 53)."""

    text: str
    passage: int            # index of the passage it was read from
    confidence: float       # softmax share of this span among every passage's best span and "no answer"
    no_answer: bool         # "no passage holds the answer" scored above every span (text is then the best one)

    def to_json(self) -> dict:
        return {"text": self.text, "passage": self.passage, "confidence": self.confidence,
                "no_answer": self.no_answer}


MAX_ANSWER_TOKENS = 30      # the longest span the reader returns (SQuAD readers use 30)


def best_span(start: np.ndarray, end: np.ndarray, allowed: np.ndarray,
              max_tokens: int = MAX_ANSWER_TOKENS) -> tuple[int, int, float]:
    """The (i, j) with i <= j < i + max_tokens, both allowed, maximizing start[i] + end[j]; with its score.
    (-1, -1, -inf) when no token is allowed."""
    n = len(start)
    s = np.where(allowed, start, -np.inf)
    e = np.where(allowed, end, -np.inf)
    if not np.isfinite(s).any():
        return -1, -1, -np.inf
    width = min(max_tokens, n)
    padded = np.concatenate([e, np.full(width - 1, -np.inf)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)      # (n, width): end[i .. i+width-1]
    with np.errstate(invalid="ignore"):
        total = s[:, None] + windows
    flat = int(np.nanargmax(np.where(np.isnan(total), -np.inf, total)))
    i, k = divmod(flat, width)
    return i, i + k, float(total[i, k])


class Reader(_Encoder):
    """Extractive QA over (question, passage) pairs: start/end logits per token, the best span of each
    passage, the best of all. The no-answer score of a passage is its [CLS] start + end logit; the
    question's is the lowest over its passages (the passage most likely to hold an answer decides)."""

    role = Role.READER
    cpu_batch_tokens = CPU_PAIR_BATCH_TOKENS

    def logits(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[np.ndarray, np.ndarray, object]]:
        """(start, end, encoding) per (question, passage) pair, unpadded."""
        encs = self._encode(pairs=list(pairs), truncate="only_second")     # cut the passage, keep the question
        out: list = [None] * len(encs)
        names = [n for n in ("start_logits", "end_logits") if n in self.output_names] or self.output_names[:2]
        for idx in token_batches([len(e.ids) for e in encs], self.batch):
            feeds = self._feeds([encs[i] for i in idx])
            start, end = run(self.session, names, feeds)
            for row, i in enumerate(idx):
                n = len(encs[i].ids)
                out[i] = (start[row, :n], end[row, :n], encs[i])
        return out

    def read(self, question: str, passages: Sequence[str]) -> Span | None:
        """The best span over `passages` (None without passages)."""
        passages = list(passages)
        if not passages:
            return None
        best, spans, nulls = None, [], []
        for p, (start, end, enc) in enumerate(self.logits([(question, t) for t in passages])):
            in_passage = np.array([s == 1 for s in enc.sequence_ids])
            i, j, score = best_span(start, end, in_passage)
            nulls.append(float(start[0] + end[0]))
            spans.append(score)
            if i >= 0 and (best is None or score > best[0]):
                best = (score, p, enc.offsets[i][0], enc.offsets[j][1])
        if best is None:
            return Span("", 0, 0.0, True)
        z = np.array([*spans, min(nulls)], dtype=np.float64)
        z = np.exp(z - z[np.isfinite(z)].max())
        score, p, a, b = best
        confidence = float(z[p] / z.sum())
        return Span(passages[p][a:b].strip(), p, confidence, bool(min(nulls) > score))
