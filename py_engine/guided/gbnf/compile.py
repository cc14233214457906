"""A GBNF grammar as a regex tree (automaton/nodes.py), for the same DFA and token masks as JSON
Schema and regex.

    node = gbnf_node('root ::= item+\\nitem ::= "- " [a-z]+ "\\n"')

A context-free grammar is regular when no rule needs a stack; here:
  - a rule that calls itself only at the end of its alternatives (`list ::= item list | item`) is
    a loop (item* item), and one that calls itself only at their start (`e ::= e "+" t | t`,
    which llama.cpp refuses) is t ("+" t)*: no bound on either;
  - `x (sep x)*` becomes one `Join` node, which the NFA builds with a single copy of x;
  - any other recursion (JSON's value -> object -> value, arithmetic's parentheses) is unrolled
    until one cycle of rules is on the expansion stack MAX_RECURSION times; what would go deeper
    is dropped (NOTHING), so the output nests at most that deep. A grammar that cannot end
    within the bound (`root ::= "(" root ")"`) is a GuidedError naming the rule.
The expansion of a rule depends only on how deep its cycle is, so each (rule, depth) is built
once and shared. Work is bounded by MAX_EXPANSIONS, the expanded tree's weight by the compile's
Budget (max_nodes; MAX_WEIGHT outside one), and the node building and automaton by that Budget too.
Stdlib only.
"""
from __future__ import annotations

from functools import reduce
from typing import Any

from py_engine.guided.automaton.nodes import (EMPTY, NOTHING, Node, alt, chars, complement, concat, join, literal,
                                              normalize, repeat)
from py_engine.guided.budget import current
from py_engine.guided.errors import GrammarTooLargeError, GuidedError
from py_engine.guided.gbnf.parser import PARAM, Alt, Class, Expr, Lit, Ref, Rep, Seq, parse_gbnf

MAX_RECURSION = 6  # rule expansions of one recursive cycle on the stack (JSON, arithmetic: two per nesting level)
MAX_EXPANSIONS = 20_000
MAX_WEIGHT = 200_000  # code-point sets in the expanded tree
MAX_JOIN_ITEMS = 16  # the longest x looked for in `x (sep x)*`


def gbnf_node(text: str, max_recursion: int = MAX_RECURSION) -> Node:
    """The regex tree of the grammar's `root` (see the module docstring for the bounds)."""
    rules = {name: _unroll_self(name, body) for name, body in parse_gbnf(text).items()}
    node = _Expander(rules, max_recursion).rule("root")
    if node == NOTHING:
        raise GuidedError(f"grammar: no output of root ends within {max_recursion} nested expansions of its "
                          "recursive rules (a rule that always calls itself, or recursion deeper than the bound)",
                          PARAM)
    return node


# --- self-recursion as loops ----------------------------------------------------------------------
def _mentions(e: Expr, name: str) -> bool:
    if isinstance(e, Ref):
        return e.name == name
    if isinstance(e, (Seq, Alt)):
        return any(_mentions(x, name) for x in e.items)
    if isinstance(e, Rep):
        return _mentions(e.item, name)
    return False


_NONE = Alt(())  # the empty language (no alternative)
_EPS = Seq(())  # the empty string


def _split(e: Expr, name: str, tail: bool) -> tuple[Expr, Expr] | None:
    """(a, b) with e = a name | b (tail) or e = name a | b (head), where neither mentions name;
    None when name occurs elsewhere."""
    if isinstance(e, Ref) and e.name == name:
        return _EPS, _NONE
    if not _mentions(e, name):
        return _NONE, e
    if isinstance(e, Alt):
        parts = [_split(x, name, tail) for x in e.items]
        if any(p is None for p in parts):
            return None
        return Alt(tuple(p[0] for p in parts)), Alt(tuple(p[1] for p in parts))  # type: ignore[index]
    if isinstance(e, Seq) and e.items:
        edge, rest = (e.items[-1], e.items[:-1]) if tail else (e.items[0], e.items[1:])
        if any(_mentions(x, name) for x in rest):
            return None
        part = _split(edge, name, tail)
        if part is None:
            return None
        joined = (lambda x: Seq(rest + (x,))) if tail else (lambda x: Seq((x,) + rest))
        return joined(part[0]), joined(part[1])
    return None  # inside a repeat


def _unroll_self(name: str, body: Expr) -> Expr:
    """A rule that calls itself only last (or only first) in its alternatives, as a loop."""
    if not _mentions(body, name):
        return body
    tail = _split(body, name, tail=True)
    if tail is not None:
        return Seq((Rep(tail[0], 0, None), tail[1]))  # A = a A | b  ->  a* b
    head = _split(body, name, tail=False)
    if head is not None:
        return Seq((head[1], Rep(head[0], 0, None)))  # A = A a | b  ->  b a*
    return body


