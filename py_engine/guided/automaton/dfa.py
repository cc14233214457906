"""Subset construction: an NFA over bytes to a DFA whose every state can still reach acceptance.

Bytes the NFA never tells apart share a class (`classes[b]`), so a state's row has one entry
per class, not 256. After construction the DFA is trimmed: a state that cannot reach an
accepting state is dead (-1), so "the walk over a token's bytes stays alive" means exactly
"the token can be continued into a full match" (what the token index relies on).
"""
from __future__ import annotations

from typing import Iterable

from py_engine.guided.automaton.nfa import NFA, build_nfa
from py_engine.guided.automaton.nodes import Node
from py_engine.guided.budget import Budget
from py_engine.guided.errors import GuidedError

DEAD = -1


class DFA:
    """start, accepting[q], and rows[q][classes[b]] -> next state or DEAD."""

    def __init__(self, classes: bytes, rows: list[list[int]], accepting: list[bool], start: int) -> None:
        self.classes, self.rows, self.accepting, self.start = classes, rows, accepting, start
        self._full: list[list[int] | None] = [None] * len(rows)

    @property
    def num_states(self) -> int:
        return len(self.rows)

    def row(self, q: int) -> list[int]:
        """Next states of q for each of the 256 bytes (built on first use)."""
        full = self._full[q]
        if full is None:
            full = self._full[q] = list(map(self.rows[q].__getitem__, self.classes))
        return full

    def step(self, q: int, data: bytes) -> int:
        rows, classes = self.rows, self.classes
        for b in data:
            q = rows[q][classes[b]]
            if q < 0:
                return DEAD
        return q

    def matches(self, data: bytes) -> bool:
        q = self.step(self.start, data)
        return q >= 0 and self.accepting[q]

    def is_terminal(self, q: int) -> bool:
        """Accepting with nothing more to read: the output is complete."""
        return self.accepting[q] and all(t < 0 for t in self.rows[q])

    def max_length(self) -> int | None:
        """Bytes in the longest accepted string, or None when there is no bound (a cycle)."""
        order, state = [], [0] * len(self.rows)  # 0 new, 1 on the stack, 2 done
        for root in (self.start,):
            stack = [(root, iter(set(self.rows[root])))]
            state[root] = 1
            while stack:
                q, it = stack[-1]
                t = next((t for t in it if t >= 0), None)
                if t is None:
                    stack.pop()
                    state[q] = 2
                    order.append(q)
                elif state[t] == 1:
                    return None
                elif state[t] == 0:
                    state[t] = 1
                    stack.append((t, iter(set(self.rows[t]))))
        longest = [0] * len(self.rows)
        for q in order:  # reverse topological: successors first
            longest[q] = max((longest[t] + 1 for t in self.rows[q] if t >= 0), default=0)
        return longest[self.start]


def _byte_classes(nfa: NFA) -> tuple[bytes, int]:
    """Class of each byte: bytes in the same class take the same edges everywhere."""
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.add(lo)
            cuts.add(hi + 1)
    bounds = sorted(cuts)
    classes = bytearray(256)
    for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        classes[lo:hi] = bytes([c]) * (hi - lo)
    return bytes(classes), len(bounds) - 1


