"""Triples extracted from every KB chunk, with embeddings of heads, relations and tails.

Built by `d2r-edge index kg`: batched, resumable (finished batches are kept in
a partial file and skipped on rerun), with progress.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from d2r_edge.errors import D2RError
from d2r_edge.jsonl import loads as json_line
from d2r_edge.onnx.seq2seq import Triple

log = logging.getLogger(__name__)
KG_DIR = "kg"


@dataclass(frozen=True)
class StoredTriple:
    head: str
    relation: str
    tail: str
    chunk_id: int


class TripleStore:
    def __init__(self, triples: list[StoredTriple], heads: np.ndarray, relations: np.ndarray,
                 tails: np.ndarray) -> None:
        self.triples, self.heads, self.relations, self.tails = triples, heads, relations, tails

    def __len__(self) -> int:
        return len(self.triples)

    @classmethod
    def from_triples(cls, triples: list[StoredTriple], embedder) -> "TripleStore":
        dim = embedder.dim
        if not triples:
            empty = np.zeros((0, dim), np.float32)
            return cls([], empty, empty.copy(), empty.copy())
        return cls(triples, embedder.encode([t.head for t in triples]),
                   embedder.encode([t.relation for t in triples]),
                   embedder.encode([t.tail for t in triples]))

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "triples.jsonl.tmp", "w", encoding="utf-8") as fh:
            for t in self.triples:
                fh.write(json.dumps(t.__dict__, ensure_ascii=False) + "\n")
        os.replace(directory / "triples.jsonl.tmp", directory / "triples.jsonl")
        for name in ("heads", "relations", "tails"):
            tmp = directory / f"{name}.tmp.npy"
            np.save(tmp, getattr(self, name))
            os.replace(tmp, directory / f"{name}.npy")

    @classmethod
    def load(cls, directory: Path) -> "TripleStore":
        try:
            with open(directory / "triples.jsonl", encoding="utf-8") as fh:
                triples = [StoredTriple(**json_line(line)) for line in fh]
            arrays = [np.load(directory / f"{n}.npy", allow_pickle=False)
                      for n in ("heads", "relations", "tails")]
        except (OSError, ValueError, TypeError) as exc:
            raise D2RError(f"cannot read the triple store in {directory} ({exc}); run d2r-edge index kg") from None
        if not all(len(a) == len(triples) for a in arrays):
            raise D2RError(f"{directory}: triple and embedding counts differ; run d2r-edge index kg again")
        return cls(triples, *arrays)


def build_store(kb, extractor, embedder, batch_chunks: int = 16) -> TripleStore:
    """Run the triples role over every KB chunk; resumes from `kg/partial.jsonl`."""
    from tqdm import tqdm

    out_dir = kb.directory / KG_DIR
    out_dir.mkdir(exist_ok=True)
    partial = out_dir / "partial.jsonl"
    done: dict[int, list[Triple]] = {}
    if partial.is_file():
        with open(partial, encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json_line(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a crash: redo that batch
                done[int(row["chunk_id"])] = [Triple(*t) for t in row["triples"]]
    todo = [c for c in kb.chunks if int(c["chunk_id"]) not in done]
    with open(partial, "a", encoding="utf-8") as fh, \
            tqdm(total=len(kb.chunks), initial=len(done), desc="triples", unit="chunk", disable=None) as bar:
        for start in range(0, len(todo), batch_chunks):
            batch = todo[start:start + batch_chunks]
            for chunk, triples in zip(batch, extractor.extract([c["text"] for c in batch])):
                done[int(chunk["chunk_id"])] = triples
                fh.write(json.dumps({"chunk_id": int(chunk["chunk_id"]),
                                     "triples": [[t.head, t.relation, t.tail] for t in triples]},
                                    ensure_ascii=False) + "\n")
            fh.flush()
            bar.update(len(batch))
    stored = [StoredTriple(t.head, t.relation, t.tail, cid)
              for cid in sorted(done) for t in done[cid]]
    store = TripleStore.from_triples(stored, embedder)
    store.save(out_dir)
    partial.unlink()
    log.info("triple store: %d triples from %d chunks", len(stored), len(done))
    return store
