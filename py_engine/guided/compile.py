"""Compiling a request's structured-output params, with the caches that make repeats free.

    grammar = token_grammar(params, tokenizer, eos_token_ids)   # DFA + vocabulary: token masks
    guide = Guide(grammar)                                       # one per sequence

Three caches: the vocabulary trie per tokenizer (kept on the tokenizer), the DFA per grammar
(`params.digest`, a hash of its canonical text, which may be megabytes), and the token grammar
per (grammar, vocabulary, EOS ids), also kept on the params object itself so that whoever
compiled it (a server, off its engine thread, maybe in another process: `install_grammar`) hands
it to the engine with the request. The last two are bounded in entries and in DFA cells. Every
compile runs under a `Budget` (tree nodes, states, seconds; budget.py), active from the schema's
first node to the DFA's last state: a hostile schema fails with GrammarTooLargeError early, it
does not exhaust the process.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

from py_engine.guided.automaton import DFA, compile_dfa, parse_regex
from py_engine.guided.automaton.nodes import Node, alt, literal
from py_engine.guided.budget import Budget
from py_engine.guided.params import DEFAULT_WHITESPACE, StructuredOutputsParams
from py_engine.guided.schema import JsonOptions, compile_schema
from py_engine.guided.schema.values import any_object, any_value
from py_engine.guided.tokens.index import TokenGrammar
from py_engine.guided.tokens.vocab import VocabTrie, token_bytes

DFAS_KEPT = 128
GRAMMARS_KEPT = 64
CELLS_KEPT = 4_000_000  # DFA table entries a cache holds in all (~32 MB of list slots): big grammars go first


class _Cache:
    """Least recently used first out, bounded in entries and in DFA cells (states x byte classes)."""

    def __init__(self, entries: int) -> None:
        self.entries, self.items, self.cells = entries, OrderedDict(), 0

    def get(self, key: Any) -> Any:
        found = self.items.get(key)
        if found is not None:
            self.items.move_to_end(key)
        return found

    def put(self, key: Any, value: Any, dfa: DFA) -> None:
        if key in self.items:
            return
        self.items[key] = (value, _cells(dfa))
        self.cells += _cells(dfa)
        while len(self.items) > self.entries or (self.cells > CELLS_KEPT and len(self.items) > 1):
            _, (_, cells) = self.items.popitem(last=False)
            self.cells -= cells


def _cells(dfa: DFA) -> int:
    return dfa.num_states * (len(dfa.rows[0]) if dfa.rows else 0)


_lock = threading.Lock()
_dfas = _Cache(DFAS_KEPT)
_grammars = _Cache(GRAMMARS_KEPT)


def grammar_node(params: StructuredOutputsParams, budget: Budget | None = None) -> Node:
    """The regex tree of what `params` allows, built within `budget` (a fresh default one if None)."""
    with (budget or Budget()).active():
        return _grammar_node(params)


def _grammar_node(params: StructuredOutputsParams) -> Node:
    ws = parse_regex(params.whitespace_pattern if params.whitespace_pattern is not None else DEFAULT_WHITESPACE)
    if params.json is not None:
        return compile_schema(params.json, JsonOptions(ws))
    if params.regex is not None:
        return parse_regex(params.regex)
    if params.choice is not None:
        return alt(*(literal(c) for c in params.choice))
    if params.grammar is not None:
        from py_engine.guided.gbnf import gbnf_node

        return gbnf_node(params.grammar)
    options = JsonOptions(ws)
    return any_object(any_value(options.any_depth, ws), ws)


def dfa_for(params: StructuredOutputsParams, budget: Budget | None = None) -> DFA:
    key = params.digest
    with _lock:
        found = _dfas.get(key)
    if found is not None:
        return found[0]
    budget = budget or Budget()
    dfa = compile_dfa(grammar_node(params, budget), budget)
    with _lock:
        _dfas.put(key, dfa, dfa)
    return dfa


def vocab_trie(tokenizer: Any) -> VocabTrie:
    """The tokenizer's vocabulary trie, built on first use and kept on the tokenizer."""
    trie = getattr(tokenizer, "_guided_trie", None)
    if trie is None:
        with _lock:
            trie = getattr(tokenizer, "_guided_trie", None)
            if trie is None:
                trie = VocabTrie(token_bytes(tokenizer))
                tokenizer._guided_trie = trie
    return trie


def token_grammar(params: StructuredOutputsParams, tokenizer: Any, eos_token_ids: Sequence[int] = (),
                  budget: Budget | None = None) -> TokenGrammar:
    """The DFA of `params` over the tokenizer's vocabulary (cached; see the module docstring)."""
    found = cached_grammar(params, tokenizer, eos_token_ids)
    if found is None:
        trie = vocab_trie(tokenizer)
        eos = tuple(eos_token_ids)
        found = install_grammar(params, TokenGrammar(dfa_for(params, budget), trie, eos), eos)
    return found


def cached_grammar(params: StructuredOutputsParams, tokenizer: Any,
                   eos_token_ids: Sequence[int] = ()) -> TokenGrammar | None:
    """The token grammar of `params` if it was compiled already (kept on params, or in the cache)."""
    trie = vocab_trie(tokenizer)
    own = (id(trie), tuple(eos_token_ids))
    found = params.compiled.get(own)
    if found is None:
        with _lock:
            found = _grammars.get((params.digest, *own))
        if found is None:
            return None
        found = params.compiled[own] = found[0]
    return found


def install_grammar(params: StructuredOutputsParams, grammar: TokenGrammar,
                    eos_token_ids: Sequence[int] = ()) -> TokenGrammar:
    """Keep `grammar` (compiled for params and these EOS ids, here or in a worker process) in the
    cache and on params."""
    own = (id(grammar.trie), tuple(eos_token_ids))
    with _lock:
        _grammars.put((params.digest, *own), grammar, grammar.dfa)
    params.compiled[own] = grammar
    return grammar