# --- expansion ------------------------------------------------------------------------------------
def _cycles(rules: dict[str, Expr]) -> dict[str, int]:
    """Each rule's strongly connected component (Tarjan's, iterative): rules of one id call each other."""
    edges = {n: sorted(_refs(b)) for n, b in rules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    comp: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        work.append((v, iter(edges[v])))

    for root in rules:
        if root in index:
            continue
        work: list = []
        visit(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    u = work[-1][0]
                    low[u] = min(low[u], low[v])
                if low[v] == index[v]:
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp[x] = index[v]
                        if x == v:
                            break
            elif w not in index:
                visit(w)
            elif w in on:
                low[v] = min(low[v], index[w])
    return comp


def _refs(e: Expr) -> set[str]:
    if isinstance(e, Ref):
        return {e.name}
    if isinstance(e, (Seq, Alt)):
        return set().union(*(_refs(x) for x in e.items)) if e.items else set()
    if isinstance(e, Rep):
        return _refs(e.item)
    return set()


class _Expander:
    """Rules to nodes, each with its weight: code-point sets once the tree's shared parts are
    counted wherever they occur (what the NFA will hold), checked against MAX_WEIGHT before a
    node is built, so `r0 ::= r1 r1`, `r1 ::= r2 r2`, ... fails at once instead of doubling."""

    def __init__(self, rules: dict[str, Expr], limit: int) -> None:
        self.rules, self.limit = rules, limit
        self.comp = _cycles(rules)
        self.depth: dict[int, int] = {}  # component -> its rules now on the expansion stack
        self.memo: dict[tuple[str, int], tuple[Node, int]] = {}
        self.work = 0

    def rule(self, name: str) -> Node:
        return self.ref(name)[0]

    def ref(self, name: str) -> tuple[Node, int]:
        c = self.comp[name]
        d = self.depth.get(c, 0)
        key = (name, d)
        found = self.memo.get(key)
        if found is not None:
            return found
        if d >= self.limit:
            return NOTHING, 0
        self.work += 1
        if self.work > MAX_EXPANSIONS:
            raise GrammarTooLargeError(f"grammar: expanding its rules took more than {MAX_EXPANSIONS} steps "
                                       "(many mutually recursive rules); simplify it", PARAM)
        self.depth[c] = d + 1
        try:
            found = self.expr(self.rules[name])
        finally:
            self.depth[c] = d
        self.memo[key] = found
        return found

    def expr(self, e: Expr) -> tuple[Node, int]:
        if isinstance(e, Lit):
            return literal(e.text), len(e.text)
        if isinstance(e, Class):
            ranges = normalize(e.ranges)
            return chars(complement(ranges) if e.negated else ranges), 1
        if isinstance(e, Ref):
            return self.ref(e.name)
        if isinstance(e, Alt):
            parts = [self.expr(x) for x in e.items]
            return _checked(alt, [p[0] for p in parts], sum(p[1] for p in parts) + 1) if parts else (NOTHING, 0)
        if isinstance(e, Rep):
            node, weight = self.expr(e.item)
            copies = e.max if e.max is not None else max(e.min, 1)
            return _checked(lambda n: repeat(n, e.min, e.max), [node], weight * copies + 1)
        return self.seq(e.items)

    def seq(self, items: tuple[Expr, ...]) -> tuple[Node, int]:
        """Items in order; `x (sep x)*` as one Join node."""
        parts: list[tuple[Node, int]] = []
        i = 0
        while i < len(items):
            found = _join_at(items, i)
            if found is not None:
                take, x, sep = found
                (a, wa), (b, wb) = self.expr(_seq(x)), self.expr(_seq(sep))
                parts.append(_checked(join, [a, b], wa + wb + 1))
                i += take
            else:
                parts.append(self.expr(items[i]))
                i += 1
        weight = sum(p[1] for p in parts) + 1
        return _checked(lambda *n: reduce(lambda a, b: concat(a, b), n, EMPTY), [p[0] for p in parts], weight)


def _checked(build: Any, nodes: list[Node], weight: int) -> tuple[Node, int]:
    budget = current()  # the compile's own bound when there is one (the server's), else MAX_WEIGHT
    limit = budget.max_nodes if budget is not None else MAX_WEIGHT
    if weight > limit:
        raise GrammarTooLargeError(f"grammar: it expands to more than {limit} character sets (rules used "
                                   "twice at every level, or large repeats, multiply); simplify it", PARAM)
    return build(*nodes), weight


def _seq(items: tuple[Expr, ...]) -> Expr:
    return items[0] if len(items) == 1 else Seq(items)


def _join_at(items: tuple[Expr, ...], i: int) -> tuple[int, tuple[Expr, ...], tuple[Expr, ...]] | None:
    """If items[i:i+m] is x and items[i+m] is (sep x)*, the count of items taken, x and sep."""
    for m in range(min(len(items) - i - 1, MAX_JOIN_ITEMS), 0, -1):
        rep = items[i + m]
        if not (isinstance(rep, Rep) and rep.min == 0 and rep.max is None):
            continue
        body = rep.item.items if isinstance(rep.item, Seq) else (rep.item,)
        x = items[i:i + m]
        if len(body) >= m and body[len(body) - m:] == x:
            return m + 1, x, body[:len(body) - m]
    return None
