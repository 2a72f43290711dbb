"""The context vector x of Appendix B.

x = [projected query embedding, failure one-hot (5), KG status one-hot (5),
e_q one-hot (3), e_r one-hot (3), remaining latency and memory budget as
fractions in [0, 1] (2), bias (1)]; with the calibrated gate
(`ContextConfig.p_wrong`) the detector's P(wrong) comes before the bias.
"""

from __future__ import annotations

import numpy as np

from d2r_edge.config import Budget, ContextConfig
from d2r_edge.errors import PolicyError
from d2r_edge.signals import Entailment, FailureType, KGStatus

_FAILURES = list(FailureType)
_KG = list(KGStatus)
_ENT = list(Entailment)


class ContextBuilder:
    """Builds x; the random projection is seeded and fixed for the builder's life."""

    def __init__(self, cfg: ContextConfig = ContextConfig()) -> None:
        self.cfg = cfg
        if cfg.query_dim is None:
            self.projection = None
        else:
            rng = np.random.default_rng(cfg.projection_seed)
            # Gaussian random projection (Johnson–Lindenstrauss): N(0, 1/k) entries
            self.projection = rng.normal(0.0, 1.0 / np.sqrt(cfg.query_dim),
                                         size=(cfg.embedding_dim, cfg.query_dim))

    @property
    def dim(self) -> int:
        return self.cfg.dim

    @property
    def spec(self) -> dict:
        """How x is built: saved in a policy file, so a policy is never scored on contexts
        built another way (another projection seed, size or embedder)."""
        c = self.cfg
        spec = {"features": "appendix-b/v1", "embedding_dim": c.embedding_dim, "query_dim": c.query_dim,
                "projection_seed": c.projection_seed, "embedder": c.embedder_id}
        if c.p_wrong:       # only then: policies saved before the gate existed keep matching
            spec["p_wrong"] = True
        return spec

    def build(self, query_embedding: np.ndarray, failure: FailureType, kg: KGStatus,
              e_q: Entailment, e_r: Entailment, remaining_latency_s: float,
              remaining_mem_mib: float, budget: Budget, p_wrong: float | None = None) -> np.ndarray:
        q = np.asarray(query_embedding, dtype=np.float64)
        if q.shape != (self.cfg.embedding_dim,) or not np.isfinite(q).all():
            raise PolicyError(
                f"query embedding must be a finite vector of length {self.cfg.embedding_dim}, "
                f"got shape {q.shape}; set ContextConfig.embedding_dim to the embedder's size"
            )
        if self.projection is not None:
            q = q @ self.projection
        x = np.zeros(self.dim)
        k = q.shape[0]
        x[:k] = q
        x[k + _FAILURES.index(FailureType(failure))] = 1.0
        k += len(_FAILURES)
        x[k + _KG.index(KGStatus(kg))] = 1.0
        k += len(_KG)
        x[k + _ENT.index(Entailment(e_q))] = 1.0
        k += len(_ENT)
        x[k + _ENT.index(Entailment(e_r))] = 1.0
        k += len(_ENT)
        budget = budget.absolute()
        x[k] = float(np.clip(remaining_latency_s / budget.latency_s, 0.0, 1.0))
        x[k + 1] = float(np.clip(remaining_mem_mib / budget.device_mem_mib, 0.0, 1.0))
        k += 2
        if self.cfg.p_wrong:
            if p_wrong is None or not np.isfinite(p_wrong):
                raise PolicyError("this context has a P(wrong) feature (the calibrated gate) but none was given; "
                                  "load the detector (--gate calibrated --detector FILE)")
            x[k] = float(np.clip(p_wrong, 0.0, 1.0))
            k += 1
        x[k] = 1.0
        return x
