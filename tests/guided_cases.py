"""Structured-output and tool requests run in every runtime (Node, Chromium) and checked against
CPython running the same requests through the same shared layer on onnxruntime."""
from __future__ import annotations

import json
from pathlib import Path

from tests.gbnf_cases import LIST
from tests.gbnf_cases import MAX_TOKENS as GBNF_MAX_TOKENS
from tests.gbnf_cases import PROMPT as GBNF_PROMPT

PROMPT = "To be, or not"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Who art thou?"}]
# Structured outputs and tools in Node, against the same requests in CPython (the same Python code).
GUIDED = {
    "schema": {"kind": "chat", "request": {"messages": USER, "max_tokens": 60, "temperature": 1.0, "seed": 3,
                                           "response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "p", "schema": PERSON}}}},
    "regex": {"kind": "text", "request": {"prompt": PROMPT, "max_tokens": 20, "temperature": 0.9, "seed": 1,
                                          "structured_outputs": {"regex": "[A-Z][a-z]{1,6} (is|was) [0-9]{2}"}}},
    "tools": {"kind": "chat", "request": {"messages": USER, "max_tokens": 60, "seed": 2, "tools": TOOLS,
                                          "tool_choice": "required"}},
    "tools_streamed": {"kind": "chat", "request": {"messages": USER, "max_tokens": 60, "seed": 2, "tools": TOOLS,
                                                   "tool_choice": "required", "stream": True}},
    # llama.cpp's list grammar (GBNF, tests/gbnf_cases.py): the same tokens as CPython's LLM.generate
    "gbnf": {"kind": "text", "request": {"prompt": GBNF_PROMPT, "max_tokens": GBNF_MAX_TOKENS, "temperature": 1.0,
                                         "seed": 1, "grammar": LIST}},
    "bad_schema": {"kind": "chat", "request": {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "contentSchema": {}}}}}},
}


def guided_reference(llm, export: Path, name: str) -> tuple[list[int], str]:
    """CPython (llm: onnxruntime over `export`) running a GUIDED request through the same shared layer."""
    from py_engine.chat import load_chat_config
    from py_engine.guided.tools import apply_plan, plan_tools
    from py_engine.sampling_params import from_openai

    spec = GUIDED[name]
    request = spec["request"]
    params = from_openai(request)
    if spec["kind"] == "chat":
        prompt = llm.encode(llm.chat_prompt(request["messages"], tools=request.get("tools")), add_special_tokens=False)
        params = apply_plan(params, plan_tools(request.get("tools"), request.get("tool_choice"),
                                               load_chat_config(export).templates))
    else:
        prompt = llm.encode(request["prompt"])
    out = llm.generate(prompt, params)
    return out.token_ids, out.text


def check_guided_run(got: dict, export: Path, strict: bool) -> None:
    """`got`: what tests/npm/guided_requests.mjs's guided() returned for GUIDED. strict: the model is the
    built-in one (trained), so its forced calls must finish; random weights may run to max_tokens."""
    import jsonschema

    from py_engine import LLM

    llm = LLM(str(export), backend="onnx", dtype="fp32")
    for request in ("schema", "regex", "tools", "gbnf"):
        ids, _ = guided_reference(llm, export, request)
        assert got[request]["ids"] == ids, request
    from tests.guided.llama_grammar import llama_grammar_checker

    (verdict,) = llama_grammar_checker()(LIST, [got["gbnf"]["content"]])
    # ended by the grammar: a sentence; cut by max_tokens: a prefix of one (or a sentence that could go on)
    assert verdict in (("complete",) if got["gbnf"]["finish"] == "stop" else ("complete", "prefix")), (
        got["gbnf"], verdict)
    if got["schema"]["finish"] == "stop":
        jsonschema.validate(json.loads(got["schema"]["content"]), PERSON)
    calls = got["tools"]["calls"]
    assert got["tools_streamed"]["calls"] == calls
    assert got["tools_streamed"]["finish"] == got["tools"]["finish"]
    if strict or got["tools"]["finish"] == "tool_calls":
        assert got["tools"]["finish"] == "tool_calls" and got["tools"]["content"] is None and calls
        for tool, arguments in calls:
            assert tool == "get_weather"
            jsonschema.validate(json.loads(arguments), TOOLS[0]["function"]["parameters"])
    assert got["bad_schema"]["error"] == "InvalidRequestError" and got["bad_schema"]["param"] == "response_format"
    assert "contentSchema" in got["bad_schema"]["message"]
