"""Frozen, validated configuration. Units live in the names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from d2r_edge.errors import ConfigError


def coerce_enum(obj, name: str, enum_type) -> None:
    """In a frozen dataclass's __post_init__: accept the enum's value string too."""
    value = getattr(obj, name)
    if isinstance(value, enum_type):
        return
    try:
        object.__setattr__(obj, name, enum_type(value))
    except ValueError:
        raise ConfigError(
            f"{name} must be one of {[e.value for e in enum_type]}, got {value!r}"
        ) from None


def _positive(name: str, value: object, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")


# a first attempt timed at less than this still gives a relative budget of latency_x times it
MIN_FIRST_ATTEMPT_S = 1e-3


@dataclass(frozen=True)
class Budget:
    """Per repair action budgets (paper: 3 s and 6 MB; stringent 0.7x, relaxed 1.5x).

    `latency_x`: a repair action may also take at most this many times the query's own first
    attempt (retrieve + generate + diagnose), so a slow local generator is not held to a budget
    set for an API that answers in 1.5 s. With both, the smaller bound holds; `latency_s=None`
    (only with `latency_x`) leaves the relative bound alone. `for_attempt` turns it into the
    absolute budget of one query, which is what masks, rewards and records use.
    """

    latency_s: float | None = 3.0
    device_mem_mib: float = 6.0
    latency_x: float | None = None

    def __post_init__(self) -> None:
        if self.latency_s is None and self.latency_x is None:
            raise ConfigError("a budget needs latency_s (seconds per repair action) or latency_x "
                              "(times the query's first attempt), or both")
        if self.latency_s is not None:
            _positive("latency_s", self.latency_s)
        if self.latency_x is not None:
            _positive("latency_x", self.latency_x)
        _positive("device_mem_mib", self.device_mem_mib)

    @property
    def relative(self) -> bool:
        return self.latency_x is not None

    def scaled(self, factor: float) -> "Budget":
        _positive("factor", factor)
        return Budget(None if self.latency_s is None else self.latency_s * factor, self.device_mem_mib * factor,
                      None if self.latency_x is None else self.latency_x * factor)

    def for_attempt(self, first_attempt_s: float) -> "Budget":
        """The absolute budget of one query whose first attempt took `first_attempt_s`."""
        if self.latency_x is None:
            return self
        first = first_attempt_s if math.isfinite(first_attempt_s) else 0.0
        rel = self.latency_x * max(first, MIN_FIRST_ATTEMPT_S)
        return Budget(rel if self.latency_s is None else min(self.latency_s, rel), self.device_mem_mib)

    def exceeded_by(self, latency_s: float, mem_growth_mib: float) -> bool:
        """Whether a repair action's measured cost broke this (absolute) budget."""
        b = self.absolute()
        return bool(latency_s > b.latency_s or mem_growth_mib > b.device_mem_mib)

    def absolute(self) -> "Budget":
        """This budget where one query's bound is needed; a relative one must be resolved first."""
        if self.latency_x is not None:
            raise ConfigError("a relative budget (latency_x) has no bound until the query's first attempt is "
                              "known: use Budget.for_attempt(first_attempt_s)")
        return self

    def describe(self, first_attempt_s: float | None = None) -> dict:
        """What a record or summary says of it (with the query's own bound when `first_attempt_s`)."""
        out: dict = {"latency_s": self.latency_s, "device_mem_mib": self.device_mem_mib}
        if self.latency_x is not None:
            out["latency_x"] = self.latency_x
            if first_attempt_s is not None:
                out["first_attempt_s"] = first_attempt_s
                out["latency_s"] = self.for_attempt(first_attempt_s).latency_s
                out["latency_s_cap"] = self.latency_s
        return out


BUDGET_PRESETS = {"paper": Budget(), "stringent": Budget().scaled(0.7), "relaxed": Budget().scaled(1.5)}


@dataclass(frozen=True)
class LinUCBConfig:
    """LinUCB settings (Eq. 1, 3). `reinvert_every` bounds Sherman–Morrison drift."""

    alpha: float = 2.0
    reinvert_every: int = 1000

    def __post_init__(self) -> None:
        _positive("alpha", self.alpha, allow_zero=True)
        if not isinstance(self.reinvert_every, int) or self.reinvert_every < 0:
            raise ConfigError(f"reinvert_every must be an int >= 0 (0 = never), got {self.reinvert_every!r}")


@dataclass(frozen=True)
class ExplorationConfig:
    """Training-time weighted random draw (reference code; off by default as in the paper's runs)."""

    rate: float = 0.0
    retrieval_share: float = 0.25   # all retrieval arms together
    other_arm_weight: float = 0.25  # each non-retrieval arm
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, (int, float)) and 0.0 <= self.rate <= 1.0):
            raise ConfigError(f"exploration rate must be in [0, 1], got {self.rate!r}")
        _positive("retrieval_share", self.retrieval_share, allow_zero=True)
        _positive("other_arm_weight", self.other_arm_weight, allow_zero=True)
        if self.retrieval_share == 0 and self.other_arm_weight == 0:
            raise ConfigError("retrieval_share and other_arm_weight cannot both be 0")


@dataclass(frozen=True)
class ContextConfig:
    """Context vector x (Appendix B). `query_dim=None` keeps the full query embedding."""

    embedding_dim: int = 384
    query_dim: int | None = 128
    projection_seed: int = 0
    embedder_id: str | None = None          # which embedding space (Embedder.space_id)
    p_wrong: bool = False                   # the calibrated gate's P(wrong) as one more feature

    def __post_init__(self) -> None:
        if not isinstance(self.embedding_dim, int) or self.embedding_dim < 1:
            raise ConfigError(f"embedding_dim must be an int >= 1, got {self.embedding_dim!r}")
        if self.query_dim is not None and (not isinstance(self.query_dim, int) or self.query_dim < 1):
            raise ConfigError(f"query_dim must be an int >= 1 or None, got {self.query_dim!r}")

    @property
    def projected_dim(self) -> int:
        return self.embedding_dim if self.query_dim is None else self.query_dim

    @property
    def dim(self) -> int:
        # query + failure(5) + KG(5) + e_q(3) + e_r(3) + budgets(2) [+ P(wrong)] + bias(1)
        return self.projected_dim + 19 + int(self.p_wrong)


class RewardQuality(str, Enum):
    """What the reward's quality term reads from the repaired answer."""

    ALG1 = "alg1"            # Eq. 2: (1/4)(1_NF + 1_KG + 2*1_NLI) of its Alg. 1 diagnosis (the paper)
    DETECTOR = "detector"    # 1 - P(wrong) of the calibrated detector (needs one; `train` fits it first)
    # 1 when the repaired answer is right by the query's gold label / answer: `train` on labeled queries only.
    # With the fixed policy kind it ranks arms by their share of right repaired answers, close to `eval
    # answers`' best_fixed_labeled (d2r_edge/policy/fixed.py says where they differ)
    LABEL = "label"


@dataclass(frozen=True)
class RewardConfig:
    """Eq. 2 and the paper's ablations: `gates=False` is "unconstrained", `cost_weighting=False` "unweighted".
    `quality`: Eq. 2's diagnostic indicators (the paper) or the calibrated detector's P(right) of the
    repaired answer; the budget gates and cost terms stay Eq. 2's either way."""

    gates: bool = True
    cost_weighting: bool = True
    quality: RewardQuality = RewardQuality.ALG1

    def __post_init__(self) -> None:
        coerce_enum(self, "quality", RewardQuality)
