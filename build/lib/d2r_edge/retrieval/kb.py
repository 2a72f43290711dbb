"""A self-describing knowledge-base directory: chunks, embeddings, HNSW, BM25, manifest.

Every write goes to a sibling temporary directory that is swapped in at the
end, so a crash leaves the old KB (or, for a build, a resumable partial
build whose finished embedding shards are reused), never a corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from d2r_edge.errors import D2RError, InputError
from d2r_edge.jsonl import loads as json_line
from d2r_edge.retrieval.bm25 import BM25Config, BM25Index
from d2r_edge.retrieval.chunker import ChunkConfig, Chunker
from d2r_edge.retrieval.dense import DenseIndex, HNSWConfig
from d2r_edge.retrieval.docs import Document, read_documents

log = logging.getLogger(__name__)

KB_FORMAT_VERSION = 1
# (shard indices to embed, texts of a shard) -> (shard index, vectors) as they are done
ShardEmbedding = Callable[[list[int], Callable[[int], list[str]]], Iterable[tuple[int, np.ndarray]]]
MANIFEST = "manifest.json"


class KBError(D2RError):
    exit_code = 10


class KBModelMismatchError(KBError):
    """The KB was embedded with other model files than the ones loaded."""


@dataclass(frozen=True)
class KBConfig:
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    hnsw: HNSWConfig = field(default_factory=HNSWConfig)
    bm25: BM25Config = field(default_factory=BM25Config)
    shard_chunks: int = 1024   # embedding checkpoint granularity of a resumable build
    compact_after_deltas: int = 8   # `index refresh` folds the delta shards into the base files at this many


def embedder_fingerprint(embedder) -> dict:
    """What identifies the embedding space: model and tokenizer bytes, variant, dim."""
    entry = embedder.entry
    files = entry.variants[embedder.variant]
    return {"variant": embedder.variant.value, "dim": embedder.dim,
            "model_sha256": sorted(f.sha256 for f in files.values()),
            "tokenizer_sha256": entry.files["tokenizer.json"].sha256,
            "source": entry.source.get("spec", "")}


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _write_jsonl(path: Path, rows, mode: str = "w") -> None:
    with open(path, mode, encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace `final` by `tmp` with renames only; `final.old` bridges a crash."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _recover(final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if not final.exists() and old.exists():
        log.warning("recovering %s from an interrupted swap", final)
        os.replace(old, final)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="chunk", disable=None, leave=False)


def _embed_rows(embedder, chunks: list[dict]) -> np.ndarray:
    return embedder.encode([c["embed_text"] for c in chunks])


def _chunk_docs(docs: list[Document], chunker: Chunker, first_chunk_id: int) -> list[dict]:
    chunks = chunker.chunk_many([(d.id, d.text) for d in docs])
    titles = {d.id: d.title for d in docs}
    rows = []
    for i, c in enumerate(chunks):
        title = titles[c.doc_id]
        rows.append({"chunk_id": first_chunk_id + i, "doc_id": c.doc_id, "index": c.index,
                     "title": title, "text": c.text, "start_char": c.start_char,
                     "end_char": c.end_char,
                     "embed_text": f"{title}\n{c.text}" if title else c.text})
    return rows


class KnowledgeBase:
    def __init__(self, directory: Path, manifest: dict, chunks: list[dict], dense: DenseIndex,
                 bm25: BM25Index, cfg: KBConfig) -> None:
        self.directory, self.manifest, self.chunks = directory, manifest, chunks
        self.dense, self.bm25, self.cfg = dense, bm25, cfg
        self.doc_ids = {c["doc_id"] for c in chunks}
        self.session_docs = 0      # documents the refresh arm added in memory in this process

    @property
    def version(self) -> int:
        return int(self.manifest["kb_version"])

    # --- opening ---------------------------------------------------------------
    @classmethod
    def open(cls, directory: Path | str, embedder=None, cfg: KBConfig = KBConfig()) -> "KnowledgeBase":
        """Open a KB directory; a missing, truncated or foreign file is one KBError naming it."""
        directory = Path(directory)
        _recover(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise KBError(f"no KB at {directory}; build one with d2r-edge index build")
        try:
            manifest = json_line(path.read_bytes())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise KBError(f"{path} is not valid JSON ({exc}); rebuild the KB") from None
        if not isinstance(manifest, dict) or manifest.get("format_version") != KB_FORMAT_VERSION:
            have = manifest.get("format_version") if isinstance(manifest, dict) else "?"
            raise KBError(f"{directory}: KB format {have} is not {KB_FORMAT_VERSION}; rebuild it with this d2r-edge")
        try:
            return cls._open(directory, manifest, embedder, cfg)
        except KBError:
            raise
        except (D2RError, OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError,
                EOFError, zipfile.BadZipFile) as exc:
            raise KBError(f"cannot open the KB at {directory} ({type(exc).__name__}: {exc}); a file is missing "
                          f"or damaged: rebuild it with d2r-edge index build") from None

    @classmethod
    def _open(cls, directory: Path, manifest: dict, embedder, cfg: KBConfig) -> "KnowledgeBase":
        if embedder is not None:
            want, got = manifest["embedder"], embedder_fingerprint(embedder)
            if want != got:
                raise KBModelMismatchError(
                    f"{directory} was embedded with {want['source']} ({want['variant']}, model "
                    f"{want['model_sha256'][0][:12]}...) but the loaded embedder is {got['source']} "
                    f"({got['variant']}, {got['model_sha256'][0][:12]}...); load the same models "
                    f"(--models, variant) or rebuild the KB with these"
                )
        _check_sizes(directory, manifest.get("files"))
        chunks = _read_chunks(directory / "chunks.jsonl")
        dim = int(manifest["embedder"]["dim"])
        dense = DenseIndex.load(directory, dim, cfg.hnsw, int(manifest["hnsw"]["ef"]))
        if dense.vectors.ndim != 2 or dense.vectors.shape[1] != dim or dense.vectors.dtype.kind != "f":
            raise KBError(f"{directory / 'embeddings.npy'}: vectors of shape {dense.vectors.shape} "
                          f"({dense.vectors.dtype}), the manifest says dim {dim}; rebuild the KB")
        bm25 = BM25Index.load(directory / "bm25.npz")
        for delta in manifest.get("deltas", []):      # refreshes since the base files were written
            new_chunks, vectors = _read_delta(directory / DELTAS / delta["name"], delta)
            chunks += new_chunks
            dense.add(vectors, calibrate=False)
            bm25.add([c["embed_text"] for c in new_chunks])
        if manifest.get("deltas") and dense.index is not None:
            dense.calibrate()                         # once here, not in the refresh that appended
        if not (len(chunks) == dense.n == bm25.n_docs == manifest["n_chunks"]):
            raise KBError(f"{directory}: chunk counts disagree (chunks {len(chunks)}, vectors "
                          f"{dense.n}, bm25 {bm25.n_docs}); rebuild the KB")
        return cls(directory, manifest, chunks, dense, bm25, cfg)

    # --- building ----------------------------------------------------------------
    @classmethod
    def build(cls, docs_path: Path | str, directory: Path | str, embedder,
              cfg: KBConfig = KBConfig(), embed_shards: ShardEmbedding | None = None) -> "KnowledgeBase":
        """Ingest a JSONL file into a new KB; resumes an interrupted build of the same input.

        `embed_shards` embeds the chunk shards elsewhere (`--engine ray`); chunking, BM25
        and HNSW stay here, so the KB is the same as a local build's.
        """
        docs_path, directory = Path(docs_path), Path(directory)
        report = read_documents(docs_path)
        fingerprint = embedder_fingerprint(embedder)
        plan = {"input_sha256": hashlib.sha256(docs_path.read_bytes()).hexdigest(),
                "chunk": asdict(cfg.chunk), "embedder": fingerprint, "shard_chunks": cfg.shard_chunks}
        work = directory.with_name(directory.name + ".partial")
        if work.exists():
            try:
                same = json_line((work / "plan.json").read_bytes()) == plan
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                same = False
            if not same:
                log.info("discarding a partial build of other input/settings in %s", work)
                shutil.rmtree(work)
        try:
            return cls._build(work, directory, plan, report, embedder, fingerprint, cfg, embed_shards)
        except KBError as exc:         # the partial build is damaged (a cache): once more from nothing
            if not work.exists():
                raise
            log.warning("discarding a damaged partial build in %s (%s)", work, exc)
            shutil.rmtree(work)
            return cls._build(work, directory, plan, report, embedder, fingerprint, cfg, embed_shards)

    @classmethod
    def _build(cls, work: Path, directory: Path, plan: dict, report, embedder, fingerprint: dict, cfg: KBConfig,
               embed_shards: ShardEmbedding | None) -> "KnowledgeBase":
        (work / "shards").mkdir(parents=True, exist_ok=True)
        _write_json(work / "plan.json", plan)
        chunks_path = work / "chunks.jsonl"
        if chunks_path.is_file():
            chunks = _read_chunks(chunks_path)
            log.info("resuming the build in %s", work)
        else:
            chunker = Chunker(embedder.tokenizer, cfg.chunk)
            chunks = _chunk_docs(report.documents, chunker, 0)
            tmp = chunks_path.with_name("chunks.jsonl.tmp")
            _write_jsonl(tmp, chunks)
            os.replace(tmp, chunks_path)
        vectors = cls._embed_resumable(embedder, chunks, work / "shards", cfg.shard_chunks, embed_shards)
        kb = cls._assemble(work, chunks, vectors, report.documents, fingerprint, cfg, version=1,
                           created=time.time())
        (work / "plan.json").unlink()
        shutil.rmtree(work / "shards")
        _swap_in(work, directory)
        kb.directory = directory
        return kb

    @staticmethod
    def input_digest(docs: list[Document]) -> str:
        """sha256 of the documents a cached KB is built from (what `cached` keys it by)."""
        return hashlib.sha256(_docs_jsonl(docs).encode()).hexdigest()

    @classmethod
    def cached(cls, docs: list[Document], out: Path, embedder) -> "KnowledgeBase":
        """The KB of `docs` under out/kb, rebuilt only when their content changes
        (out/kb-docs.jsonl is the input, out/kb.input-sha256 its hash)."""
        out.mkdir(parents=True, exist_ok=True)
        text = _docs_jsonl(docs)
        digest = hashlib.sha256(text.encode()).hexdigest()
        docs_path, stamp, kb_dir = out / "kb-docs.jsonl", out / "kb.input-sha256", out / "kb"
        if stamp.is_file() and stamp.read_bytes().strip() == digest.encode() and (kb_dir / MANIFEST).is_file():
            try:
                return cls.open(kb_dir, embedder)
            except KBModelMismatchError:
                raise
            except KBError as exc:          # a cache: built again from the documents
                log.warning("rebuilding the cached KB: %s", exc)
        stamp.unlink(missing_ok=True)
        docs_path.write_text(text, encoding="utf-8")
        kb = cls.build(docs_path, kb_dir, embedder)
        stamp.write_text(digest + "\n")
        return kb

    @staticmethod
    def _embed_resumable(embedder, chunks: list[dict], shards: Path, shard_size: int,
                         embed_shards: ShardEmbedding | None = None) -> np.ndarray:
        """Embed shard by shard, each saved as it is done; shards already on disk are reused.

        `embed_shards(todo, texts_of)` may compute the missing shards elsewhere (the Ray
        engine); it yields (shard index, vectors) in any order.
        """
        starts = list(range(0, len(chunks), shard_size))

        def path(i: int) -> Path:
            return shards / f"emb-{i:06d}.npy"

        def texts_of(i: int) -> list[str]:
            return [c["embed_text"] for c in chunks[starts[i]:starts[i] + shard_size]]

        parts = {}
        for i in range(len(starts)):
            if path(i).is_file():
                try:
                    part = np.load(path(i), allow_pickle=False)
                except (OSError, ValueError, EOFError) as exc:
                    raise KBError(f"cannot read the finished embedding shard {path(i)} ({exc})") from None
                want = min(shard_size, len(chunks) - starts[i])
                if part.ndim != 2 or part.shape != (want, embedder.dim):
                    raise KBError(f"{path(i)} holds {part.shape} vectors, the shard needs ({want}, {embedder.dim})")
                parts[i] = part
        todo = [i for i in range(len(starts)) if i not in parts]
        results = (embed_shards(todo, texts_of) if embed_shards is not None
                   else ((i, embedder.encode(texts_of(i))) for i in todo))
        with _progress(len(chunks), "embedding") as bar:
            bar.update(sum(len(part) for part in parts.values()))
            for i, part in results:
                part = np.asarray(part, dtype=np.float32)
                tmp = path(i).with_name(path(i).name + ".tmp.npy")
                np.save(tmp, part)
                os.replace(tmp, path(i))
                parts[i] = part
                bar.update(len(part))
        ordered = [parts[i] for i in range(len(starts))]
        return np.concatenate(ordered) if ordered else np.zeros((0, embedder.dim), np.float32)

    @classmethod
    def _assemble(cls, work: Path, chunks: list[dict], vectors: np.ndarray, docs: list[Document],
                  fingerprint: dict, cfg: KBConfig, version: int, created: float) -> "KnowledgeBase":
        dense = DenseIndex(vectors.shape[1], cfg.hnsw)
        dense.add(vectors)
        bm25 = BM25Index(cfg.bm25)
        bm25.add([c["embed_text"] for c in chunks])
        dense.save(work)
        bm25.save(work / "bm25.npz")
        _write_jsonl(work / "docs.jsonl", ({"id": d.id, "title": d.title, **d.metadata} for d in docs))
        manifest = cls._manifest(chunks, fingerprint, cfg, dense, version, created,
                                 n_docs=len({c["doc_id"] for c in chunks}), files=_sizes(work))
        _write_json(work / MANIFEST, manifest)
        return cls(work, manifest, chunks, dense, bm25, cfg)

    @staticmethod
    def _manifest(chunks, fingerprint, cfg, dense: DenseIndex, version, created, n_docs,
                  deltas: list[dict] | None = None, files: dict[str, int] | None = None) -> dict:
        return {"format_version": KB_FORMAT_VERSION, "kb_version": version, "n_docs": n_docs,
                "n_chunks": len(chunks), "chunking": asdict(cfg.chunk), "embedder": fingerprint,
                "hnsw": {**asdict(cfg.hnsw), "ef": dense.ef, "built": dense.index is not None},
                "bm25": asdict(cfg.bm25), "created_unix_s": int(created),
                "updated_unix_s": int(time.time()), "deltas": list(deltas or []), "files": dict(files or {})}

    # --- incremental -------------------------------------------------------------
    def queue(self, docs_path: Path | str) -> int:
        """Queue documents for the next refresh (validated now, ingested later)."""
        queued = self._queued_ids()
        report = read_documents(Path(docs_path), known_ids=self.doc_ids | queued)
        _write_jsonl(self.directory / "queue.jsonl",
                     ({"id": d.id, "title": d.title, "text": d.text, **d.metadata}
                      for d in report.documents), mode="a")
        return len(report.documents)

    def _queued_ids(self) -> set[str]:
        path = self.directory / "queue.jsonl"
        if not path.is_file():
            return set()
        with open(path, encoding="utf-8") as fh:
            return {str(json_line(line)["id"]) for line in fh if line.strip()}

    def refresh(self, embedder, extra: list[Document] | None = None, persist: bool = False) -> int:
        """Ingest the queue (and `extra` documents), append-only; returns the documents added.

        Only the new documents are chunked, embedded and indexed (HNSW add_items without
        recalibration, one new BM25 segment): the cost does not grow with the KB.
        `persist=False` (the refresh arm inside `run`/`train`): in memory only; the KB on
        disk is never changed by a run, `session_docs` counts what this process added, and
        records name the KB version with it. `persist=True` (`d2r-edge index refresh`):
        the new chunks are written as a delta shard, then the manifest is replaced with the
        version bumped, then memory follows; a crash leaves the old KB or the new one.
        """
        queue_path = self.directory / "queue.jsonl"
        docs = list(extra or [])
        if queue_path.is_file():
            docs += read_documents(queue_path).documents   # (validated against the KB when queued)
        docs = list({d.id: d for d in docs if d.id not in self.doc_ids}.values())   # in memory already: skip
        if not docs:
            return 0
        if persist and self.session_docs:
            raise KBError(f"{self.directory}: this process added {self.session_docs} document(s) in memory; "
                          f"open the KB again to persist a refresh")
        if embedder_fingerprint(embedder) != self.manifest["embedder"]:
            raise KBModelMismatchError(f"{self.directory}: refresh with another embedder; rebuild instead")
        new_chunks = _chunk_docs(docs, Chunker(embedder.tokenizer, self.cfg.chunk), len(self.chunks))
        vectors = _embed_rows(embedder, new_chunks)
        if persist:
            self._persist_delta(docs, new_chunks, vectors)
        else:
            self.session_docs += len(docs)
        self.dense.add(vectors, calibrate=False)
        self.bm25.add([c["embed_text"] for c in new_chunks])
        self.chunks += new_chunks
        self.doc_ids |= {d.id for d in docs}
        return len(docs)

    def _persist_delta(self, docs: list[Document], chunks: list[dict], vectors: np.ndarray) -> None:
        version = self.version + 1
        entry = {"name": f"{version:06d}", "kb_version": version, "n_chunks": len(chunks), "n_docs": len(docs)}
        final = self.directory / DELTAS / entry["name"]
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)      # left by a crash before its manifest was written
        tmp.mkdir(parents=True)
        _write_jsonl(tmp / "chunks.jsonl", chunks)
        _write_jsonl(tmp / "docs.jsonl", ({"id": d.id, "title": d.title, **d.metadata} for d in docs))
        np.save(tmp / "embeddings.npy", np.asarray(vectors, dtype=np.float32))
        entry["files"] = _sizes(tmp)
        os.replace(tmp, final)
        m = dict(self.manifest)
        m.update(kb_version=version, n_chunks=len(self.chunks) + len(chunks),
                 n_docs=len(self.doc_ids | {d.id for d in docs}), updated_unix_s=int(time.time()),
                 deltas=list(self.manifest.get("deltas", [])) + [entry])
        _write_json(self.directory / MANIFEST, m)    # the commit point
        self.manifest = m
        (self.directory / "queue.jsonl").unlink(missing_ok=True)   # consumed (known ids are skipped anyway)

    def compact(self) -> None:
        """Fold the delta shards into the base files (off the hot path: `index refresh`)."""
        if not self.manifest.get("deltas"):
            return
        if self.session_docs:
            raise KBError(f"{self.directory}: documents were added in memory; open the KB again to compact it")
        self.dense.calibrate()
        work = self.directory.with_name(self.directory.name + ".compact")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        for entry in self.directory.iterdir():        # the KG store, the queue: carried over as they are
            if entry.name not in _BASE_FILES and entry.name != DELTAS:
                (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, work / entry.name)
        _write_jsonl(work / "chunks.jsonl", self.chunks)
        with open(work / "docs.jsonl", "w", encoding="utf-8") as out:
            out.write((self.directory / "docs.jsonl").read_text(encoding="utf-8"))
            for delta in self.manifest["deltas"]:
                out.write((self.directory / DELTAS / delta["name"] / "docs.jsonl").read_text(encoding="utf-8"))
        self.dense.save(work)
        self.bm25.save(work / "bm25.npz")
        self.manifest = self._manifest(self.chunks, self.manifest["embedder"], self.cfg, self.dense,
                                       self.version, self.manifest["created_unix_s"], n_docs=len(self.doc_ids),
                                       files=_sizes(work))
        _write_json(work / MANIFEST, self.manifest)
        _swap_in(work, self.directory)

    def stats(self) -> dict:
        m = self.manifest
        return {"kb_version": m["kb_version"], "n_docs": m["n_docs"], "n_chunks": m["n_chunks"],
                "delta_shards": len(m.get("deltas", [])), "docs_added_in_memory": self.session_docs,
                "queued": len(self._queued_ids()), "embedder": m["embedder"]["source"],
                "variant": m["embedder"]["variant"], "hnsw_ef": m["hnsw"]["ef"],
                "hnsw_built": m["hnsw"]["built"], "chunking": m["chunking"]}


class PoolRefresh:
    """The paper's simulated index refresh: with probability p, 100 unseen passages from a pool."""

    def __init__(self, pool: list[Document], n_passages: int = 100, probability: float = 0.5,
                 seed: int = 0) -> None:
        if not 0 <= probability <= 1 or n_passages < 1:
            raise InputError("PoolRefresh needs 0 <= probability <= 1 and n_passages >= 1")
        self.pool, self.n, self.p = list(pool), n_passages, probability
        self.rng = np.random.default_rng(seed)
        self.next = 0

    def draw(self) -> list[Document]:
        if self.rng.random() >= self.p or self.next >= len(self.pool):
            return []
        out = self.pool[self.next:self.next + self.n]
        self.next += len(out)
        return out


