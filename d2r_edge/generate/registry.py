"""The generators a run can use, by name: one registry (like the arms), not an if/elif ladder.

A factory takes the run's settings and the loaded encoders (the extractive generator reads
with the NLI, reranker and embedder) and returns a Generator. Adding a generator is one
entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from d2r_edge.config import Budget
from d2r_edge.errors import ConfigError


@dataclass(frozen=True)
class Encoders:
    nli: object
    reranker: object | None
    embedder: object


@dataclass(frozen=True)
class GeneratorSpec:
    name: str
    build: Callable[[object, Encoders], object]    # (RunSettings, Encoders) -> Generator
    help: str
    # the repair budget when no --budget-* flag is given: the paper's 3 s / 6 MB fits a generator that
    # answers in ~1 s; a local LLM gets a bound relative to its own first attempt (docs/results.md,
    # "Which budget for a local LLM", issue 35: 1.5x was the only budget under which neither bandit lost
    # accuracy on the FEVER training claims; the absolute 3 s left no generating arm)
    default_budget: Budget = Budget()


def _extractive(settings, enc: Encoders):
    from d2r_edge.generate.extractive import Extractive

    return Extractive(enc.nli, enc.reranker, enc.embedder)


def _openai(settings, enc: Encoders):
    from d2r_edge.generate.openai_compat import OpenAICompatible

    return OpenAICompatible(settings.base_url, settings.model, api_key_env=settings.api_key_env,
                            timeout_s=settings.timeout_s, samples=settings.self_consistency,
                            sample_temperature=settings.sample_temperature, self_check=settings.self_check,
                            self_check_samples=settings.self_check_samples)


GENERATORS: dict[str, GeneratorSpec] = {spec.name: spec for spec in (
    GeneratorSpec("extractive", _extractive, "no LLM: the NLI picks the label, the evidence sentences are the answer"),
    GeneratorSpec("openai", _openai, "any OpenAI-compatible chat server (--base-url, --model); repair budget "
                  "by default 1.5x the query's first attempt",
                  default_budget=Budget(latency_s=None, latency_x=1.5)),
)}


def build_generator(name: str, settings, encoders: Encoders):
    spec = GENERATORS.get(name)
    if spec is None:
        raise ConfigError(f"--generator must be one of {', '.join(GENERATORS)}, got {name!r}")
    return spec.build(settings, encoders)
