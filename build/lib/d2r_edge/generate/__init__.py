"""Generators: the black box that writes answers (an OpenAI-compatible server, or extractive)."""

from d2r_edge.generate.base import Generation, Generator
from d2r_edge.generate.extractive import Extractive
from d2r_edge.generate.openai_compat import OpenAICompatible

__all__ = ["Generation", "Generator", "Extractive", "OpenAICompatible"]
