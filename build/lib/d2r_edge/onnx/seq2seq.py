"""REBEL-style triple extraction on ONNX Runtime: encoder + merged decoder with KV cache.

The merged decoder (optimum's `decoder_model_merged.onnx`) takes a
`use_cache_branch` flag: the first step runs without past key/values and
returns them; later steps feed one token and the cache. Greedy decoding
mirrors `transformers.generate(num_beams=1, do_sample=False)` including the
forced-BOS / forced-EOS / min-length / no-repeat-n-gram processors that BART
checkpoints configure.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from d2r_edge.errors import ConfigError
from d2r_edge.onnx.encoders import check_text
from d2r_edge.onnx.manifest import Manifest, Role, Variant
from d2r_edge.onnx.session import SessionConfig, open_session, run

log = logging.getLogger(__name__)

ENCODER_FILE = "encoder_model.onnx"
DECODER_FILE = "decoder_model_merged.onnx"


@dataclass(frozen=True)
class Triple:
    head: str
    relation: str
    tail: str


@dataclass(frozen=True)
class GenerationSettings:
    """Decoding settings; defaults come from the checkpoint's generation config."""

    decoder_start_token_id: int
    eos_token_id: int
    pad_token_id: int
    max_new_tokens: int = 64
    num_beams: int = 1
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    min_length: int = 0
    no_repeat_ngram_size: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_beams < 1:
            raise ConfigError(f"num_beams must be >= 1, got {self.num_beams}")

    @classmethod
    def from_manifest(cls, generation: dict, where: str = "the manifest", **overrides) -> "GenerationSettings":
        """Settings from a manifest's generation block (`where` names it in errors), overrides on top."""
        keys = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in generation.items() if k in keys and v is not None}
        if "max_new_tokens" not in values and generation.get("max_length"):
            max_length = generation["max_length"]
            values["max_new_tokens"] = max(1, max_length - 1) if isinstance(max_length, int) else max_length
        values.update({k: v for k, v in overrides.items() if v is not None})
        for key, value in values.items():
            ok = (value in (True, False, "never") if key == "early_stopping"
                  else isinstance(value, (int, float)) and not isinstance(value, bool) if key == "length_penalty"
                  else isinstance(value, int) and not isinstance(value, bool))
            if not ok:
                raise ConfigError(f"{where}: generation setting {key}={value!r} has the wrong type; re-run "
                                  f"d2r-edge export or fix the override")
        try:
            return cls(**values)
        except TypeError as exc:       # a required token id missing from the manifest
            raise ConfigError(f"{where}: generation settings incomplete ({exc}); re-run d2r-edge export") from None
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _banned_ngram_tokens(seq: Sequence[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in `seq` (HF NoRepeatNGram)."""
    if n <= 0 or len(seq) + 1 < n:
        return []
    prefix = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    banned = []
    for i in range(len(seq) - n + 1):
        if tuple(seq[i:i + n - 1]) == prefix:
            banned.append(seq[i + n - 1])
    return banned


def process_logits(scores: np.ndarray, sequences: np.ndarray, cfg: GenerationSettings,
                   max_length: int) -> np.ndarray:
    """Apply generate()'s logits processors in HF order, in place; `scores` are log-probs or logits."""
    cur_len = sequences.shape[1]
    if cfg.min_length and cur_len < cfg.min_length:
        scores[:, cfg.eos_token_id] = -np.inf
    if cfg.no_repeat_ngram_size:
        for row in range(scores.shape[0]):
            banned = _banned_ngram_tokens(sequences[row].tolist(), cfg.no_repeat_ngram_size)
            if banned:
                scores[row, banned] = -np.inf
    if cfg.forced_bos_token_id is not None and cur_len == 1:
        scores[:] = -np.inf
        scores[:, cfg.forced_bos_token_id] = 0.0
    if cfg.forced_eos_token_id is not None and cur_len == max_length - 1:
        scores[:] = -np.inf
        scores[:, cfg.forced_eos_token_id] = 0.0
    return scores


class Seq2SeqModel:
    """Encoder + merged decoder sessions for one manifest role."""

    def __init__(self, manifest: Manifest, *, role: Role = Role.TRIPLES,
                 variant: Variant = Variant.INT8, session: SessionConfig = SessionConfig(),
                 allow_random_weights: bool = False) -> None:
        from tokenizers import Tokenizer

        self.entry = manifest.role(role, allow_random_weights=allow_random_weights)
        paths = self.entry.variant_paths(variant)
        self.encoder = open_session(paths[ENCODER_FILE], session)
        self.decoder = open_session(paths[DECODER_FILE], session)
        self.tokenizer = Tokenizer.from_file(str(self.entry.tokenizer_path()))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.entry.max_length_tokens)
        self.settings = GenerationSettings.from_manifest(self.entry.generation, where=self.entry.where)
        self._dec_inputs = {i.name: i for i in self.decoder.get_inputs()}
        self._dec_outputs = [o.name for o in self.decoder.get_outputs()]
        self._past_names = [n for n in self._dec_inputs if n.startswith("past_key_values.")]

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        texts = [check_text(t, i) for i, t in enumerate(texts)]
        encs = self.tokenizer.encode_batch(texts)
        width = max(len(e.ids) for e in encs)
        ids = np.full((len(encs), width), self.settings.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(encs), width), dtype=np.int64)
        for row, enc in enumerate(encs):
            ids[row, :len(enc.ids)] = enc.ids
            mask[row, :len(enc.ids)] = 1
        return ids, mask

    def _encoder_states(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": ids, "attention_mask": mask}
        names = [i.name for i in self.encoder.get_inputs()]
        return run(self.encoder, [self.encoder.get_outputs()[0].name], {n: feeds[n] for n in names})[0]

    def _dummy_past(self, batch: int) -> dict[str, np.ndarray]:
        out = {}
        for name in self._past_names:
            shape = self._dec_inputs[name].shape
            heads, head_dim = int(shape[1]), int(shape[3])
            dtype = np.float16 if "float16" in self._dec_inputs[name].type else np.float32
            out[name] = np.zeros((batch, heads, 0, head_dim), dtype=dtype)
        return out

    def step(self, input_ids: np.ndarray, enc_states: np.ndarray, enc_mask: np.ndarray,
             past: dict[str, np.ndarray] | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One decoder run: last-position logits (float32) and the new cache."""
        feeds = {"input_ids": input_ids, "encoder_hidden_states": enc_states,
                 "encoder_attention_mask": enc_mask,
                 "use_cache_branch": np.array([past is not None])}
        feeds.update(past if past is not None else self._dummy_past(input_ids.shape[0]))
        outs = dict(zip(self._dec_outputs, run(self.decoder, self._dec_outputs, feeds)))
        new_past = {}
        for name in self._past_names:
            present = name.replace("past_key_values.", "present.")
            if past is not None and ".encoder." in name:
                new_past[name] = past[name]  # cross-attention cache never changes
            else:
                new_past[name] = outs[present]
        return outs["logits"][:, -1, :].astype(np.float32), new_past

    def greedy(self, texts: Sequence[str], max_new_tokens: int | None = None) -> np.ndarray:
        """Greedy ids (batch, <= 1 + max_new_tokens), like generate(num_beams=1)."""
        cfg = self.settings
        max_length = 1 + (max_new_tokens or cfg.max_new_tokens)
        ids, mask = self.encode(texts)
        enc = self._encoder_states(ids, mask)
        batch = ids.shape[0]
        seqs = np.full((batch, 1), cfg.decoder_start_token_id, dtype=np.int64)
        done = np.zeros(batch, dtype=bool)
        past = None
        while seqs.shape[1] < max_length:
            logits, past = self.step(seqs[:, -1:], enc, mask, past)
            logits = process_logits(logits, seqs, cfg, max_length)
            nxt = logits.argmax(axis=1)
            nxt = np.where(done, cfg.pad_token_id, nxt)
            seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
            done |= nxt == cfg.eos_token_id
            if done.all():
                break
        return seqs

    def beam_search(self, texts: Sequence[str], num_beams: int | None = None,
                    max_new_tokens: int | None = None) -> np.ndarray:
        """Beam search with the cache, following transformers' vectorized `_beam_search`.

        Same candidate pool (2 * num_beams), length normalization, early-stop
        heuristic and stopping rules, so ids match `generate(num_beams=k)`.
        """
        cfg = self.settings
        k = num_beams or cfg.num_beams
        if k == 1:
            return self.greedy(texts, max_new_tokens)
        max_length = 1 + (max_new_tokens or cfg.max_new_tokens)
        ids, mask = self.encode(texts)
        enc = self._encoder_states(ids, mask)
        bsz = ids.shape[0]
        enc, mask = np.repeat(enc, k, axis=0), np.repeat(mask, k, axis=0)
        neg = np.float32(-1e9)
        fill = cfg.pad_token_id or cfg.eos_token_id  # transformers' `pad or eos` fill value
        keep = 2 * k
        running = np.full((bsz, k, max_length), fill, dtype=np.int64)
        running[:, :, 0] = cfg.decoder_start_token_id
        finished_seqs = running.copy()
        run_scores = np.zeros((bsz, k), dtype=np.float32)
        run_scores[:, 1:] = neg
        fin_scores = np.full((bsz, k), neg, dtype=np.float32)
        fin_done = np.zeros((bsz, k), dtype=bool)
        fin_len = np.zeros((bsz, k), dtype=np.int64)        # generated length of finished beams
        improvable = np.ones((bsz, 1), dtype=bool)
        top_mask = np.arange(keep) < k
        past, cur = None, 1
        while True:
            flat = running[:, :, :cur].reshape(bsz * k, cur)
            logits, past = self.step(flat[:, -1:], enc, mask, past)
            logp = _log_softmax(logits)
            logp = process_logits(logp, flat, cfg, max_length)
            vocab = logp.shape[1]
            acc = (logp.reshape(bsz, k, vocab) + run_scores[:, :, None]).reshape(bsz, k * vocab)
            top_idx = _topk_indices(acc, keep)
            top_lp = np.take_along_axis(acc, top_idx, axis=1)
            src_beam, tok = top_idx // vocab, top_idx % vocab
            top_seqs = np.take_along_axis(running, src_beam[:, :, None], axis=1).copy()
            top_seqs[:, :, cur] = tok
            hits = (tok == cfg.eos_token_id) | (cur + 1 >= max_length)
            # next running beams: best `k` continuations that did not stop
            run_lp = top_lp + hits.astype(np.float32) * neg
            nxt = _topk_indices(run_lp, k)
            running = np.take_along_axis(top_seqs, nxt[:, :, None], axis=1)
            run_scores = np.take_along_axis(run_lp, nxt, axis=1)
            beam_src = np.take_along_axis(src_beam, nxt, axis=1)
            # finished beams: merge the stopped top-k continuations
            just = hits & top_mask[None, :]
            norm = top_lp / np.float32((cur + 1 - 1) ** cfg.length_penalty)
            full = fin_done.all(axis=1, keepdims=True) & (cfg.early_stopping is True)
            norm = norm + full * neg + (~improvable) * neg + (~just) * neg
            m_seqs = np.concatenate([finished_seqs, top_seqs], axis=1)
            m_scores = np.concatenate([fin_scores, norm.astype(np.float32)], axis=1)
            m_done = np.concatenate([fin_done, just], axis=1)
            m_len = np.concatenate([fin_len, np.full((bsz, keep), cur, dtype=np.int64)], axis=1)
            best = _topk_indices(m_scores, k)
            finished_seqs = np.take_along_axis(m_seqs, best[:, :, None], axis=1)
            fin_scores = np.take_along_axis(m_scores, best, axis=1)
            fin_done = np.take_along_axis(m_done, best, axis=1)
            fin_len = np.take_along_axis(m_len, best, axis=1)
            # reorder the self-attention cache to follow the surviving beams
            order = (beam_src + np.arange(bsz)[:, None] * k).reshape(-1)
            past = {n: (v if ".encoder." in n else v[order]) for n, v in past.items()}
            cur += 1
            # early-stop heuristic (early_stopping=False / "never" / True)
            if cfg.early_stopping == "never" and cfg.length_penalty > 0:
                hyp_len = max_length - 1
            else:
                hyp_len = cur - 1
            best_running = run_scores[:, :1] / np.float32(hyp_len ** cfg.length_penalty)
            worst_fin = np.where(fin_done, fin_scores.min(axis=1, keepdims=True), neg)
            improvable = improvable & (best_running > worst_fin).any(axis=1, keepdims=True)
            open_beams = not (fin_done.all() and cfg.early_stopping is True)
            if not (improvable.any() and open_beams and not hits.all()):
                break
        out_len = 1 + int(fin_len[:, 0].max())
        return finished_seqs[:, 0, :out_len]

    def warmup(self) -> None:
        """One short decode so the first real call pays no allocation costs."""
        self.greedy(["warm up"], max_new_tokens=2)

    def decode(self, ids: np.ndarray) -> list[str]:
        return [self.tokenizer.decode([int(t) for t in row], skip_special_tokens=False)
                for row in ids]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))).astype(np.float32)


def _topk_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first (ties: lowest index first)."""
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k] if k < scores.shape[1] else \
        np.tile(np.arange(scores.shape[1]), (scores.shape[0], 1))
    vals = np.take_along_axis(scores, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)
    return np.take_along_axis(part, order, axis=1)


_MARKERS = re.compile(r"(<triplet>|<subj>|<obj>)")
_NOISE = re.compile(r"</?s>|<pad>")


def parse_triples(text: str) -> list[Triple]:
    """Triples from REBEL's linearization `<triplet> head <subj> tail <obj> relation`.

    Malformed pieces (a marker out of order, an empty field) are dropped;
    the parser never raises on any string.
    """
    triples: list[Triple] = []
    head = tail = relation = ""
    state = None

    def emit() -> None:   # only complete triples: every field non-blank once stripped
        if head.strip() and tail.strip() and relation.strip():
            triples.append(Triple(head.strip(), relation.strip(), tail.strip()))

    for piece in _MARKERS.split(_NOISE.sub(" ", text)):
        if piece == "<triplet>":
            emit()
            head, tail, relation, state = "", "", "", "head"
        elif piece == "<subj>":
            emit()          # a new tail for the same head
            tail, relation, state = "", "", "tail" if head.strip() else None
        elif piece == "<obj>":
            state = "relation" if state == "tail" and tail.strip() else None
        elif state == "head":
            head += piece
        elif state == "tail":
            tail += piece
        elif state == "relation":
            relation += piece
    emit()
    return triples


class Triples:
    """`extract(texts) -> list[list[Triple]]` with the triples role."""

    def __init__(self, model: Seq2SeqModel) -> None:
        self.model = model

    def extract(self, texts: Sequence[str], max_new_tokens: int | None = None) -> list[list[Triple]]:
        texts = list(texts)
        if not texts:
            return []
        ids = self.model.beam_search(texts, max_new_tokens=max_new_tokens)
        return [parse_triples(t) for t in self.model.decode(ids)]
