"""Token-window chunking by the embedder's tokenizer (paper: 128 tokens, 16 overlap)."""

from __future__ import annotations

from dataclasses import dataclass

from d2r_edge.errors import ConfigError


@dataclass(frozen=True)
class ChunkConfig:
    chunk_tokens: int = 128
    overlap_tokens: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 8:
            raise ConfigError(f"chunk_tokens must be an int >= 8, got {self.chunk_tokens!r}")
        if not isinstance(self.overlap_tokens, int) or not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise ConfigError(
                f"overlap_tokens must be an int in [0, chunk_tokens), got {self.overlap_tokens!r}"
            )


@dataclass(frozen=True)
class Chunk:
    doc_id: str
    index: int          # position of the chunk within its document
    text: str
    start_char: int
    end_char: int


class Chunker:
    """Splits texts into overlapping token windows, keeping exact character spans."""

    def __init__(self, tokenizer, cfg: ChunkConfig = ChunkConfig()) -> None:
        from tokenizers import Tokenizer

        # an independent copy: no truncation, no specials, no padding
        self.tok = Tokenizer.from_str(tokenizer.to_str())
        self.tok.no_truncation()
        self.tok.no_padding()
        self.cfg = cfg

    def chunk(self, doc_id: str, text: str) -> list[Chunk]:
        return self.chunk_many([(doc_id, text)])

    def chunk_many(self, docs: list[tuple[str, str]]) -> list[Chunk]:
        """Chunks of many (doc_id, text) pairs; tokenized in one batch."""
        encs = self.tok.encode_batch([t for _, t in docs], add_special_tokens=False)
        out: list[Chunk] = []
        step = self.cfg.chunk_tokens - self.cfg.overlap_tokens
        for (doc_id, text), enc in zip(docs, encs):
            offsets = [o for o in enc.offsets if o[1] > o[0]]
            for i, start in enumerate(range(0, len(offsets), step)):
                window = offsets[start:start + self.cfg.chunk_tokens]
                s, e = window[0][0], window[-1][1]
                out.append(Chunk(doc_id, i, text[s:e], s, e))
                if start + self.cfg.chunk_tokens >= len(offsets):
                    break
        return out
