"""POST /v1/responses (OpenAI's Responses API): the request, its conversion to a chat request, and
the response object.

The conversation a response runs is the chat conversation it amounts to, rendered by the same
chat template and run by the same code as /v1/chat/completions (serving_chat.start_chat), so the
same conversation gives the same tokens on both:
  - `instructions` -> a system message first (not carried to the next turn, as OpenAI does);
  - `input` a string -> one user message; items: messages (`role` + text or input_text /
    output_text parts), `function_call` (-> an assistant message's tool_calls, consecutive calls
    in one message) and `function_call_output` (-> a tool message);
  - function `tools` {type, name, description, parameters} -> chat tools; `tool_choice` and
    `parallel_tool_calls` as in chat; `text.format` json_schema / json_object -> response_format;
    `max_output_tokens` -> max_tokens; sampling fields as they are (vLLM's extras too).
Anything else a client may send that would change the answer (hosted tools, reasoning items,
images and files, `reasoning`, `background`, `include`, `conversation`, `prompt`) is a 400 naming
the field, never ignored. Bounds: MAX_ITEMS input items, metadata as OpenAI bounds it.
"""
from __future__ import annotations

import time
from typing import Any

from pydantic import Field

from native_server.api.errors import APIError
from native_server.api.protocol import Bool, ChatCompletionRequest, Float, Int, Str, _Body

MAX_ITEMS = 2048
MAX_METADATA = 16  # pairs; keys up to 64 characters, values up to 512 (OpenAI's bounds)
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
                   "user")


class ResponsesRequest(_Body):
    model: Str | None = None
    input: Str | list[dict[str, Any]] | None = None
    instructions: Str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text" | "json_object" | '
                                                          '"json_schema", "name", "schema", "strict"}}')
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: Bool | None = False
    previous_response_id: Str | None = None
    store: Bool | None = True
    metadata: dict[Str, Str] | None = None
    truncation: Str | None = None
    reasoning: Any = None  # refused unless null
    background: Bool | None = None  # refused when true
    include: list[Str] | None = None  # refused when not empty
    conversation: Any = None  # refused
    prompt: Any = None  # refused (stored prompt templates)
    top_k: Int | None = None
    min_p: Float | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    stop: Str | list[Str] | None = None
    user: Str | None = None


def check_request(body: ResponsesRequest) -> None:
    """400 for what this server does not do, naming the field."""
    refused = [("reasoning", body.reasoning is not None, "reasoning models and reasoning settings"),
               ("background", bool(body.background), "background responses"),
               ("include", bool(body.include), "extra output to include"),
               ("conversation", body.conversation is not None, "conversation objects (use previous_response_id)"),
               ("prompt", body.prompt is not None, "stored prompt templates")]
    for name, sent, what in refused:
        if sent:
            raise APIError(400, f"{name}: {what} are not supported by this server", name)
    if body.truncation not in (None, "disabled", "auto"):
        raise APIError(400, f"truncation must be 'disabled' or 'auto', got {body.truncation!r}", "truncation")
    if body.input is None and body.previous_response_id is None:
        raise APIError(400, "input: required (a string or a list of items)", "input")
    if isinstance(body.input, list) and len(body.input) > MAX_ITEMS:
        raise APIError(400, f"input: at most {MAX_ITEMS} items, got {len(body.input)}", "input")
    meta = body.metadata or {}
    if len(meta) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise APIError(400, f"metadata: at most {MAX_METADATA} pairs, keys up to 64 characters and values up to "
                            "512", "metadata")


# --- input items -> chat messages -----------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{j}]: only text parts (input_text, output_text) are supported, "
                                f"got {kind!r}", "input")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               "input")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise APIError(400, f"{where}: a function_call_output needs a call_id and an output", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(output, where)
                        if isinstance(output, list) else output})
        else:
            raise APIError(400, f"{where}.type: {kind!r} items are not supported (message, function_call and "
                                "function_call_output are)", "input")
    return out


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not (isinstance(name, str) and isinstance(arguments, str) and isinstance(call_id, str)):
        raise APIError(400, f"{where}: a function_call needs a name, arguments (a JSON string) and a call_id",
                       "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(400, f"tools[{i}].type: only function tools are supported, not {kind!r} (hosted tools "
                                "run at OpenAI)", "tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                   "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt.get("schema", True),
                                                       "strict": fmt.get("strict")}}
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                                 list[dict[str, Any]]]:
    """The chat request the response runs, and its conversation without the instructions (what the
    next turn continues from)."""
    conversation = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fields = {k: getattr(body, k) for k in ("model", "temperature", "top_p", "parallel_tool_calls", *SAMPLING_EXTRAS)
              if getattr(body, k) is not None}
    try:
        request = ChatCompletionRequest(messages=messages, tools=chat_tools(body.tools),
                                        tool_choice=chat_tool_choice(body.tool_choice),
                                        response_format=response_format(body.text),
                                        max_tokens=body.max_output_tokens, **fields)
    except ValueError as exc:  # pydantic: a message the chat shape refuses
        raise APIError(400, f"input: {str(exc).splitlines()[0]}", "input") from None
    return request, conversation


# --- the response object --------------------------------------------------------------------------
def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def response_object(response_id: str, body: ResponsesRequest, model: str, output: list[dict[str, Any]],
                    status: str, usage_: dict[str, Any] | None, created: int | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "created_at": created or int(time.time()), "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": None, "store": body.store is not False,
            "temperature": body.temperature, "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
            "truncation": body.truncation or "disabled", "usage": usage_, "user": body.user,
            "metadata": body.metadata or {}}


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages the next turn continues from."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]
