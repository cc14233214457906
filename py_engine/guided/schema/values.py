"""JSON's lexical pieces as regex trees: strings, numbers (with integer bounds), literals, any value.

Strings: any character but `"`, `\\` and the controls U+0000..U+001F, or an escape
(`\\"` `\\\\` `\\/` `\\b` `\\f` `\\n` `\\r` `\\t`, or `\\uXXXX` of a non-surrogate, so each
escape decodes to exactly one character and minLength/maxLength count right).

Numbers: JSON's grammar, every part of a bounded length so that a generation always ends: an
integer part of at most 19 digits (64-bit integers fit), a fraction of at most 16 digits (a
double holds no more), an exponent of at most 3. With bounds the integer part is a digit-range
expression (the classic construction: split [a, b] into ranges of equal length, then digit
by digit) and no exponent is generated, so every output lies within the bounds. Bounds must be
integers (after exclusive bounds are applied): a fractional bound such as 0.5 is refused by
the caller.
"""
from __future__ import annotations

import functools

from py_engine.guided.automaton.nodes import (EMPTY, MAX_CODE_POINT, NOTHING, Node, alt, char, chars, concat,
                                              join, literal, optional, repeat)

HEX = chars([(0x30, 0x39), (0x41, 0x46), (0x61, 0x66)])
DIGIT = chars([(0x30, 0x39)])
NONZERO = chars([(0x31, 0x39)])
# Characters a JSON string may hold unescaped (what a `pattern` is restricted to inside quotes).
UNESCAPED = ((0x20, 0x21), (0x23, 0x5B), (0x5D, MAX_CODE_POINT))
_NON_SURROGATE_U = alt(concat(chars([(0x30, 0x39), (0x41, 0x43), (0x45, 0x46), (0x61, 0x63), (0x65, 0x66)]),
                              repeat(HEX, 3, 3)),
                       concat(chars([(0x44, 0x44), (0x64, 0x64)]), chars([(0x30, 0x37)]), repeat(HEX, 2, 2)))
ESCAPE = concat(char("\\"), alt(chars([(ord(c), ord(c)) for c in '"\\/bfnrt']), concat(char("u"), _NON_SURROGATE_U)))
STRING_CHAR = alt(chars(UNESCAPED), ESCAPE)
QUOTE = char('"')

MAX_INT_DIGITS, MAX_FRACTION_DIGITS, MAX_EXPONENT_DIGITS = 19, 16, 3
UINT = alt(char("0"), concat(NONZERO, repeat(DIGIT, 0, MAX_INT_DIGITS - 1)))
FRACTION = concat(char("."), repeat(DIGIT, 1, MAX_FRACTION_DIGITS))
EXPONENT = concat(chars([(0x45, 0x45), (0x65, 0x65)]), optional(chars([(0x2B, 0x2B), (0x2D, 0x2D)])),
                  repeat(DIGIT, 1, MAX_EXPONENT_DIGITS))
INTEGER = concat(optional(char("-")), UINT)
NUMBER = concat(INTEGER, optional(FRACTION), optional(EXPONENT))
# A fraction with a digit other than 0, by how many zeros lead it: each branch's prefix tells it
# apart at once (branching on where *a* nonzero digit is would make subset construction exponential).
_NONZERO_FRACTION = concat(char("."), alt(*(concat(repeat(char("0"), k, k), NONZERO,
                                                   repeat(DIGIT, 0, MAX_FRACTION_DIGITS - k - 1))
                                            for k in range(MAX_FRACTION_DIGITS))))
_ZERO_FRACTION = concat(char("."), repeat(char("0"), 1, MAX_FRACTION_DIGITS))
LITERALS = alt(literal("true"), literal("false"), literal("null"))


def string(min_length: int = 0, max_length: int | None = None) -> Node:
    return concat(QUOTE, repeat(STRING_CHAR, min_length, max_length), QUOTE)


def _same_length(a: str, b: str) -> Node:
    """Decimal strings of len(a) == len(b) digits between a and b (leading zeros allowed)."""
    if a == b:
        return literal(a)
    if len(a) == 1:
        return chars([(ord(a), ord(b))])
    rest = len(a) - 1
    if a[0] == b[0]:
        return concat(char(a[0]), _same_length(a[1:], b[1:]))
    if a[1:] == "0" * rest and b[1:] == "9" * rest:
        return concat(chars([(ord(a[0]), ord(b[0]))]), repeat(DIGIT, rest, rest))
    low = concat(char(a[0]), _same_length(a[1:], "9" * rest))
    middle = (concat(chars([(ord(a[0]) + 1, ord(b[0]) - 1)]), repeat(DIGIT, rest, rest))
              if ord(b[0]) - ord(a[0]) > 1 else NOTHING)
    high = concat(char(b[0]), _same_length("0" * rest, b[1:]))
    return alt(low, middle, high)


