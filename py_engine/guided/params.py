"""`StructuredOutputsParams`: what a request constrains its output to, vLLM's names and shapes.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    StructuredOutputsParams(regex=r"\\d{3}-\\d{4}")
    StructuredOutputsParams(choice=["yes", "no"])
    StructuredOutputsParams(json_object=True)            # any JSON object
    StructuredOutputsParams(grammar='root ::= "yes" | "no"')   # llama.cpp's GBNF

Exactly one of json / regex / choice / json_object / grammar. `whitespace_pattern` (a regex) is
the whitespace a JSON output may hold between its tokens; by default one optional space (after
`{ [ , :` and before `} ]`), which keeps outputs finite and matches json.dumps' spacing.
`grammar` is llama.cpp's GBNF (vLLM's field name; see py_engine/guided/gbnf): parsed here, so a
syntax error is a GuidedError at once, and compiled with the others. Frozen and
validated once, like SamplingParams; the compiled automaton is kept beside the params (see
`compiled`), so a server can compile off its engine thread and the engine reuse it. Stdlib only.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from py_engine.guided.errors import GuidedError

MAX_SCHEMA_CHARS = 100_000
MAX_CHOICES = 1_000
MAX_CHOICE_CHARS = 10_000
DEFAULT_WHITESPACE = "[ ]?"


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Any = None  # a JSON schema: dict, bool, or its JSON text
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    json_object: bool | None = None
    grammar: str | None = None  # llama.cpp's GBNF
    whitespace_pattern: str | None = None
    # Compiled forms, filled by py_engine.guided.compile (never compared, hashed or shown).
    compiled: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    origin: str | None = field(default=None, compare=False, repr=False)  # the request field it came from

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "json_object", "grammar")
                 if getattr(self, k) is not None and not (k == "json_object" and self.json_object is False)]
        if len(given) != 1:
            raise GuidedError(f"structured outputs need exactly one of json, regex, choice, json_object, grammar; got "
                              f"{', '.join(given) or 'none'}", "structured_outputs")
        if self.grammar is not None:
            from py_engine.guided.gbnf.parser import parse_gbnf  # the compiler's package, loaded when used

            parse_gbnf(self.grammar)
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.regex is not None and not isinstance(self.regex, str):
            raise GuidedError("regex must be a string", "structured_outputs.regex")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if self.json_object not in (None, True, False):
            raise GuidedError("json_object must be a boolean", "structured_outputs.json_object")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise GuidedError("whitespace_pattern must be a string", "structured_outputs.whitespace_pattern")

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of `key`: what caches keep (a key may be megabytes of choices; this is 64 characters)."""
        return hashlib.sha256(self.key.encode("utf-8", "surrogatepass")).hexdigest()

    @property
    def key(self) -> str:
        """A canonical text naming the grammar: equal keys compile to the same automaton."""
        ws = DEFAULT_WHITESPACE if self.whitespace_pattern is None else self.whitespace_pattern
        if self.json is not None:
            return "json:" + ws + "\0" + json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(list(self.choice), ensure_ascii=False)
        if self.grammar is not None:
            return "gbnf:" + self.grammar
        return "json_object:" + ws

    @classmethod
    def from_dict(cls, data: Any, param: str = "structured_outputs") -> StructuredOutputsParams:
        """From a JSON body (vLLM's `structured_outputs` object); unknown fields are refused."""
        if not isinstance(data, dict):
            raise GuidedError(f"{param} must be an object", param)
        known = {"json", "regex", "choice", "json_object", "grammar", "whitespace_pattern",
                 "disable_any_whitespace", "disable_fallback", "disable_additional_properties"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise GuidedError(f"{param}: unsupported field(s) {', '.join(unknown)}", param)
        kwargs = {k: data[k] for k in ("json", "regex", "choice", "json_object", "grammar", "whitespace_pattern")
                  if data.get(k) is not None}
        if data.get("disable_any_whitespace") and "whitespace_pattern" not in kwargs:
            kwargs["whitespace_pattern"] = ""  # vLLM's flag: no whitespace at all
        return cls(**kwargs)


def _schema(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise GuidedError(f"the JSON schema is over {MAX_SCHEMA_CHARS} characters", "structured_outputs.json")
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GuidedError(f"the JSON schema is not valid JSON: {exc}", "structured_outputs.json") from None
    if not isinstance(value, (dict, bool)):
        raise GuidedError("a JSON schema must be an object or a boolean", "structured_outputs.json")
    if len(json.dumps(value)) > MAX_SCHEMA_CHARS:
        raise GuidedError(f"the JSON schema is over {MAX_SCHEMA_CHARS} characters", "structured_outputs.json")
    return value


def _choices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
        raise GuidedError("choice must be a non-empty list of strings", "structured_outputs.choice")
    if len(value) > MAX_CHOICES or any(len(c) > MAX_CHOICE_CHARS for c in value):
        raise GuidedError(f"choice: at most {MAX_CHOICES} strings of {MAX_CHOICE_CHARS} characters",
                          "structured_outputs.choice")
    if any(c == "" for c in value):
        raise GuidedError("choice strings must be non-empty", "structured_outputs.choice")
    return tuple(value)
