"""JSON schemas to DFAs, checked with `jsonschema` (the reference validator): every string the
DFA accepts parses and validates; documents a user would write are accepted; what the compiler
does not support is refused by name; hostile schemas hit a bound, not the process."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from py_engine.guided import GrammarTooLargeError, GuidedError, StructuredOutputsParams, dfa_for
from py_engine.guided.automaton import Budget
from tests.guided.schemas import SCHEMAS, random_document

jsonschema = pytest.importorskip("jsonschema")
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _validate(document: bytes, schema) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER).validate(json.loads(document))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(SCHEMAS, st.integers(0, 2**32))
def test_every_accepted_string_validates(schema, seed):
    dfa = dfa_for(StructuredOutputsParams(json=schema))
    assert dfa.max_length() is not None  # finite: a generation must end
    rng = random.Random(seed)
    for _ in range(20):
        _validate(random_document(dfa, rng), schema)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "email": {"type": "string", "format": "email"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("document", [
    '{"name": "Ada", "age": 36}', '{"name":"Ada","age":36}', '{"name": "A\\"da\\u00e9", "age": 0, "tags": []}',
    '{"name": "", "age": 7, "email": "ada@example.org", "tags": ["x", "y"]}',
])
def test_documents_users_write_are_accepted(document):
    _validate(document.encode(), PERSON)
    assert dfa_for(StructuredOutputsParams(json=PERSON)).matches(document.encode())


@pytest.mark.parametrize("document", [
    '{"age": 36, "name": "Ada"}',  # properties in the order the schema lists them
    '{"name": "Ada"}', '{"name": "Ada", "age": -1}', '{"name": "Ada", "age": 3, "x": 1}', '{"name": "Ada", "age": 3.5}',
])
def test_documents_outside_the_grammar_are_refused(document):
    assert not dfa_for(StructuredOutputsParams(json=PERSON)).matches(document.encode())


@pytest.mark.parametrize("schema,words", [
    ({"type": "string", "contentSchema": {}}, "'contentSchema'"),
    ({"type": "object", "patternProperties": {"a": {}}, "minProperties": 1}, "'minProperties', 'patternProperties'"),
    ({"type": "array", "items": {"type": "integer", "multipleOf": 3}}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "number", "minimum": 0.5}, "whole numbers"),
    ({"type": "string", "format": "idn-email"}, "unsupported string format 'idn-email'"),
    ({"type": "string", "pattern": "(a)\\1"}, "backreferences"),
    ({"type": "strin"}, "'type' must be one of"),
    ({"$ref": "https://example.org/s.json"}, "only local $refs"),
    ({"$ref": "#/$defs/missing"}, "points nowhere"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required properties"),
    ({"allOf": [{"type": "integer", "minimum": 1}, {"minimum": 2}]}, "allOf"),
    ({"not": {"type": "string"}}, "'not'"),
    (False, "admits no value"),
])
def test_unsupported_keywords_are_refused_by_name(schema, words):
    with pytest.raises(GuidedError) as info:
        dfa_for(StructuredOutputsParams(json=schema))
    assert words in str(info.value)


def test_recursion_is_bounded_and_still_generates():
    tree = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "maximum": 9, "minimum": 0},
                                                               "kids": {"type": "array", "maxItems": 2,
                                                                        "items": {"$ref": "#/$defs/node"}}},
                               "required": ["v", "kids"]}}, "$ref": "#/$defs/node"}
    dfa = dfa_for(StructuredOutputsParams(json=tree))
    assert dfa.matches(b'{"v":1, "kids":[{"v":2, "kids":[]}]}')
    rng = random.Random(0)
    for _ in range(50):
        _validate(random_document(dfa, rng), tree)
    with pytest.raises(GuidedError, match="admits no value"):  # every node needs a child: never ends
        dfa_for(StructuredOutputsParams(json={"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                              "required": ["c"]}}, "$ref": "#/$defs/n"}))


@pytest.mark.parametrize("schema,words", [
    ({"type": "string", "minLength": 4000, "maxLength": 9000}, "states"),
    ({"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "string",
      "maxLength": 300}, "maxItems": 40}, "maxItems": 40}, "maxItems": 40}, "states"),
])
def test_hostile_schemas_hit_a_bound(schema, words):
    with pytest.raises(GrammarTooLargeError, match=words):
        dfa_for(StructuredOutputsParams(json=schema), Budget(max_states=50_000, seconds=20))


def test_deep_nesting_is_refused():
    schema: dict = {"type": "integer"}
    for _ in range(60):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    with pytest.raises(GrammarTooLargeError, match="nests deeper"):
        dfa_for(StructuredOutputsParams(json=schema))


def test_json_object_regex_and_choice():
    obj = dfa_for(StructuredOutputsParams(json_object=True))
    assert obj.matches(b'{"a": [1, {"b": null}], "c": "d"}') and not obj.matches(b"[1]")
    assert dfa_for(StructuredOutputsParams(choice=["yes", "no"])).matches(b"no")
    assert not dfa_for(StructuredOutputsParams(regex=r"\d+")).matches(b"12a")
    compact = dfa_for(StructuredOutputsParams(json=PERSON, whitespace_pattern=""))
    assert compact.matches(b'{"name":"A","age":1}') and not compact.matches(b'{"name": "A","age":1}')
    with pytest.raises(GuidedError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(GuidedError, match="line 1, column 10"):  # GBNF quotes with ", not '
        StructuredOutputsParams(grammar="root ::= 'a'")
