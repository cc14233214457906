"""JSON Schema to a regex tree whose every string is a JSON document valid against the schema.

Supported: `type` (one or a list), `enum`, `const`, `properties` / `required` /
`additionalProperties`, `items` / `prefixItems` / `minItems` / `maxItems`, `minLength` /
`maxLength`, `pattern`, the formats of formats.py, `minimum` / `maximum` /
`exclusiveMinimum` / `exclusiveMaximum` with integer bounds, `anyOf`, `oneOf`, `allOf` (its
parts merged when they do not overlap), local `$ref`s (`#`, `#/$defs/...`,
`#/definitions/...`) and the boolean schemas. Annotations (title, description, default,
examples, ...) are ignored, as validators ignore them. Any other keyword is refused with a
GuidedError that names it and where it is, never silently dropped.

What is generated, where the schema leaves a choice (as outlines and xgrammar do):
properties in the order `properties` lists them, required ones always, optional ones maybe;
no properties beyond those listed (even when additionalProperties allows them, unless the
object lists none: then additionalProperties' schema gives a map); `oneOf` as `anyOf` (exact
when the branches are disjoint, as discriminated unions are); a `pattern` must match the whole
string (JSON Schema searches, and a full match is one); whitespace only where `ws` allows
(after `{ [ , :` and before `} ]`). A `$ref` may re-enter itself `max_recursion` times;
deeper, that branch is left out (an optional property, an anyOf branch, a longer array), and
a schema that then admits nothing is refused.

Bounds: each `$ref` is expanded once per context and its tree shared (refs.py); every subschema
visited and every node built is charged to the active Budget, and a tree whose shared parts
would expand past its node bound is refused before an automaton is built (budget.py).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from py_engine.guided.automaton.nodes import (EMPTY, NOTHING, Node, alt, char, concat, literal, optional, repeat,
                                              restrict)
from py_engine.guided.automaton.regex import parse_regex
from py_engine.guided.budget import current as current_budget
from py_engine.guided.errors import GrammarTooLargeError, GuidedError
from py_engine.guided.schema import values
from py_engine.guided.schema.formats import FORMATS, format_node
from py_engine.guided.schema.refs import Key, RefGraph

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions", "discriminator", "$anchor",
                         "contentMediaType", "contentEncoding"})
KEYWORDS = {
    "any": frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
}
KNOWN = ANNOTATIONS.union(*KEYWORDS.values())
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


@dataclass(frozen=True)
class JsonOptions:
    ws: Node  # whitespace allowed between tokens
    max_depth: int = 32  # nesting of subschemas followed
    any_depth: int = 3  # nesting of objects/arrays inside a value the schema leaves free
    max_recursion: int = 2  # times a $ref may re-enter itself


def compile_schema(schema: Any, options: JsonOptions) -> Node:
    """The regex tree of JSON documents valid against `schema` (a dict or a bool)."""
    node = _Compiler(schema, options).value(schema, "#", 0)
    if node == NOTHING:
        raise GuidedError("the JSON schema admits no value that can be generated (check its constraints, "
                          "or a recursive $ref that never ends)")
    return node


class _Compiler:
    def __init__(self, root: Any, options: JsonOptions) -> None:
        self.root, self.options, self.ws = root, options, options.ws
        self.budget = current_budget()
        self.refs = RefGraph(root, self.budget)
        self.active: dict[Key, int] = {}  # $ref -> how many times it is open on the current path
        self.expanded: dict[tuple, Node] = {}  # (ref, depth, context) -> its tree, shared

    def value(self, schema: Any, path: str, depth: int) -> Node:
        if self.budget is not None:
            self.budget.charge(1, "the schema")
        if depth > self.options.max_depth:
            raise GrammarTooLargeError(f"the JSON schema nests deeper than {self.options.max_depth} at {path}")
        if schema is True or schema == {}:
            return values.any_value(self.options.any_depth, self.ws)
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise GuidedError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__} at {path}")
        unknown = sorted(k for k in schema if k not in KNOWN)
        if unknown:
            raise GuidedError(f"unsupported JSON schema keyword{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(map(repr, unknown))} at {path}")
        if "$ref" in schema:
            return self.ref(schema, path, depth)
        if "allOf" in schema:
            return self.value(self.merge_all_of(schema, path), path, depth + 1)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.any_of(schema, key, path, depth)
        if "enum" in schema or "const" in schema:
            return self.enum(schema, path)
        return alt(*(self.typed(t, schema, path, depth) for t in self.types(schema, path)))

    def types(self, schema: dict, path: str) -> list[str]:
        kind = schema.get("type")
        if kind is None:  # inferred from the keywords present, else any value
            found = [t for t in ("object", "array", "string", "number") if KEYWORDS[t] & schema.keys()]
            return found or ["any"]
        kinds = kind if isinstance(kind, list) else [kind]
        bad = [k for k in kinds if k not in TYPES]
        if bad or not kinds:
            raise GuidedError(f"'type' must be one of {', '.join(TYPES)} (or a list of them), got {kind!r} at {path}")
        return list(dict.fromkeys(kinds))

    def typed(self, kind: str, schema: dict, path: str, depth: int) -> Node:
        if kind == "object":
            return self.object(schema, path, depth)
        if kind == "array":
            return self.array(schema, path, depth)
        if kind == "string":
            return self.string(schema, path)
        if kind in ("number", "integer"):
            return self.number(schema, path, kind == "integer")
        if kind == "boolean":
            return alt(literal("true"), literal("false"))
        if kind == "null":
            return literal("null")
        return values.any_value(self.options.any_depth, self.ws)

    # --- combinators ----------------------------------------------------------------------------
    def ref(self, schema: dict, path: str, depth: int) -> Node:
        ref = schema["$ref"]
        others = sorted(k for k in schema if k != "$ref" and k not in ANNOTATIONS)
        if others:
            raise GuidedError(f"keywords beside '$ref' are not supported ({', '.join(others)}) at {path}")
        key, target = self.refs.resolve(ref, path)
        if self.active.get(key, 0) > self.options.max_recursion:
            return NOTHING  # the recursion bound: this branch cannot be taken
        # What the expansion depends on besides the ref: its depth, and the open refs it could re-enter.
        component = self.refs.component(key)
        context = tuple(sorted((k, n) for k, n in self.active.items() if n and self.refs.component(k) == component))
        memo = (key, depth, context)
        found = self.expanded.get(memo)
        if found is not None:
            return found
        self.active[key] = self.active.get(key, 0) + 1
        try:
            node = self.value(target, ref, depth + 1)
        finally:
            self.active[key] -= 1
        self.expanded[memo] = node
        return node

    def resolve(self, ref: Any, path: str) -> Any:
        return self.refs.resolve(ref, path)[1]

    def merge_all_of(self, schema: dict, path: str) -> dict:
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise GuidedError(f"'allOf' must be a non-empty list at {path}")
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for i, part in enumerate(parts):
            for _ in range(self.options.max_depth):  # a $ref to a $ref ...: followed a bounded number of times
                if not (isinstance(part, dict) and "$ref" in part and len(part) == 1):
                    break
                part = self.resolve(part["$ref"], path)
            else:
                raise GuidedError(f"'allOf' at {path}/allOf/{i}: $refs to $refs more than {self.options.max_depth} "
                                  "times (a loop?)")
            if not isinstance(part, dict):
                raise GuidedError(f"'allOf' items must be schema objects at {path}/allOf/{i}")
            clash = sorted(k for k in part if k in merged and k not in ANNOTATIONS and merged[k] != part[k])
            if clash:
                raise GuidedError(f"'allOf' parts that constrain the same keyword ({', '.join(clash)}) are not "
                                  f"supported at {path}")
            merged.update(part)
        return merged

    def any_of(self, schema: dict, key: str, path: str, depth: int) -> Node:
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise GuidedError(f"'{key}' must be a non-empty list of schemas at {path}")
        siblings = {k: v for k, v in schema.items() if k != key and k not in ANNOTATIONS}
        out = []
        for i, branch in enumerate(branches):
            if siblings:  # the branch must also satisfy its siblings: merge them in when they do not overlap
                if not isinstance(branch, dict) or siblings.keys() & branch.keys():
                    raise GuidedError(f"'{key}' beside keywords its branches also use is not supported at {path}")
                branch = {**siblings, **branch}
            out.append(self.value(branch, f"{path}/{key}/{i}", depth + 1))
        return alt(*out)

    def enum(self, schema: dict, path: str) -> Node:
        others = sorted(k for k in schema if k not in ANNOTATIONS and k not in ("enum", "const", "type"))
        if others:
            raise GuidedError(f"'enum'/'const' together with {', '.join(others)} is not supported at {path}")
        options = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(options, list) or not options:
            raise GuidedError(f"'enum' must be a non-empty list at {path}")
        kinds = self.types(schema, path) if "type" in schema else None
        keep = [v for v in options if kinds is None or _json_type(v) in kinds
                or (_json_type(v) == "integer" and "number" in kinds)]
        return alt(*(literal(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v in keep))

    # --- types ----------------------------------------------------------------------------------
    def object(self, schema: dict, path: str, depth: int) -> Node:
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        extra = schema.get("additionalProperties", True)
        if not isinstance(props, dict) or not isinstance(required, list):
            raise GuidedError(f"'properties' must be an object and 'required' a list at {path}")
        missing = [r for r in required if r not in props]
        if missing:
            raise GuidedError(f"required properties without a schema in 'properties' ({', '.join(map(str, missing))})"
                              f" are not supported at {path}")
        ws, sep = self.ws, concat(char(","), self.ws)
        if not props and isinstance(extra, dict) and extra != {}:  # a map: any keys, values of one schema
            return values.any_object(self.value(extra, f"{path}/additionalProperties", depth + 1), ws)
        if not props and extra is not False:
            return values.any_object(values.any_value(self.options.any_depth - 1, ws), ws)
        members = []
        for name, sub in props.items():
            node = self.value(sub, f"{path}/properties/{name}", depth + 1)
            if node == NOTHING and name in required:
                return NOTHING
            key = literal(json.dumps(name, ensure_ascii=False))
            members.append((concat(key, char(":"), ws, node), name in required))
        return concat(char("{"), ws, _members(members, sep, ws), char("}"))

    def array(self, schema: dict, path: str, depth: int) -> Node:
        lo, hi = _count(schema, "minItems", path), _count(schema, "maxItems", path, None)
        if schema.get("uniqueItems") and (hi is None or hi > 1):
            raise GuidedError(f"'uniqueItems' is not supported (a regular grammar cannot keep items distinct) at {path}")
        items = schema.get("items", True)
        prefix = schema.get("prefixItems")
        if isinstance(items, list):  # draft 4-2019's tuple form
            prefix, items = items, schema.get("additionalItems", True)
        item = self.value(items, f"{path}/items", depth + 1)
        if prefix is None:
            return values.array_of(item, self.ws, lo, hi)
        if not isinstance(prefix, list):
            raise GuidedError(f"'prefixItems' must be a list at {path}")
        heads = [self.value(s, f"{path}/prefixItems/{i}", depth + 1) for i, s in enumerate(prefix)]
        return concat(char("["), self.ws, _positions(heads, item, lo, hi, concat(char(","), self.ws), 0),
                      self.ws, char("]"))

    def string(self, schema: dict, path: str) -> Node:
        lo, hi = _count(schema, "minLength", path), _count(schema, "maxLength", path, None)
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if pattern is None and fmt is None:
            return values.string(lo, hi)
        if pattern is not None and fmt is not None:
            raise GuidedError(f"'pattern' together with 'format' is not supported at {path}")
        if lo or hi is not None:
            raise GuidedError(f"'minLength'/'maxLength' together with 'pattern' or 'format' is not supported at {path}")
        if fmt is not None:
            content = format_node(fmt) if isinstance(fmt, str) else None
            if content is None:
                raise GuidedError(f"unsupported string format {fmt!r} at {path}; supported: {', '.join(FORMATS)}")
        else:
            if not isinstance(pattern, str):
                raise GuidedError(f"'pattern' must be a string at {path}")
            content = parse_regex(pattern)
        # Inside quotes only characters JSON leaves unescaped: the raw text is then the string's value.
        return concat(values.QUOTE, restrict(content, values.UNESCAPED), values.QUOTE)

    def number(self, schema: dict, path: str, integer: bool) -> Node:
        step = schema.get("multipleOf")
        if step is not None and not (integer and step == 1):
            raise GuidedError(f"'multipleOf' is not supported (other than 1 on integers) at {path}")
        lo, lo_open = _bound(schema, "minimum", "exclusiveMinimum", path, integer, math.ceil)
        hi, hi_open = _bound(schema, "maximum", "exclusiveMaximum", path, integer, math.floor)
        return values.number_range(lo, lo_open, hi, hi_open, integer)


def _members(members: list[tuple[Node, bool]], sep: Node, ws: Node) -> Node:
    """Members in order, required ones always; a comma before each but the first one written.

    rest(i) (something written already) is linear; first(i) (nothing yet) branches once per
    optional member, so the tree stays quadratic in the member count, never exponential."""
    rest: list[Node] = [EMPTY] * (len(members) + 1)
    for i in range(len(members) - 1, -1, -1):
        node, required = members[i]
        item = concat(sep, node)
        rest[i] = concat(item if required else optional(item), rest[i + 1])
    first = EMPTY
    for i in range(len(members) - 1, -1, -1):
        node, required = members[i]
        take = concat(node, rest[i + 1], ws)
        first = take if required else alt(take, first)
    return first


def _positions(heads: list[Node], item: Node, lo: int, hi: int | None, sep: Node, i: int) -> Node:
    """Array items from position i on (i written so far): heads[i] while there are heads, then `item`."""
    if hi is not None and i >= hi:
        return EMPTY
    if i >= len(heads):
        more_lo, more_hi = max(lo - i, 0), None if hi is None else hi - i
        if i:
            return repeat(concat(sep, item), more_lo, more_hi)
        body = concat(item, repeat(concat(sep, item), max(lo - 1, 0), None if hi is None else hi - 1))
        return body if lo else optional(body)
    node = concat(EMPTY if i == 0 else sep, heads[i], _positions(heads, item, lo, hi, sep, i + 1))
    return node if i < lo else optional(node)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "?")


def _count(schema: dict, key: str, path: str, default: int | None = 0) -> Any:
    value = schema.get(key, default)
    if value is not default and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise GuidedError(f"'{key}' must be a non-negative integer, got {value!r} at {path}")
    return value


def _bound(schema: dict, key: str, exclusive: str, path: str, integer: bool, rounding: Any
           ) -> tuple[int | None, bool]:
    """(bound, open) for one side: `exclusive` as a number (draft 6+) or a flag on `key` (draft 4)."""
    value, is_open = schema.get(key), False
    ex = schema.get(exclusive)
    if isinstance(ex, bool):
        is_open = ex and value is not None
    elif ex is not None:
        if value is None or (ex >= value if rounding is math.ceil else ex <= value):
            value, is_open = ex, True
    if value is None:
        return None, False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GuidedError(f"'{key}' must be a finite number, got {value!r} at {path}")
    if value == int(value):
        return int(value), is_open
    if integer:  # integers above 2.5 start at 3: the rounded bound is then inclusive
        return int(rounding(value)), False
    raise GuidedError(f"'{key}' {value!r} at {path}: number bounds must be whole numbers (a regex cannot hold a "
                      "fractional bound exactly)")
