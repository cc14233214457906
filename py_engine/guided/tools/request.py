"""OpenAI `tools` and `tool_choice`: validation, the grammar that forces a call, and its reading.

    tools = check_tools(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"), tools)          # ToolChoice("auto"/"required"/...)
    params = replace(params, structured_outputs=forced_calls_grammar(tools, choice))   # required / named
    calls = read_forced_calls(text, choice)                        # -> [{"id", "type", "function"}]

As vLLM does: `required` constrains the output to a JSON array of one or more
`{"name": <a tool's name>, "parameters": <its arguments>}` (each item checked against that
tool's parameter schema); a named function constrains it to that function's arguments; `auto`
(the default when tools are given) leaves the output free and parses the template family's
own tool-call syntax out of it (parsers.py); `none` parses nothing. A tool without a name, a
name outside OpenAI's `^[a-zA-Z0-9_-]{1,64}$`, or parameters that are not a schema object are
GuidedErrors (a 400). Stdlib only.
"""
from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Any

from py_engine.guided.errors import GuidedError
from py_engine.guided.params import StructuredOutputsParams
from py_engine.guided.tools.call_scan import ARGS, ARRAY, CallScanner

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, when named


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's tools, validated: [{"name", "description", "parameters"}] (empty when none)."""
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise GuidedError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise GuidedError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise GuidedError(f"{where}.function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise GuidedError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                              "tools")
        if name in names:
            raise GuidedError(f"{where}: two tools are named {name!r}", "tools")
        names.add(name)
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise GuidedError(f"{where}.function.parameters must be a JSON schema object", "tools")
        out.append({"name": name, "description": fn.get("description"), "parameters": params})
    return out


def tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise GuidedError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolChoice(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or (isinstance(choice, dict) and choice.get("type", "function") != "function"):
        raise GuidedError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", "tool_choice")
    if name not in {t["name"] for t in tools}:
        raise GuidedError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("named", name)


def forced_calls_grammar(tools: list[dict[str, Any]], choice: ToolChoice,
                         parallel: bool = True) -> StructuredOutputsParams | None:
    """The grammar a required or named tool choice imposes; None for none and auto. Without
    parallel calls the array holds exactly one: the grammar closes it after the first call."""
    if choice.mode == "named":
        tool = next(t for t in tools if t["name"] == choice.name)
        return StructuredOutputsParams(json=tool["parameters"], origin="tools")
    if choice.mode != "required":
        return None
    # Each tool's parameters under $defs, its local $refs rebased there (they name the tool's own root).
    defs = {f"tool{i}": _rebased(t["parameters"], f"#/$defs/tool{i}") for i, t in enumerate(tools)}
    items = [{"type": "object",
              "properties": {"name": {"const": t["name"]}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    array = {"type": "array", "minItems": 1, "$defs": defs,
             "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, origin="tools")


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas: never rebased
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local $refs ("#", "#/...") point into it once it sits at `base`."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # names (maybe "enum") -> schemas
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def read_forced_calls(text: str, choice: ToolChoice) -> list[dict[str, Any]]:
    """The complete tool calls of an output generated under forced_calls_grammar (those before a
    max_tokens cut); arguments are the text the model wrote."""
    scan = CallScanner(ARGS, name=choice.name) if choice.mode == "named" else CallScanner(ARRAY, ("parameters",))
    scan.feed(text)
    scan.finish()
    return [tool_call(name, args) for name, args in scan.calls]


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """One OpenAI tool call; arguments as a JSON string, as OpenAI returns them."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id(mistral: bool = False) -> str:
    """`call_` and 24 hex digits; Mistral's templates want 9 letters and digits."""
    if mistral:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"call_{random.getrandbits(96):024x}"


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as chat templates expect them: arguments as objects, not JSON text
    (OpenAI sends text; templates write `arguments | tojson`), as vLLM converts them too; and
    an empty string for the content OpenAI leaves null beside tool calls (Qwen3's and
    Devstral's templates read it as a string)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
            if message.get("content") is None:
                message["content"] = ""
        out.append(message)
    return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}}
