"""The held-out rule shared by the offline models' training and the evaluations.

QA: a question is held out when sha256 of its normalized text falls in the first
20 of 100 buckets. The offline NLI and reranker never train on held-out questions
(export/finetune_data.py), so QA evaluations with those models draw their test
questions (and policy-training questions) from the held-out side, or from a file
the export left out whole (`--finetune-exclude`).

FEVER: the offline models read no claim and no evidence sentence of
`fever/dev.jsonl` (issue 50: claims written from the same evidence made a claim
split leak its premises), so every dev claim is unseen: evaluate with `--split all`.
"""

from __future__ import annotations

import hashlib
from enum import Enum

HELDOUT_PERCENT = 20


def normalize_text(text: str) -> str:
    return " ".join(text.lower().split())


def is_validation(text: str, percent: int = HELDOUT_PERCENT) -> bool:
    return int(hashlib.sha256(normalize_text(text).encode()).hexdigest()[:8], 16) % 100 < percent


class Split(str, Enum):
    ALL = "all"
    HELDOUT = "heldout"     # never seen by the offline models' fine-tuning
    FIT = "fit"             # the side the offline models were fine-tuned on

    def keeps(self, text: str) -> bool:
        if self is Split.ALL:
            return True
        return is_validation(text) == (self is Split.HELDOUT)
