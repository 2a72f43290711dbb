"""`d2r-edge index build --engine ray`: the chunk shards embedded by Ray Data actors.

The driver chunks the documents (the tokenizer is cheap), hands each missing
shard of `KBConfig.shard_chunks` chunks to `map_batches` over a pool of actors
that each hold one embedder, saves every shard as it arrives (so an interrupted
build resumes as a local one does) and builds BM25 and HNSW itself from the
gathered vectors. A shard is embedded with the same `Embedder.encode` call on
the same texts as in a local build: the KB is the same except for timestamps
(the tests compare the files).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from d2r_edge.engine import RayConfig
from d2r_edge.engine.ray_pool import (
    assigned_threads,
    check_every_node,
    connect,
    unreadable,
)
from d2r_edge.errors import D2RError, EngineError, InputError

log = logging.getLogger(__name__)


class ShardEmbedder:
    """A Ray Data actor: one embedder, one shard per batch."""

    def __init__(self, models: Path, variant: str, allow_random_weights: bool, fingerprint: dict) -> None:
        problem = unreadable({"models manifest": Path(models) / "manifest.json"})
        if problem:
            raise InputError(problem)
        from d2r_edge.onnx.encoders import Embedder
        from d2r_edge.onnx.manifest import Variant, load_manifest
        from d2r_edge.onnx.session import SessionConfig
        from d2r_edge.retrieval.kb import embedder_fingerprint

        self.embedder = Embedder(load_manifest(models), variant=Variant(variant),
                                 session=SessionConfig(intra_op_threads=assigned_threads()),
                                 allow_random_weights=allow_random_weights)
        if embedder_fingerprint(self.embedder) != fingerprint:
            raise InputError(f"the embedder a Ray worker loaded from {models} is not the driver's (another "
                             f"model file at that path on this node); give every node the same --models")

    def __call__(self, batch: dict) -> dict:
        shards, vectors, rows = [], [], []
        for shard, texts in zip(batch["shard"], batch["texts"]):
            vec = self.embedder.encode([str(t) for t in texts]).astype(np.float32)
            shards.append(int(shard))
            vectors.append(vec.tobytes())
            rows.append(len(vec))
        return {"shard": np.array(shards, dtype=np.int64), "rows": np.array(rows, dtype=np.int64),
                "vectors": np.array(vectors, dtype=object)}


def _our_error(exc: BaseException) -> D2RError | None:
    """The d2r-edge error inside Ray's wrappers: the object when Ray kept it, else the
    `d2r_edge.errors.InputError: message` line of the traceback Ray formatted (an actor that
    died in its constructor keeps only the text)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, D2RError):
            return exc
        found = re.search(r"d2r_edge\.errors\.InputError: (.+)", str(exc))
        if found:
            return InputError(found.group(1).strip())
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else (exc.__cause__ or exc.__context__)
    return None


def ray_shard_embedding(embedder, models: Path, variant: str, allow_random_weights: bool, cfg: RayConfig):
    """A `ShardEmbedding` for `KnowledgeBase.build` that runs on Ray Data actors."""
    from d2r_edge.retrieval.kb import embedder_fingerprint

    fingerprint = embedder_fingerprint(embedder)

    def embed(todo: list[int], texts_of) -> object:
        if not todo:
            return
        ray = connect(cfg)
        check_every_node(ray, {"models manifest": Path(models) / "manifest.json"})
        ds = ray.data.from_items([{"shard": i, "texts": texts_of(i)} for i in todo],
                                 override_num_blocks=len(todo))
        out = ds.map_batches(ShardEmbedder, batch_size=1, batch_format="numpy",
                             fn_constructor_args=(str(models), variant, allow_random_weights, fingerprint),
                             compute=ray.data.ActorPoolStrategy(size=cfg.workers),
                             num_cpus=cfg.cpus_per_worker)
        try:
            for row in out.iter_rows():
                vec = np.frombuffer(row["vectors"], dtype=np.float32).reshape(int(row["rows"]), -1)
                yield int(row["shard"]), vec
        except Exception as exc:
            ours = _our_error(exc)
            if ours is not None:
                raise ours from None
            raise EngineError(f"the Ray embedding of the KB failed: {type(exc).__name__}: {exc}") from exc

    return embed
