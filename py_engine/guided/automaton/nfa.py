"""Thompson's construction: a `nodes` tree to an NFA over bytes with epsilon moves.

Each code-point set becomes its UTF-8 byte-range sequences (utf8.py), each a chain of states;
`Repeat(x, n, m)` is n copies of x then m - n nested optional copies (or a loop when
unbounded), so the NFA grows with the counts: the `Budget` (budget.py) caps its states and its
time, and a schema that asks for too much fails with GrammarTooLargeError rather than exhaust the
server.
"""
from __future__ import annotations

from functools import lru_cache

from py_engine.guided.automaton.nodes import Alt, Chars, Concat, Join, Node, Ranges, Repeat
from py_engine.guided.automaton.utf8 import ByteRanges, utf8_sequences
from py_engine.guided.budget import Budget


class NFA:
    """States 0..n-1; edges[s] holds (lo, hi, target) byte ranges, eps[s] the epsilon targets."""

    def __init__(self, budget: Budget) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.budget = budget

    def state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        n = len(self.edges)
        self.budget.check_states(n, "NFA")
        return n - 1

    def build(self, node: Node, start: int) -> int:
        """Add `node` from `start`; return its end state."""
        if isinstance(node, Chars):
            return self._chars(node.ranges, start)
        if isinstance(node, Concat):
            for item in node.items:
                start = self.build(item, start)
            return start
        if isinstance(node, Alt):
            end = self.state()
            for item in node.items:
                branch = self.state()
                self.eps[start].append(branch)
                self.eps[self.build(item, branch)].append(end)
            return end
        if isinstance(node, Join):  # a hub, the item once, and the separator back to the hub
            hub = self.state()
            self.eps[start].append(hub)
            end = self.build(node.item, hub)
            self.eps[self.build(node.sep, end)].append(hub)
            return end
        return self._repeat(node, start)

    def _chars(self, ranges: Ranges, start: int) -> int:
        end = self.state()
        for seq in _sequences(ranges):
            at = start
            for i, (lo, hi) in enumerate(seq):
                nxt = end if i == len(seq) - 1 else self.state()
                self.edges[at].append((lo, hi, nxt))
                at = nxt
        return end

    def _repeat(self, node: Repeat, start: int) -> int:
        for _ in range(node.min):
            start = self.build(node.item, start)
        if node.max is None:  # x*: a loop through a hub state
            hub = self.state()
            self.eps[start].append(hub)
            self.eps[self.build(node.item, hub)].append(hub)
            return hub
        end = self.state()
        for _ in range(node.max - node.min):  # x? nested: (x(x(x)?)?)?, each exit straight to the end
            self.eps[start].append(end)
            start = self.build(node.item, start)
        self.eps[start].append(end)
        return end


@lru_cache(maxsize=4096)
def _sequences(ranges: Ranges) -> tuple[ByteRanges, ...]:
    return tuple(seq for lo, hi in ranges for seq in utf8_sequences(lo, hi))


def build_nfa(node: Node, budget: Budget) -> tuple[NFA, int, int]:
    """The NFA of `node`, its start state and its (single) accepting state."""
    budget.check_weight(node.weight)  # a tree built outside the budget's block: refused before it is walked
    nfa = NFA(budget)
    start = nfa.state()
    return nfa, start, nfa.build(node, start)
