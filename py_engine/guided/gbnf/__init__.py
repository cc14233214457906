"""llama.cpp's GBNF grammars: parsed (parser.py), then made a regex tree for the token-mask engine
(compile.py), regular where the grammar is and bounded in recursion depth where it is not."""
from py_engine.guided.gbnf.compile import MAX_RECURSION, gbnf_node
from py_engine.guided.gbnf.parser import MAX_GRAMMAR_CHARS, parse_gbnf

__all__ = ["MAX_GRAMMAR_CHARS", "MAX_RECURSION", "gbnf_node", "parse_gbnf"]
