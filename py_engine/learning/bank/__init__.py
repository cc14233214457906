"""The pattern store (ReasoningBank) and its retrieval gate.

    from py_engine.learning.bank import PatternBank, BankConfig, Pattern, Gate
    gate = Gate(bank, MiniLM.load(), threshold=0.8)
    gate.match("alice", "Which city is Zorbia's capital?")   # Match(pattern, similarity) or None

`index`, `patterns` and `gate` are ring 0 (stdlib; numpy, faiss or hnswlib
only when installed); `embed` is torch and imported on first use.
"""
from __future__ import annotations

from .gate import Gate, EmbeddingCache
from .index import VectorIndex
from .patterns import BankConfig, Match, Pattern, PatternBank

_LAZY = {"MiniLM": "embed", "HiddenStates": "embed", "minilm_dir": "embed"}

__all__ = ["BankConfig", "EmbeddingCache", "Gate", "Match", "Pattern", "PatternBank", "VectorIndex", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
