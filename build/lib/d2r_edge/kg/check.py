"""TripleAlignStatus (Alg. 1 l.3): the response's triples against the KB's."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from d2r_edge.errors import ConfigError
from d2r_edge.signals import KGStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KGThresholds:
    """Cosine thresholds (reference values per task in KG_PRESETS)."""

    subject: float
    relation: float
    object: float
    candidates: int = 10     # KB triples compared per response triple, by subject similarity

    def __post_init__(self) -> None:
        for name in ("subject", "relation", "object"):
            v = getattr(self, name)
            if not -1.0 <= v <= 1.0:
                raise ConfigError(f"KG {name} threshold must be a cosine in [-1, 1], got {v!r}")
        if self.candidates < 1:
            raise ConfigError("KG candidates must be >= 1")


KG_PRESETS = {"fever": KGThresholds(0.9, 0.9, 0.1), "qa": KGThresholds(0.9, 0.9, 0.5)}


@dataclass(frozen=True)
class TripleVerdict:
    head: str
    relation: str
    tail: str
    status: KGStatus
    subject_sim: float
    relation_sim: float
    object_sim: float
    kb_chunk_id: int | None


@dataclass(frozen=True)
class KGResult:
    status: KGStatus
    verdicts: list[TripleVerdict] = field(default_factory=list)


def aggregate(statuses: list[KGStatus]) -> KGStatus:
    """Reference aggregation: any CONFLICT, else any MISSING, else CONSISTENT."""
    if KGStatus.CONFLICT in statuses:
        return KGStatus.CONFLICT
    if KGStatus.MISSING in statuses:
        return KGStatus.MISSING
    return KGStatus.CONSISTENT


class KGChecker:
    """`check(response) -> KGResult`. Without a triples model every check is NO_TRIPLETS."""

    def __init__(self, store, extractor, embedder, thresholds: KGThresholds) -> None:
        self.store, self.extractor, self.embedder, self.t = store, extractor, embedder, thresholds
        if extractor is None:
            log.warning("no triples model in this profile: the KG signal is reported as no_triplets "
                        "for every answer (export a profile with a triples role to enable it)")

    def judge(self, heads: np.ndarray, rels: np.ndarray, tails: np.ndarray, texts) -> list[TripleVerdict]:
        out = []
        n = len(self.store)
        for i, (h, r, t) in enumerate(texts):
            if n == 0:
                out.append(TripleVerdict(h, r, t, KGStatus.MISSING, 0.0, 0.0, 0.0, None))
                continue
            s_sim = self.store.heads @ heads[i]
            k = min(self.t.candidates, n)
            cand = np.argpartition(-s_sim, k - 1)[:k] if k < n else np.arange(n)
            r_sim = self.store.relations[cand] @ rels[i]
            o_sim = self.store.tails[cand] @ tails[i]
            ok = (s_sim[cand] >= self.t.subject) & (r_sim >= self.t.relation)
            if ok.any():
                j = int(np.flatnonzero(ok)[np.argmax(o_sim[ok])])
                status = KGStatus.CONSISTENT if o_sim[j] >= self.t.object else KGStatus.CONFLICT
            else:
                j = int(np.argmax(s_sim[cand] + r_sim))
                status = KGStatus.MISSING
            out.append(TripleVerdict(h, r, t, status, float(s_sim[cand][j]), float(r_sim[j]),
                                     float(o_sim[j]), int(self.store.triples[cand[j]].chunk_id)))
        return out

    def check(self, response: str) -> KGResult:
        if not response or not response.strip():
            return KGResult(KGStatus.EMPTY_INPUT)
        if self.extractor is None:
            return KGResult(KGStatus.NO_TRIPLETS)
        triples = self.extractor.extract([response])[0]
        if not triples:
            return KGResult(KGStatus.NO_TRIPLETS)
        texts = [(t.head, t.relation, t.tail) for t in triples]
        emb = self.embedder.encode([x for trip in texts for x in trip]).reshape(len(texts), 3, -1)
        verdicts = self.judge(emb[:, 0], emb[:, 1], emb[:, 2], texts)
        return KGResult(aggregate([v.status for v in verdicts]), verdicts)
