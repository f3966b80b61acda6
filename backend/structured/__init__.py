"""Structured outputs: a request's JSON schema, regex, choice or grammar, parsed (spec) and enforced token by token
(grammar, on llguidance). The grammar names load on first use, so importing the spec never loads llguidance."""
from __future__ import annotations

import importlib
from typing import Any

from backend.structured.spec import StructuredOutputs, parse_structured_outputs

_GRAMMAR_NAMES = ("CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "TokenMasker", "apply_token_bitmask")

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "StructuredOutputs", "TokenMasker",
           "apply_token_bitmask", "parse_structured_outputs"]


def __getattr__(name: str) -> Any:
    """The grammar module's public names, imported when first asked for."""
    if name in _GRAMMAR_NAMES:
        return getattr(importlib.import_module("backend.structured.grammar"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
