"""The repair arms, as data: each one is a change to the pipeline config.

The paper's 11 (dense/BM25 at k = 10/20, each also with refresh; rerank; two
prompt styles), then ours: `second_hop`, `dense_k3` (fewer passages),
`prompt_extract` (copy the answering span) and `sample_majority` (the majority
of the first attempt's self-consistency samples). A retrieval arm is one that changes
the evidence; only those may repair an UNVERIFIED FEVER answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from d2r_edge.onnx.manifest import Role
from d2r_edge.retrieval.retriever import RetrievalConfig, RetrieverKind


class PromptStyle(str, Enum):
    SIMPLE = "simple"
    PARAPHRASE = "paraphrase"
    SIMPLIFY = "simplify"
    EXTRACT = "extract"          # copy the deciding sentence / the shortest answering span (issue 35)


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
    # answer with the majority of the first attempt's greedy answer and its self-consistency
    # samples (d2r_edge.consistency.majority) instead of generating again
    majority: bool = False
    # answer with the span the reader read from the first attempt's passages (issue 53), no generation
    reader_answer: bool = False


@dataclass(frozen=True)
class Arm:
    name: str
    kind: RetrieverKind | None = None
    top_k: int | None = None
    refresh: bool = False
    rerank: bool = False
    prompt: PromptStyle | None = None
    second_hop: int = 0
    majority: bool = False                      # vote among the first attempt's samples
    reader_answer: bool = False                 # the reader's span of the first attempt's passages
    requires: frozenset[Role] = frozenset()     # model roles the arm cannot run without

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
        return replace(cfg, retrieval=r, prompt=self.prompt or cfg.prompt, refresh=self.refresh,
                       majority=self.majority, reader_answer=self.reader_answer)


ARMS: tuple[Arm, ...] = tuple(
    [Arm(f"{kind.value}_k{k}{'_refresh' if refresh else ''}", kind=kind, top_k=k, refresh=refresh)
     for kind in (RetrieverKind.DENSE, RetrieverKind.BM25) for k in (10, 20) for refresh in (False, True)]
    + [Arm("rerank", rerank=True, requires=frozenset({Role.RERANKER})),
       Arm("prompt_paraphrase", prompt=PromptStyle.PARAPHRASE),
       Arm("prompt_simplify", prompt=PromptStyle.SIMPLIFY),
       # ours (issue 15): the default passages plus up to 2 whose title the top passage names
       Arm("second_hop", second_hop=2),
       # ours (issue 35), for failures of the generator with the evidence in hand: fewer passages
       # (less to be distracted by, the reranker-free sibling of `rerank`'s top 3) and a prompt that
       # asks for a copied span instead of an answer in the model's own words
       Arm("dense_k3", kind=RetrieverKind.DENSE, top_k=3),
       Arm("prompt_extract", prompt=PromptStyle.EXTRACT),
       # the most common answer among the first attempt's greedy answer and its self-consistency
       # samples: no generation at all (needs --self-consistency N >= 2)
       Arm("sample_majority", majority=True),
       # ours (issue 53), QA: the independent reader's span where it found one in the first attempt's
       # passages; no generation at all
       Arm("reader_span", reader_answer=True, requires=frozenset({Role.READER}))]
)
MIN_VOTE_SAMPLES = 2     # with one sample a tie always goes to the greedy answer: the arm could not change it
ARM_NAMES = [a.name for a in ARMS]
IS_RETRIEVAL = np.array([a.is_retrieval for a in ARMS])


@dataclass(frozen=True)
class ArmAvailability:
    """Which arms a loaded pipeline can run. An arm that needs a model role the profile
    lacks (`rerank` without a reranker) is off for every policy, baseline and the oracle,
    the way the UNVERIFIED rule takes arms away; `unavailable` says why, per arm name."""

    mask: np.ndarray = field(default_factory=lambda: np.ones(len(ARMS), dtype=bool))
    unavailable: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mask = np.asarray(self.mask, dtype=bool)
        if mask.shape != (len(ARMS),):
            raise ValueError(f"an availability mask needs one entry per arm ({len(ARMS)}), got {mask.shape}")
        mask.setflags(write=False)
        object.__setattr__(self, "mask", mask)

    def reason(self, arm: int) -> str | None:
        return self.unavailable.get(ARM_NAMES[arm])


def arm_availability(roles: Iterable[Role], absent: Mapping[Role, str] | None = None,
                     samples: int = 0, fact_verification: bool = False) -> ArmAvailability:
    """The one place that decides which arms can run with the loaded model roles and generator.

    `absent`: the manifest's reasons for roles it does not have (shown to the user); `samples`: the
    generator's self-consistency samples per first answer (the voting arm needs >= 2);
    `fact_verification`: the reader answers questions, not claims, so its arm is off for FEVER."""
    have, absent = frozenset(roles), dict(absent or {})
    mask, why = np.ones(len(ARMS), dtype=bool), {}
    for i, arm in enumerate(ARMS):
        if arm.majority and samples < MIN_VOTE_SAMPLES:
            mask[i] = False
            why[arm.name] = (f"no self-consistency samples to vote among (the generator draws {samples}; "
                             f"give an LLM generator --self-consistency N with N >= {MIN_VOTE_SAMPLES})")
            continue
        if arm.reader_answer and fact_verification:
            mask[i] = False
            why[arm.name] = "the reader answers questions with a span; a claim's label is not one"
            continue
        missing = sorted(arm.requires - have, key=lambda r: r.value)
        if missing:
            mask[i] = False
            why[arm.name] = "; ".join(
                f"no {r.value} model" + (f" ({absent[r]})" if r in absent else " in the profile's manifest")
                for r in missing)
    return ArmAvailability(mask, why)


def allowed_arms(first_unverified: bool, restrict_unverified: bool = True,
                 available: np.ndarray | None = None) -> np.ndarray:
    """Reference rule (FEVER): an UNVERIFIED first answer may only be repaired by retrieval arms;
    arms the loaded models cannot run (`available`, from `arm_availability`) are never allowed."""
    out = IS_RETRIEVAL.copy() if first_unverified and restrict_unverified else np.ones(len(ARMS), dtype=bool)
    if available is not None:
        out &= np.asarray(available, dtype=bool)
    return out