def _reachable(states: Iterable[int], edges: list[list[int]]) -> set[int]:
    """Every node reachable from `states` along `edges` (the states themselves included)."""
    seen = set(states)
    todo = list(seen)
    while todo:
        for t in edges[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def _closure(states: Iterable[int], eps: list[list[int]]) -> frozenset[int]:
    return frozenset(_reachable(states, eps))


def _subsets(nfa: NFA, start: int, final: int, classes: bytes, num_classes: int,
             budget: Budget) -> tuple[list[list[int]], list[bool]]:
    moves: list[list[tuple[int, int]]] = []  # per NFA state: (class, target)
    for edges in nfa.edges:
        moves.append([(c, t) for lo, hi, t in edges for c in range(classes[lo], classes[hi] + 1)])
    closed: dict[frozenset[int], frozenset[int]] = {}
    first = _closure([start], nfa.eps)
    ids = {first: 0}
    sets, rows, accepting = [first], [], []
    while len(rows) < len(sets):
        current = sets[len(rows)]
        budget.tick(len(current), "DFA")
        buckets: dict[int, list[int]] = {}
        for s in current:
            for c, t in moves[s]:
                buckets.setdefault(c, []).append(t)
        row = [DEAD] * num_classes
        for c, targets in buckets.items():
            key = frozenset(targets)
            nxt = closed.get(key)
            if nxt is None:
                nxt = closed[key] = _closure(key, nfa.eps)
                budget.tick(len(nxt), "DFA")
            q = ids.get(nxt)
            if q is None:
                q = ids[nxt] = len(sets)
                sets.append(nxt)
                budget.check_states(len(sets), "DFA")
            row[c] = q
        rows.append(row)
        accepting.append(final in current)
    return rows, accepting


def _trim(rows: list[list[int]], accepting: list[bool]) -> tuple[list[list[int]], list[bool]]:
    """Drop states that cannot reach acceptance; renumber the rest (state 0 stays first)."""
    back: list[list[int]] = [[] for _ in rows]
    for q, row in enumerate(rows):
        for t in set(row):
            if t >= 0:
                back[t].append(q)
    live = _reachable((q for q, a in enumerate(accepting) if a), back)
    if 0 not in live:
        raise GuidedError("the grammar admits no output at all (its language is empty)")
    order = sorted(live)
    new = {q: i for i, q in enumerate(order)}
    out = [[new.get(t, DEAD) for t in rows[q]] for q in order]
    return out, [accepting[q] for q in order]


def _minimize(rows: list[list[int]], accepting: list[bool], num_classes: int,
              budget: Budget) -> tuple[list[list[int]], list[bool]]:
    """Hopcroft's partition refinement: merge states no input string tells apart.

    Equal states would get equal token masks computed twice; subset construction leaves many
    (one per way of reaching the same future). The dead state is block member n."""
    n = len(rows)
    dead = n
    inverse: list[dict[int, list[int]]] = [{} for _ in range(num_classes)]  # class -> target -> sources
    for q, row in enumerate(rows):
        for c, t in enumerate(row):
            inverse[c].setdefault(dead if t < 0 else t, []).append(q)
    for c in range(num_classes):
        inverse[c].setdefault(dead, []).append(dead)
    blocks = [b for b in ({q for q in range(n) if accepting[q]}, {q for q in range(n) if not accepting[q]} | {dead})
              if b]
    block_of = [0] * (n + 1)
    for i, b in enumerate(blocks):
        for q in b:
            block_of[q] = i
    work = {(min(range(len(blocks)), key=lambda i: len(blocks[i])), c) for c in range(num_classes)}
    while work:
        a, c = work.pop()
        sources = {p for t in blocks[a] for p in inverse[c].get(t, ())}
        budget.tick(len(blocks[a]) + len(sources), "DFA minimization")
        touched: dict[int, set[int]] = {}
        for p in sources:
            touched.setdefault(block_of[p], set()).add(p)
        for y, inside in touched.items():
            if len(inside) == len(blocks[y]):
                continue
            blocks[y] -= inside
            new = len(blocks)
            blocks.append(inside)
            for q in inside:
                block_of[q] = new
            smaller = new if len(inside) <= len(blocks[y]) else y
            for d in range(num_classes):
                work.add((new, d) if (y, d) in work else (smaller, d))
    # Renumber: the start's block first, the dead block dropped.
    order = sorted({block_of[q] for q in range(n)}, key=lambda b: min(blocks[b]))
    number = {b: i for i, b in enumerate(order)}
    dead_block = block_of[dead]
    out = []
    for b in order:
        q = min(blocks[b])
        out.append([DEAD if t < 0 or block_of[t] == dead_block else number[block_of[t]] for t in rows[q]])
    return out, [accepting[min(blocks[b])] for b in order]


def compile_dfa(node: Node, budget: Budget | None = None) -> DFA:
    """The minimal trimmed DFA over UTF-8 bytes accepting exactly the strings of `node`."""
    budget = budget or Budget()
    nfa, start, final = build_nfa(node, budget)
    classes, num_classes = _byte_classes(nfa)
    rows, accepting = _subsets(nfa, start, final, classes, num_classes, budget)
    rows, accepting = _trim(rows, accepting)
    rows, accepting = _minimize(rows, accepting, num_classes, budget)
    budget.check_time("DFA")
    return DFA(classes, rows, accepting, 0)
