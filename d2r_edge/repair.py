"""The repair arms, as data: each one is a change to the pipeline config.

The paper's 11 (dense/BM25 at k = 10/20, each also with refresh; rerank; two
prompt styles), then ours: `second_hop`. A retrieval arm is one that changes
the evidence; only those may repair an UNVERIFIED FEVER answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from d2r_edge.retrieval.retriever import RetrievalConfig, RetrieverKind


class PromptStyle(str, Enum):
    SIMPLE = "simple"
    PARAPHRASE = "paraphrase"
    SIMPLIFY = "simplify"


@dataclass(frozen=True)
class PipelineConfig:
    """Reference default: dense retrieval, k = 5, no rerank, simple prompt, no refresh.

    `evidence_titles`: passages reach the generator and the NLI as "title\ntext"
    (see retrieval.retriever.evidence_text); False gives the bare text.
    """

    retrieval: RetrievalConfig = RetrievalConfig()
    prompt: PromptStyle = PromptStyle.SIMPLE
    refresh: bool = False
    evidence_titles: bool = True


@dataclass(frozen=True)
class Arm:
    name: str
    kind: RetrieverKind | None = None
    top_k: int | None = None
    refresh: bool = False
    rerank: bool = False
    prompt: PromptStyle | None = None
    second_hop: int = 0

    @property
    def is_retrieval(self) -> bool:
        return self.kind is not None or self.second_hop > 0

    def apply(self, cfg: PipelineConfig) -> PipelineConfig:
        r = cfg.retrieval
        if self.kind is not None:
            r = r.with_(kind=self.kind, top_k=self.top_k)
        if self.second_hop:
            r = r.with_(second_hop=self.second_hop)
        if self.rerank:
            # rerank the default candidate pool down to its top 3 (paper setting)
            r = r.with_(rerank=True)
        return replace(cfg, retrieval=r, prompt=self.prompt or cfg.prompt, refresh=self.refresh)


ARMS: tuple[Arm, ...] = tuple(
    [Arm(f"{kind.value}_k{k}{'_refresh' if refresh else ''}", kind=kind, top_k=k, refresh=refresh)
     for kind in (RetrieverKind.DENSE, RetrieverKind.BM25) for k in (10, 20) for refresh in (False, True)]
    + [Arm("rerank", rerank=True), Arm("prompt_paraphrase", prompt=PromptStyle.PARAPHRASE),
       Arm("prompt_simplify", prompt=PromptStyle.SIMPLIFY),
       # ours (issue 15): the default passages plus up to 2 whose title the top passage names
       Arm("second_hop", second_hop=2)]
)
ARM_NAMES = [a.name for a in ARMS]
IS_RETRIEVAL = np.array([a.is_retrieval for a in ARMS])


def allowed_arms(first_unverified: bool, restrict_unverified: bool = True) -> np.ndarray:
    """Reference rule (FEVER): an UNVERIFIED first answer may only be repaired by retrieval arms."""
    if first_unverified and restrict_unverified:
        return IS_RETRIEVAL.copy()
    return np.ones(len(ARMS), dtype=bool)
