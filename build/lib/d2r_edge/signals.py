"""Closed sets shared by diagnosis, the KG check and the policy's context vector."""

from __future__ import annotations

from enum import Enum


class FailureType(str, Enum):
    """Algorithm 1's output."""

    NO_FAILURE = "no_failure"
    WRONG_PREDICATE = "wrong_predicate"              # KG conflict
    INSUFFICIENT_EVIDENCE = "insufficient_evidence"  # e_q neutral
    WRONG_RESPONSE = "wrong_response"                # e_r not entailment
    LABEL_EVIDENCE_MISMATCH = "label_evidence_mismatch"


class KGStatus(str, Enum):
    CONSISTENT = "consistent"
    CONFLICT = "conflict"
    MISSING = "missing"
    EMPTY_INPUT = "empty_input"
    NO_TRIPLETS = "no_triplets"


class Entailment(str, Enum):
    ENTAILMENT = "entailment"
    NEUTRAL = "neutral"
    CONTRADICTION = "contradiction"
