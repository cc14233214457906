"""Structured outputs: JSON schemas, regexes, choices and GBNF grammars as token masks, in every runtime.

A grammar (StructuredOutputsParams) compiles to a DFA over UTF-8 bytes (automaton/, schema/, gbnf/),
then, per tokenizer, to the tokens each DFA state allows (tokens/); a `Guide` follows one
sequence through it. The samplers set forbidden tokens to -inf before sampling. Stdlib only:
the same code runs in CPython, on the server and in Pyodide. Names load on first use, so
importing SamplingParams (which imports the params module) does not load the compiler.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Budget": "py_engine.guided.budget", "GrammarTooLargeError": "py_engine.guided.errors",
    "GrammarTimeoutError": "py_engine.guided.errors", "GuidedError": "py_engine.guided.errors",
    "Guide": "py_engine.guided.guide", "guide_for": "py_engine.guided.guide",
    "StructuredOutputsParams": "py_engine.guided.params",
    "TokenGrammar": "py_engine.guided.tokens.index", "TokenMask": "py_engine.guided.tokens.index",
    "dfa_for": "py_engine.guided.compile", "grammar_node": "py_engine.guided.compile",
    "cached_grammar": "py_engine.guided.compile", "install_grammar": "py_engine.guided.compile",
    "token_grammar": "py_engine.guided.compile", "vocab_trie": "py_engine.guided.compile",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'py_engine.guided' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
