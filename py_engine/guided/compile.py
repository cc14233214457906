"""Compiling a request's structured-output params, with the caches that make repeats free.

    grammar = token_grammar(params, tokenizer, eos_token_ids)   # DFA + vocabulary: token masks
    guide = Guide(grammar)                                       # one per sequence

Three caches, each bounded: the vocabulary trie per tokenizer (kept on the tokenizer), the DFA
per grammar text (`params.key`), and the token grammar per (grammar, vocabulary, EOS ids), also
kept on the params object itself so that whoever compiled it (a server, off its engine thread)
hands it to the engine with the request. Every compile runs under a `Budget` (states, seconds):
a hostile schema fails with GrammarTooLargeError, it does not exhaust the process.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

from py_engine.guided.automaton import DFA, Budget, compile_dfa, parse_regex
from py_engine.guided.automaton.nodes import Node, alt, literal
from py_engine.guided.params import DEFAULT_WHITESPACE, StructuredOutputsParams
from py_engine.guided.schema import JsonOptions, compile_schema
from py_engine.guided.schema.values import any_object, any_value
from py_engine.guided.tokens.index import TokenGrammar
from py_engine.guided.tokens.vocab import VocabTrie, token_bytes

DFAS_KEPT = 128
GRAMMARS_KEPT = 64
_lock = threading.Lock()
_dfas: OrderedDict[str, DFA] = OrderedDict()
_grammars: OrderedDict[tuple, TokenGrammar] = OrderedDict()


def grammar_node(params: StructuredOutputsParams) -> Node:
    """The regex tree of what `params` allows."""
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
    key = params.key
    with _lock:
        found = _dfas.get(key)
        if found is not None:
            _dfas.move_to_end(key)
            return found
    dfa = compile_dfa(grammar_node(params), budget or Budget())
    with _lock:
        _dfas[key] = dfa
        if len(_dfas) > DFAS_KEPT:
            _dfas.popitem(last=False)
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
    trie = vocab_trie(tokenizer)
    eos = tuple(eos_token_ids)
    own = (id(trie), eos)
    found = params.compiled.get(own)
    if found is not None:
        return found
    key = (params.key, *own)
    with _lock:
        found = _grammars.get(key)
        if found is not None:
            _grammars.move_to_end(key)
    if found is None:
        found = TokenGrammar(dfa_for(params, budget), trie, eos)
        with _lock:
            _grammars[key] = found
            if len(_grammars) > GRAMMARS_KEPT:
                _grammars.popitem(last=False)
    params.compiled[own] = found
    return found
