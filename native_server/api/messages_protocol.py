"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the request, its
conversion to a chat request, and the message object.

As /v1/responses does, a Messages request becomes the chat request it amounts to and runs through
serving_chat.start_chat, so a conversation gives the same tokens as on /v1/chat/completions:
  - `system` (a string or text blocks) -> a system message first;
  - content blocks: `text` -> the message's text; an assistant's `tool_use` {id, name, input} ->
    its tool_calls; a user's `tool_result` {tool_use_id, content} -> a tool message (before the
    user's own text, as Anthropic orders them);
  - `tools` [{name, description, input_schema}] -> function tools; `tool_choice` auto / any /
    tool {name} / none -> auto / required / named / none, `disable_parallel_tool_use` ->
    parallel_tool_calls false; `stop_sequences` -> stop; `max_tokens` (required), temperature,
    top_p, top_k as they are.
Images, documents, thinking and server tools are a 400 naming the field. The reply's tool calls are
`tool_use` blocks whose input is the call's arguments as an object; stop_reason is end_turn,
max_tokens, stop_sequence (with the sequence) or tool_use.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from native_server.api.errors import APIError
from native_server.api.protocol import Bool, ChatCompletionRequest, Float, Int, Str, _Body

MAX_MESSAGES = 2048
MAX_STOP_SEQUENCES = 16


class MessagesRequest(_Body):
    model: Str | None = None
    max_tokens: Int = Field(description="required, as in Anthropic's API")
    messages: list[dict[str, Any]]
    system: Str | list[dict[str, Any]] | None = None
    stop_sequences: list[Str] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    stream: Bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: Any = None  # refused unless disabled
    # vLLM's sampling extras, as on the other endpoints
    seed: Int | None = None
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None


class CountTokensRequest(_Body):
    model: Str | None = None
    messages: list[dict[str, Any]]
    system: Str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks", "messages")
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in ("text", "tool_use", "tool_result"):
            raise APIError(400, f"{where}.content[{j}].type: {kind!r} blocks are not supported (text, tool_use and "
                                "tool_result are)", "messages")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}.content[{j}].text must be a string", "messages")
    return content


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                         isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise APIError(400, f"{where}: a tool_result's content must be a string or text blocks", "messages")


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"messages: at most {MAX_MESSAGES}, got {len(messages)}", "messages")
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else "".join(
            b["text"] for b in _blocks(system, "system") if b["type"] == "text")
        out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be user or assistant, got {role!r}", "messages")
        blocks = _blocks(message.get("content"), where)
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        if role == "assistant":
            calls = [_tool_use(b, f"{where}.content[{j}]") for j, b in enumerate(blocks) if b["type"] == "tool_use"]
            entry: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
            continue
        for j, block in enumerate(blocks):
            if block["type"] == "tool_result":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{where}.content[{j}]: a tool_result needs a tool_use_id", "messages")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _result_text(block, f"{where}.content[{j}]")})
            elif block["type"] == "tool_use":
                raise APIError(400, f"{where}.content[{j}]: tool_use blocks belong to assistant messages", "messages")
        if text or not any(b["type"] == "tool_result" for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
            and isinstance(block.get("input"), dict)):
        raise APIError(400, f"{where}: a tool_use needs an id, a name and an input object", "messages")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None) or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}]: only client tools with an input_schema are supported (not {kind!r})",
                           "tools")
        out.append({"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                                     "parameters": tool["input_schema"]}})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice")


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    thinking = body.thinking
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise APIError(400, "thinking: extended thinking is not supported by this server", "thinking")
    if body.stop_sequences is not None and len(body.stop_sequences) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"stop_sequences: at most {MAX_STOP_SEQUENCES}", "stop_sequences")
    choice, parallel = chat_tool_choice(body.tool_choice)
    fields = {k: getattr(body, k) for k in ("model", "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty") if getattr(body, k) is not None}
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    return ChatCompletionRequest(messages=chat_messages(body.system, body.messages), tools=chat_tools(body.tools),
                                 tool_choice=choice, parallel_tool_calls=parallel, max_tokens=body.max_tokens,
                                 **fields)


# --- the reply ------------------------------------------------------------------------------------
def tool_use_id(call_id: str) -> str:
    """Anthropic's ids read toolu_...; the chat call's id, renamed (the same whole and streamed)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    try:
        value = json.loads(call["function"]["arguments"])
    except ValueError:
        value = {}
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
            "input": value if isinstance(value, dict) else {"value": value}}


def stop_reason(finish: str | None, called: bool, sequence: str | None) -> str:
    if called:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if sequence is not None else "end_turn"


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt, "output_tokens": completion, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def message_object(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
                   sequence: str | None, usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}
