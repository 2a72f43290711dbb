"""The generators a run can use, by name: one registry (like the arms), not an if/elif ladder.

A factory takes the run's settings and the loaded encoders (the extractive generator reads
with the NLI, reranker and embedder) and returns a Generator. Adding a generator is one
entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def _extractive(settings, enc: Encoders):
    from d2r_edge.generate.extractive import Extractive

    return Extractive(enc.nli, enc.reranker, enc.embedder)


def _openai(settings, enc: Encoders):
    from d2r_edge.generate.openai_compat import OpenAICompatible

    return OpenAICompatible(settings.base_url, settings.model, api_key_env=settings.api_key_env,
                            timeout_s=settings.timeout_s, samples=settings.self_consistency,
                            sample_temperature=settings.sample_temperature)


GENERATORS: dict[str, GeneratorSpec] = {spec.name: spec for spec in (
    GeneratorSpec("extractive", _extractive, "no LLM: the NLI picks the label, the evidence sentences are the answer"),
    GeneratorSpec("openai", _openai, "any OpenAI-compatible chat server (--base-url, --model)"),
)}


def build_generator(name: str, settings, encoders: Encoders):
    spec = GENERATORS.get(name)
    if spec is None:
        raise ConfigError(f"--generator must be one of {', '.join(GENERATORS)}, got {name!r}")
    return spec.build(settings, encoders)
