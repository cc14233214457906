"""llama.cpp's GBNF grammar text parsed into rules of a small expression tree.

    rules = parse_gbnf('root ::= "yes" | "no"')     # {"root": Alt((Seq((Lit("yes"),)), Seq((Lit("no"),))))}

The syntax is llama.cpp's (grammars/README.md there): `name ::= alternatives` rules, names of
letters, digits and `-`; "literals" and [character classes] (`^` negates, `a-z` ranges) with the
escapes \\x.. \\u.... \\U........ \\t \\r \\n \\\\ \\" \\[ \\] \\-; `.` any character; ( groups );
`*` `+` `?` `{m}` `{m,}` `{m,n}` after an item; `#` comments. A rule's alternatives continue on
the next line only after `|`, `::=` or inside parentheses. A rule defined twice keeps its last
definition, as in llama.cpp. Token references (`<[id]>`, `<|name|>`, `!`) need a vocabulary
and are refused, as is anything else the syntax does not know: one GuidedError naming where.
Bounded: MAX_GRAMMAR_CHARS of text, MAX_RULES rules, MAX_NESTING parentheses deep, repeat
counts up to MAX_REPEAT. Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from py_engine.guided.errors import GuidedError

MAX_GRAMMAR_CHARS = 100_000
MAX_RULES = 2_000
MAX_NESTING = 64
MAX_REPEAT = 2_000  # llama.cpp's own bound on a repeat count
MAX_CODE_POINT = 0x10FFFF
PARAM = "grammar"


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Class:
    ranges: tuple[tuple[int, int], ...]
    negated: bool = False


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Seq:
    items: tuple["Expr", ...]


@dataclass(frozen=True)
class Alt:
    items: tuple["Expr", ...]


@dataclass(frozen=True)
class Rep:
    item: "Expr"
    min: int
    max: int | None  # None: unbounded


Expr = Union[Lit, Class, Ref, Seq, Alt, Rep]
ANY = Class(((0, MAX_CODE_POINT),))
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX = {"x": 2, "u": 4, "U": 8}


def _is_word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0
        self.rules: dict[str, Expr] = {}
        self.refs: dict[str, int] = {}  # referenced name -> where (for the error message)
        self.nesting = 0

    def fail(self, what: str, at: int | None = None) -> GuidedError:
        at = self.i if at is None else at
        line = self.s.count("\n", 0, at) + 1
        column = at - (self.s.rfind("\n", 0, at) + 1) + 1
        near = self.s[at:at + 20].split("\n")[0]
        return GuidedError(f"grammar: {what} at line {line}, column {column}" + (f" (near {near!r})" if near else ""),
                           PARAM)

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def space(self, newline_ok: bool) -> None:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c == "#":
                while self.i < len(s) and s[self.i] not in "\r\n":
                    self.i += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                self.i += 1
            else:
                break

    def parse(self) -> dict[str, Expr]:
        self.space(True)
        while self.i < len(self.s):
            self.rule()
        if not self.rules:
            raise self.fail("no rules", 0)
        return self.rules

    def rule(self) -> None:
        start = self.i
        name = self.name()
        self.space(False)
        if self.s[self.i:self.i + 3] != "::=":
            raise self.fail("expecting ::=")
        self.i += 3
        self.space(True)
        body = self.alternates(nested=False)
        if self.peek() == "\r":
            self.i += 2 if self.peek(1) == "\n" else 1
        elif self.peek() == "\n":
            self.i += 1
        elif self.peek():
            raise self.fail("expecting a newline or the end")
        self.space(True)
        if name not in self.rules and len(self.rules) >= MAX_RULES:
            raise self.fail(f"more than {MAX_RULES} rules", start)
        self.rules[name] = body

    def name(self) -> str:
        start = self.i
        while self.i < len(self.s) and _is_word(self.s[self.i]):
            self.i += 1
        if self.i == start:
            raise self.fail("expecting a rule name")
        return self.s[start:self.i]

    def alternates(self, nested: bool) -> Expr:
        items = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            items.append(self.sequence(nested))
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def sequence(self, nested: bool) -> Expr:
        items: list[Expr] = []
        while self.i < len(self.s):
            c, at = self.peek(), self.i
            if c == '"':
                items.append(self.literal())
            elif c == "[":
                items.append(self.char_class())
            elif c in "<!":
                raise self.fail("token references (<[id]>, <|token|>, !) are not supported; write the text")
            elif _is_word(c):
                name = self.name()
                self.refs.setdefault(name, at)
                items.append(Ref(name))
            elif c == "(":
                items.append(self.group())
            elif c == ".":
                self.i += 1
                items.append(ANY)
            elif c in "*+?{":
                if not items:
                    raise self.fail(f"{c!r} follows nothing")
                items[-1] = self.repeat(items[-1])
            else:
                break
            self.space(nested)
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def group(self) -> Expr:
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise self.fail(f"parentheses nested more than {MAX_NESTING} deep")
        self.i += 1
        self.space(True)
        inner = self.alternates(nested=True)
        if self.peek() != ")":
            raise self.fail("expecting ')'")
        self.i += 1
        self.nesting -= 1
        return inner

    def char(self) -> int:
        s = self.s
        if self.i >= len(s):
            raise self.fail("unexpected end of the grammar")
        c = s[self.i]
        if c != "\\":
            self.i += 1
            return ord(c)
        e = self.peek(1)
        if e in _HEX:
            digits = s[self.i + 2:self.i + 2 + _HEX[e]]
            if len(digits) != _HEX[e] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"expecting {_HEX[e]} hex digits after \\{e}")
            self.i += 2 + _HEX[e]
            value = int(digits, 16)
            if value > MAX_CODE_POINT:
                raise self.fail(f"\\{e}{digits} is beyond Unicode")
            return value
        if e in _ESCAPES:
            self.i += 2
            return ord(_ESCAPES[e])
        raise self.fail(f"unknown escape \\{e}")

    def literal(self) -> Expr:
        self.i += 1
        out = []
        while self.peek() != '"':
            out.append(chr(self.char()))
        self.i += 1
        return Lit("".join(out))

    def char_class(self) -> Expr:
        self.i += 1
        negated = self.peek() == "^"
        self.i += negated
        ranges = []
        while self.peek() != "]":
            lo = self.char()
            hi = lo
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi = self.char()
            ranges.append((lo, hi))
        self.i += 1
        return Class(tuple(ranges), negated)

    def repeat(self, item: Expr) -> Expr:
        c = self.peek()
        self.i += 1
        if c != "{":
            return Rep(item, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
        self.space(self.nesting > 0)
        lo = self.integer()
        self.space(self.nesting > 0)
        hi: int | None = lo
        if self.peek() == ",":
            self.i += 1
            self.space(self.nesting > 0)
            hi = self.integer() if self.peek().isdigit() else None
            self.space(self.nesting > 0)
        if self.peek() != "}":
            raise self.fail("expecting '}'")
        self.i += 1
        if hi is not None and hi < lo:
            raise self.fail(f"{{{lo},{hi}}}: the maximum is below the minimum")
        return Rep(item, lo, hi)

    def integer(self) -> int:
        start = self.i
        while self.peek().isdigit() and self.peek().isascii():
            self.i += 1
        if start == self.i:
            raise self.fail("expecting a number")
        if self.i - start > 6 or int(self.s[start:self.i]) > MAX_REPEAT:
            raise self.fail(f"a repeat count above {MAX_REPEAT}", start)
        return int(self.s[start:self.i])


def parse_gbnf(text: str) -> dict[str, Expr]:
    """The grammar's rules by name; GuidedError (param "grammar") naming the place of any error, a
    reference to an undefined rule, or a missing `root`."""
    if not isinstance(text, str):
        raise GuidedError("grammar must be a string of GBNF rules", PARAM)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GuidedError(f"grammar: over {MAX_GRAMMAR_CHARS} characters", PARAM)
    parser = _Parser(text)
    rules = parser.parse()
    for name, at in parser.refs.items():
        if name not in rules:
            raise parser.fail(f"rule {name!r} is used but not defined", at)
    if "root" not in rules:
        raise GuidedError("grammar: no 'root' rule (generation starts from root)", PARAM)
    return rules
