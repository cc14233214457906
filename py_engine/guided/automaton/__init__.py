"""Regular languages over UTF-8 bytes: a regex parser, code-point trees, Thompson NFAs and DFAs."""
from py_engine.guided.automaton.dfa import DFA, compile_dfa
from py_engine.guided.automaton.regex import GuidedSyntaxError, parse_regex
from py_engine.guided.budget import Budget

__all__ = ["DFA", "Budget", "GuidedSyntaxError", "compile_dfa", "parse_regex"]