def uint_range(lo: int, hi: int | None) -> Node:
    """Decimal integers in [lo, hi] (hi None: no upper bound), no leading zeros; lo >= 0."""
    if hi is not None and hi < lo:
        return NOTHING
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    parts = []
    for width in range(len(str(lo)), len(str(top)) + 1):
        a, b = max(lo, 10 ** (width - 1) if width > 1 else 0), min(top, 10 ** width - 1)
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if hi is None and len(str(lo)) < MAX_INT_DIGITS:  # every longer number, up to the digit bound
        parts.append(concat(NONZERO, repeat(DIGIT, len(str(lo)), MAX_INT_DIGITS - 1)))
    return alt(*parts)


def _magnitude(lo: int, lo_open: bool, hi: int | None, hi_open: bool, fractions: bool) -> Node:
    """Unsigned numbers m with lo <(=) m <(=) hi; lo >= 0, integer bounds."""
    if not fractions:
        first, last = lo + lo_open, (None if hi is None else hi - hi_open)
        return uint_range(first, last)
    frac = optional(FRACTION)
    parts = []
    if lo_open:  # m > lo: lo itself with a nonzero fraction, then from lo + 1
        if hi is None or hi > lo:
            parts.append(concat(literal(str(lo)), _NONZERO_FRACTION))
        lo += 1
    if hi is None:
        parts.append(concat(uint_range(lo, None), frac))
    else:
        if lo <= hi - 1:
            parts.append(concat(uint_range(lo, hi - 1), frac))  # below hi whatever the fraction
        if not hi_open and hi >= lo:
            parts.append(concat(literal(str(hi)), optional(_ZERO_FRACTION)))
    return alt(*parts)


def number_range(lo: int | None, lo_open: bool, hi: int | None, hi_open: bool, integer: bool) -> Node:
    """JSON numbers x with lo <(=) x <(=) hi (None: unbounded on that side); integer bounds."""
    if lo is None and hi is None:
        return INTEGER if integer else NUMBER
    parts = []
    if hi is None or hi > 0 or (hi == 0 and not hi_open):  # x >= 0
        start, start_open = (0, False) if lo is None or lo < 0 else (lo, lo_open)
        parts.append(_magnitude(start, start_open, hi, hi_open, not integer))
    if lo is None or lo < 0:  # x < 0, written -m with m > 0
        m_lo, m_lo_open = (0, True) if hi is None or hi >= 0 else (-hi, hi_open)
        m_hi = None if lo is None else -lo
        parts.append(concat(char("-"), _magnitude(m_lo, m_lo_open, m_hi, lo_open, not integer)))
    return alt(*parts)


@functools.lru_cache(maxsize=64)
def any_value(depth: int, ws: Node) -> Node:
    """Any JSON value with objects and arrays nested at most `depth` deep (built once per depth and
    whitespace, and shared: every `{}` or `true` in a schema is this one tree)."""
    scalar = alt(string(), NUMBER, LITERALS)
    if depth <= 0:
        return scalar
    inner = any_value(depth - 1, ws)
    return alt(scalar, any_object(inner, ws), array_of(inner, ws, 0, None))


def any_object(value: Node, ws: Node) -> Node:
    member = concat(string(), char(":"), ws, value)
    return concat(char("{"), ws, optional(concat(join(member, concat(char(","), ws)), ws)), char("}"))


def array_of(item: Node, ws: Node, min_items: int, max_items: int | None) -> Node:
    """[item, item, ...] with min..max items."""
    sep = concat(char(","), ws)
    if max_items == 0 or item == NOTHING:
        body = EMPTY if min_items == 0 else NOTHING
    elif max_items is None and min_items <= 1:
        body = join(item, sep)
        body = optional(body) if min_items == 0 else body
    else:
        rest = repeat(concat(sep, item), max(min_items - 1, 0), None if max_items is None else max_items - 1)
        body = concat(item, rest)
        body = optional(body) if min_items == 0 else body
    return concat(char("["), ws, concat(body, ws) if body != EMPTY else EMPTY, char("]"))
