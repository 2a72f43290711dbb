"""The two tasks on one pipeline: fact verification (FEVER) and short-answer QA (HotpotQA)."""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from importlib import resources

from d2r_edge.kg.check import KG_PRESETS, KGThresholds
from d2r_edge.repair import PromptStyle


class Task(str, Enum):
    FEVER = "fever"
    QA = "qa"

    @property
    def fact_verification(self) -> bool:
        return self is Task.FEVER

    @property
    def kg_thresholds(self) -> KGThresholds:
        return KG_PRESETS[self.value]

    @property
    def restrict_unverified(self) -> bool:
        # reference: FEVER limits UNVERIFIED repairs to retrieval arms; its QA scripts allow all 11
        return self is Task.FEVER


@lru_cache(maxsize=None)
def _templates() -> dict:
    text = resources.files("d2r_edge.data").joinpath("prompts.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


@dataclass(frozen=True)
class Prompt:
    system: str
    user: str


def build_prompt(task: Task, style: PromptStyle, query: str, passages: list[str]) -> Prompt:
    table = _templates()[task.value]
    evidence = "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(passages)) or "(no passages found)"
    return Prompt(table["system"], table[style.value].format(query=query, evidence=evidence))


def build_self_check(task: Task, query: str, passages: list[str], answer: str,
                     samples: tuple[str, ...] = ()) -> Prompt:
    """The P(True) question (issue 53): the task's passages and query, the proposed answer, True or False?
    With `samples` (the self-consistency answers), they are shown first as brainstormed answers."""
    table = _templates()[task.value]
    evidence = "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(passages)) or "(no passages found)"
    if samples:
        listed = "\n".join(f"- {s}" for s in samples)
        return Prompt(table["system"], table["self_check_samples"].format(query=query, evidence=evidence,
                                                                          answer=answer, samples=listed))
    return Prompt(table["system"], table["self_check"].format(query=query, evidence=evidence, answer=answer))


def self_check_sha256(task: Task, with_samples: bool = False) -> str:
    table = _templates()[task.value]
    key = "self_check_samples" if with_samples else "self_check"
    return hashlib.sha256(f"{table['system']}\n{table[key]}".encode()).hexdigest()


def template_sha256(task: Task, style: PromptStyle) -> str:
    """The prompt template of (task, style) with its system line: cached answers are keyed by it,
    so a changed prompt never replays answers to the old one."""
    table = _templates()[task.value]
    return hashlib.sha256(f"{table['system']}\n{table[style.value]}".encode()).hexdigest()
