"""Regular expressions as a tree of code-point sets: what the regex parser and the JSON-schema
compiler build, and what the NFA compiles to UTF-8 bytes.

Five node kinds: `Chars` (one code point from a set of ranges), `Concat`, `Alt`, `Repeat` and
`Join` (`x (sep x)*`, which the NFA builds with one copy of x: a JSON object's members or an
array's items, whose x may be a whole nested value).
The empty string is `Concat(())` (EMPTY) and the empty language is `Alt(())` (NOTHING). The
constructors below simplify as they build: NOTHING inside a concatenation makes it NOTHING, an
alternation drops NOTHING branches, `repeat(NOTHING, 0, n)` is EMPTY. The JSON-schema compiler
relies on this to drop what cannot be generated (a recursion cut at its depth bound) rather
than fail. Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Union

from py_engine.guided.budget import current as current_budget
from py_engine.tokenizer.unicode import MAX_CODE_POINT, Ranges, complement, union  # the tokenizer's range algebra

__all__ = ["EMPTY", "MAX_CODE_POINT", "NOTHING", "Alt", "Chars", "Concat", "Join", "Node", "Ranges", "Repeat", "alt",
           "char", "chars", "complement", "concat", "intersect", "join", "literal", "normalize", "optional", "repeat",
           "restrict", "size"]


class _Node:
    """What every node shares: a hash and a weight computed once, when it is built.

    A tree may share subtrees (a `$ref` expanded once and used twice), so anything that walks it
    whole would cost its expanded size: the hash is kept (children's hashes, not a walk), equality
    looks at hash and weight before it walks, and `weight` (nodes counted once per occurrence)
    lets the active Budget refuse a tree before an automaton is built from it."""

    __slots__ = ()

    def __hash__(self) -> int:
        return self.hash_

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not type(self) or other.hash_ != self.hash_ or other.weight != self.weight:
            return False
        return _same(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def _seal(self, weight: int, fields: tuple, work: int = 1) -> None:
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "hash_", hash((type(self).__name__, fields)))
        budget = current_budget()
        if budget is not None:
            budget.charge(work)
            budget.check_weight(weight)


def _same(a: _Node, b: _Node) -> bool:
    """Structural equality walking each pair of shared subtrees once (a plain recursive walk would
    take their expanded size: exponential for a $ref used twice at every level)."""
    seen: set[tuple[int, int]] = set()
    todo = [(a, b)]
    while todo:
        x, y = todo.pop()
        if x is y or (id(x), id(y)) in seen:
            continue
        if type(x) is not type(y) or x.hash_ != y.hash_ or x.weight != y.weight:
            return False
        seen.add((id(x), id(y)))
        for f, g in zip(x.fields(), y.fields()):
            if isinstance(f, _Node):
                todo.append((f, g))
            elif isinstance(f, tuple) and f and isinstance(f[0], _Node):
                if len(f) != len(g):
                    return False
                todo.extend(zip(f, g))
            elif f != g:
                return False
    return True


@dataclass(frozen=True, eq=False, slots=True)
class Chars(_Node):
    ranges: Ranges
    weight: int = field(init=False, repr=False)
    hash_: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seal(1, self.fields())

    def fields(self) -> tuple:
        return (self.ranges,)


@dataclass(frozen=True, eq=False, slots=True)
class _Items(_Node):
    """A node over a tuple of children; Concat and Alt differ only in what the automaton makes of them
    (the type's name is in the hash, so a Concat never equals an Alt of the same items)."""
    items: tuple["Node", ...]
    weight: int = field(init=False, repr=False)
    hash_: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seal(1 + sum(x.weight for x in self.items), self.fields(), 1 + len(self.items))

    def fields(self) -> tuple:
        return (self.items,)


@dataclass(frozen=True, eq=False, slots=True)
class Concat(_Items):
    pass


@dataclass(frozen=True, eq=False, slots=True)
class Alt(_Items):
    pass


@dataclass(frozen=True, eq=False, slots=True)
class Repeat(_Node):
    item: "Node"
    min: int
    max: int | None  # None: unbounded
    weight: int = field(init=False, repr=False)
    hash_: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seal(1 + self.item.weight, self.fields())

    def fields(self) -> tuple:
        return (self.item, self.min, self.max)


@dataclass(frozen=True, eq=False, slots=True)
class Join(_Node):
    item: "Node"
    sep: "Node"
    weight: int = field(init=False, repr=False)
    hash_: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seal(1 + self.item.weight + self.sep.weight, self.fields())

    def fields(self) -> tuple:
        return (self.item, self.sep)


Node = Union[Chars, Concat, Alt, Repeat, Join]
EMPTY = Concat(())
NOTHING = Alt(())


def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, merged ranges (adjacent ones joined), clipped to Unicode."""
    return union(tuple((max(lo, 0), min(hi, MAX_CODE_POINT)) for lo, hi in ranges if lo <= hi))


def intersect(a: Ranges, b: Ranges) -> Ranges:
    return complement(normalize(complement(a) + complement(b)))


def chars(ranges: Iterable[tuple[int, int]]) -> Node:
    r = normalize(ranges)
    return Chars(r) if r else NOTHING


def char(c: str) -> Node:
    return Chars(((ord(c), ord(c)),))


def literal(text: str) -> Node:
    return concat(*(char(c) for c in text))


FLATTEN_MAX = 32  # a concatenation's items are copied into an enclosing one only when this few


def concat(*items: Node) -> Node:
    """Items in order; short nested concatenations flattened. A long one is kept whole, as it may
    be shared (a $ref's tree used twice at every level): copying its items would undo the sharing."""
    flat: list[Node] = []
    for item in items:
        if item == NOTHING:
            return NOTHING
        flat.extend(item.items if isinstance(item, Concat) and len(item.items) <= FLATTEN_MAX else (item,))
    return flat[0] if len(flat) == 1 else Concat(tuple(flat))


def alt(*items: Node) -> Node:
    """Branches in order, short nested alternations flattened (as in concat), duplicates dropped
    (by hash: an enum of thousands of strings stays linear; comparing each with every kept one
    was quadratic)."""
    kept: dict[Node, None] = {}
    budget = current_budget()
    for item in items:
        inner = item.items if isinstance(item, Alt) and len(item.items) <= FLATTEN_MAX else (item,)
        if budget is not None:
            budget.charge(len(inner), "an alternation")
        for x in inner:
            kept.setdefault(x)
    flat = tuple(kept)
    return flat[0] if len(flat) == 1 else Alt(flat)


def repeat(item: Node, lo: int, hi: int | None) -> Node:
    if hi is not None and hi < lo:
        return NOTHING
    if item == NOTHING:
        return EMPTY if lo == 0 else NOTHING
    if item == EMPTY or hi == 0:
        return EMPTY
    if lo == hi == 1:
        return item
    return Repeat(item, lo, hi)


def join(item: Node, sep: Node) -> Node:
    """item (sep item)*: one or more items, separated."""
    return NOTHING if item == NOTHING else Join(item, sep)


def optional(item: Node) -> Node:
    return repeat(item, 0, 1)


def restrict(node: Node, allowed: Ranges, _done: dict | None = None) -> Node:
    """The same tree with every code-point set intersected with `allowed` (a sublanguage).
    Shared subtrees are restricted once (`_done`, by identity)."""
    done = {} if _done is None else _done
    found = done.get(id(node))
    if found is not None:
        return found[1]
    if isinstance(node, Chars):
        out = chars(intersect(node.ranges, allowed))
    elif isinstance(node, Concat):
        out = concat(*(restrict(x, allowed, done) for x in node.items))
    elif isinstance(node, Alt):
        out = alt(*(restrict(x, allowed, done) for x in node.items))
    elif isinstance(node, Join):
        out = join(restrict(node.item, allowed, done), restrict(node.sep, allowed, done))
    else:
        out = repeat(restrict(node.item, allowed, done), node.min, node.max)
    done[id(node)] = (node, out)  # the node too: its id stays its own while the dict lives
    return out


def size(node: Node, _done: dict | None = None) -> int:
    """Code-point sets in the tree once repeats are unrolled: what the NFA will hold, roughly.
    (Shared subtrees are measured once and counted where they occur.)"""
    done = {} if _done is None else _done
    found = done.get(id(node))
    if found is not None:
        return found
    if isinstance(node, Chars):
        out = 1
    elif isinstance(node, (Concat, Alt)):
        out = sum(size(x, done) for x in node.items) + 1
    elif isinstance(node, Join):
        out = size(node.item, done) + size(node.sep, done) + 1
    else:
        copies = node.max if node.max is not None else node.min + 1
        out = size(node.item, done) * max(copies, 1) + 1
    done[id(node)] = out
    return out