DELTAS = "deltas"
_BASE_FILES = {MANIFEST, "chunks.jsonl", "docs.jsonl", "embeddings.npy", "hnsw.bin", "bm25.npz"}


_SIZED = ("chunks.jsonl", "docs.jsonl", "embeddings.npy", "hnsw.bin", "bm25.npz")
_CHUNK_KEYS = {"chunk_id": int, "doc_id": str, "title": str, "text": str, "embed_text": str}


def _sizes(directory: Path) -> dict[str, int]:
    """Byte sizes of a KB's data files, recorded in its manifest: a truncated file is caught on open,
    before hnswlib or numpy read it (no full hash: opening a large KB must stay cheap)."""
    return {name: (directory / name).stat().st_size for name in _SIZED if (directory / name).is_file()}


def _check_sizes(directory: Path, sizes) -> None:
    if sizes is None:                # a KB written before sizes were recorded
        return
    if not isinstance(sizes, dict):
        raise KBError(f"{directory / MANIFEST}: 'files' is not an object; rebuild the KB")
    for name, size in sizes.items():
        path = directory / str(name)
        if not path.is_file():
            raise KBError(f"{path} is missing; rebuild the KB (d2r-edge index build)")
        have = path.stat().st_size
        if have != size:
            raise KBError(f"{path} has {have} bytes, the KB manifest recorded {size} "
                          f"(truncated or replaced); rebuild the KB (d2r-edge index build)")


