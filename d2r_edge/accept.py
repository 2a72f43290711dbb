"""Accept or revert a repair: keep whichever of the two answers the check trusts more (issue 51).

The paper's loop always returns the repaired answer, so a repair that breaks a
right answer costs the user the answer. Here a comparator decides, after the
repair, which of the two attempts to keep. It is a model of *which of two answers
to the same query is right*, fitted on training queries where every allowed
arm's outcome is known (`d2r-edge eval answers` writes it): for every repair
that changed the answer's correctness, the features of both attempts and the
target "the repaired answer is right and the first wrong" (1) vs "the first is
right and the repaired wrong" (0). Repairs that leave correctness unchanged
teach nothing about the choice and are not rows.

Features (PAIR_NAMES), all finite: the calibrated detector's P(wrong) of each
attempt and their difference, the NLI's support of each response by its
passages, the answers' log-probabilities (with a presence flag), whether the
answer changed, the share of the first attempt's self-consistency samples that
agree with the repaired answer (with a presence flag), and the arm's kind.

The decision: an unchanged answer keeps the repaired attempt (nothing to
choose); a changed one keeps it when P(repaired better) >= the threshold (the
out-of-fold balanced-accuracy threshold of the fit), else the first answer
stands. A reverted repair earns reward 0 (Eq. 2's reward judges what the user
gets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from d2r_edge.consistency import answer_key
from d2r_edge.detector import Detector, features, first_answer
from d2r_edge.diagnose import Label
from d2r_edge.errors import ConfigError
from d2r_edge.repair import IS_RETRIEVAL

PAIR_NAMES = ("pw_first", "pw_repaired", "pw_delta", "r_ent_first", "r_ent_repaired", "r_ent_delta",
              "lp_first", "lp_repaired", "lp_present", "changed", "samples_agree", "samples_present",
              "arm_retrieval")


class Kept(str, Enum):
    FIRST = "first"
    REPAIRED = "repaired"


@dataclass(frozen=True)
class Decision:
    kept: Kept
    p_better: float | None       # None: the answer did not change, nothing was compared
    threshold: float
    p_wrong_first: float
    p_wrong_repaired: float

    def to_record(self) -> dict:
        return {"kept": self.kept.value, "p_repaired_better": self.p_better, "threshold": self.threshold,
                "p_wrong_first": self.p_wrong_first, "p_wrong_repaired": self.p_wrong_repaired,
                "why": ("the answer did not change" if self.p_better is None else
                        f"P(repaired better) {'>=' if self.kept is Kept.REPAIRED else '<'} the threshold")}


def delivered(attempt, fact_verification: bool) -> str:
    """The answer the user gets from an attempt: FEVER's evidence-gated label (UNVERIFIED counts as
    NOT ENOUGH INFO), the response for QA."""
    if fact_verification:
        return (attempt.diagnosis.gated_label or Label.NOT_ENOUGH_INFO).value
    return attempt.generation.response


def pair_features(first, repaired, arm: int, p_wrong_first: float, p_wrong_repaired: float,
                  fact_verification: bool) -> dict[str, float]:
    """PAIR_NAMES of one (first, repaired) pair of attempts."""
    f1, f2 = features(first, fact_verification), features(repaired, fact_verification)
    lp1, lp2 = f1["gen_logprob_sum"], f2["gen_logprob_sum"]
    present = not (math.isnan(lp1) or math.isnan(lp2))
    samples = getattr(first.generation, "samples", None) or ()
    key2 = answer_key(first_answer(fact_verification, repaired), fact_verification)     # the generator's, as samples are
    agree = sum(answer_key(s, fact_verification) == key2 for s in samples) / len(samples) if samples else 0.0
    return {"pw_first": p_wrong_first, "pw_repaired": p_wrong_repaired, "pw_delta": p_wrong_repaired - p_wrong_first,
            "r_ent_first": f1["r_ent_max"], "r_ent_repaired": f2["r_ent_max"],
            "r_ent_delta": f2["r_ent_max"] - f1["r_ent_max"],
            "lp_first": lp1 if present else 0.0, "lp_repaired": lp2 if present else 0.0, "lp_present": float(present),
            "changed": float(changed(first, repaired, fact_verification)), "samples_agree": agree,
            "samples_present": float(bool(samples)), "arm_retrieval": float(IS_RETRIEVAL[arm])}


def changed(first, repaired, fact_verification: bool) -> bool:
    """Does the user get another answer from the repaired attempt?"""
    return answer_key(delivered(first, fact_verification), fact_verification) != \
        answer_key(delivered(repaired, fact_verification), fact_verification)


@dataclass(frozen=True)
class Comparator:
    """P(the repaired answer is the right one of the two), and the threshold at which it is kept."""

    model: Detector

    @property
    def threshold(self) -> float:
        return self.model.threshold

    def p_better(self, row: dict[str, float]) -> float:
        return float(self.model.p_wrong_many(np.array([[row[n] for n in PAIR_NAMES]], dtype=np.float64))[0])

    def decide(self, first, repaired, arm: int, p_wrong_first: float, p_wrong_repaired: float,
               fact_verification: bool) -> Decision:
        if not changed(first, repaired, fact_verification):
            return Decision(Kept.REPAIRED, None, self.threshold, p_wrong_first, p_wrong_repaired)
        p = self.p_better(pair_features(first, repaired, arm, p_wrong_first, p_wrong_repaired, fact_verification))
        return Decision(Kept.REPAIRED if p >= self.threshold else Kept.FIRST, p, self.threshold,
                        p_wrong_first, p_wrong_repaired)

    @classmethod
    def fit(cls, rows: list[dict[str, float]], repaired_better: list[bool], task: str) -> "Comparator":
        """From the pairs whose correctness differs (rows) and which one was right. Refuses (ConfigError,
        with how many it needs) when there are too few of either kind to choose a threshold out of fold."""
        y = np.asarray(repaired_better, dtype=bool)
        if len(rows) < 10 or min(y.sum(), (~y).sum()) < 2:
            raise ConfigError(f"the accept/revert comparator needs >= 10 repairs that changed whether the answer "
                              f"was right, >= 2 fixes and >= 2 breaks among them (the training queries gave "
                              f"{int(y.sum())} fixes and {int((~y).sum())} breaks); give more --train queries")
        x = np.array([[r[n] for n in PAIR_NAMES] for r in rows], dtype=np.float64)
        return cls(Detector.fit(x, y, PAIR_NAMES, task))

    def save(self, path: Path) -> None:
        self.model.save(path)

    @classmethod
    def load(cls, path: Path) -> "Comparator":
        return cls(Detector.load(path, fact_verification=False, names=PAIR_NAMES))

