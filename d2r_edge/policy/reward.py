"""The resource-aware reward of Eq. 2."""

from __future__ import annotations

from d2r_edge.config import Budget, RewardConfig, RewardQuality
from d2r_edge.errors import PolicyError


def reward(*, no_failure: bool, kg_consistent: bool, nli_entailed: bool, latency_s: float,
           device_mem_mib: float, budget: Budget, cfg: RewardConfig = RewardConfig(),
           p_wrong: float | None = None, right: bool | None = None) -> float:
    """Eq. 2: (1/4)(1_NF + 1_KG + 2*1_NLI) * prod_x 1[x <= B_x] * (1 - x/B_x).

    `cfg.quality` DETECTOR puts the calibrated detector's 1 - P(wrong) of the repaired answer
    (`p_wrong`) in place of the indicators; the cost terms are the same. LABEL puts 1 when the repaired
    answer is right by the query's gold (`right`, training only), else 0.

    `cfg.gates=False` drops the hard gates ("unconstrained" ablation),
    `cfg.cost_weighting=False` drops the (1 - x/B_x) terms ("unweighted").
    Without gates a cost above its budget makes its weight negative; it is
    clipped at 0 so rewards stay in [0, 1].
    """
    for name, value in (("latency_s", latency_s), ("device_mem_mib", device_mem_mib)):
        if not isinstance(value, (int, float)) or value != value or value < 0:
            raise PolicyError(f"{name} must be a number >= 0, got {value!r}")
    budget = budget.absolute()
    if cfg.quality is RewardQuality.DETECTOR:
        if not isinstance(p_wrong, (int, float)) or not 0.0 <= p_wrong <= 1.0:
            raise PolicyError(f"the detector reward needs the repaired answer's P(wrong) in [0, 1], got {p_wrong!r}")
        quality = 1.0 - float(p_wrong)
    elif cfg.quality is RewardQuality.LABEL:
        if not isinstance(right, bool):
            raise PolicyError(f"the label reward needs whether the repaired answer is right by the query's gold "
                              f"(True / False), got {right!r}: train on labeled queries")
        quality = float(right)
    else:
        quality = 0.25 * (float(no_failure) + float(kg_consistent) + 2.0 * float(nli_entailed))
    factor = 1.0
    for used, limit in ((latency_s, budget.latency_s), (device_mem_mib, budget.device_mem_mib)):
        if cfg.gates and used > limit:
            return 0.0
        if cfg.cost_weighting:
            factor *= max(0.0, 1.0 - used / limit)
    return quality * factor