def _read_chunks(path: Path) -> list[dict]:
    chunks = []
    try:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                row = json_line(line)
                if not isinstance(row, dict) or not all(isinstance(row.get(k), t) for k, t in _CHUNK_KEYS.items()):
                    raise KBError(f"{path} line {n}: not a chunk record; rebuild the KB")
                chunks.append(row)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KBError(f"cannot read {path} ({exc}); rebuild the KB") from None
    return chunks


def _read_delta(path: Path, entry: dict) -> tuple[list[dict], np.ndarray]:
    _check_sizes(path, entry.get("files"))
    chunks = _read_chunks(path / "chunks.jsonl")
    try:
        vectors = np.load(path / "embeddings.npy", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise KBError(f"cannot read the KB's delta shard {path} ({exc}); rebuild the KB") from None
    if not len(chunks) == vectors.shape[0] == entry["n_chunks"]:
        raise KBError(f"{path}: {len(chunks)} chunks and {vectors.shape[0]} vectors, the manifest says "
                      f"{entry['n_chunks']}; rebuild the KB")
    return chunks, vectors


def _docs_jsonl(docs: list[Document]) -> str:
    return "".join(json.dumps({"id": d.id, "title": d.title, "text": d.text}, ensure_ascii=False) + "\n"
                   for d in docs)
