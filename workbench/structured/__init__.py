"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice list or a grammar.

params.py holds what a request asks for (no dependency); grammar.py compiles it with xgrammar and
keeps each sequence's position in its grammar; the engine fills and applies the token bitmasks in
its sampling step (engine/llm_engine.py)."""
from workbench.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
