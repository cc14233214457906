"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat pipeline.

The request becomes a chat request (messages_protocol.py) and runs as one. The reply is a message
of `text` and `tool_use` blocks; streamed, Anthropic's events in its order:

    message_start, content_block_start (text), content_block_delta (text_delta)..., content_block_stop,
    content_block_start (tool_use), content_block_delta (input_json_delta)..., content_block_stop,
    message_delta (stop_reason, stop_sequence, usage), message_stop

as `event: <type>` + `data: <json>`; a failure after the headers is an `error` event. Errors are
in Anthropic's shape ({"type": "error", "error": {"type", "message"}}: errors.py picks it by path),
and `x-api-key` is taken like the bearer key (middleware.py). A forced call's input streams piece
by piece as it is generated; a parsed one arrives whole.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from native_server.api.context import SHUTTING_DOWN, ServerContext, engine_error
from native_server.api.errors import APIError, error_body
from native_server.api.generation import Delta
from native_server.api.guided import tool_plan
from native_server.api.messages_protocol import (CountTokensRequest, MessagesRequest, chat_messages, chat_request,
                                                 chat_tool_choice, chat_tools, message_object, stop_reason,
                                                 tool_use_block, tool_use_id, usage)
from native_server.api.prompts import chat_render_args
from native_server.api.protocol import ChatCompletionRequest
from native_server.api.serving import run_to_end
from native_server.api.serving_chat import ChatRun, start_chat
from native_server.api.streaming import EventStream, logger, prime
from py_engine.chat import ChatTemplateError
from py_engine.generate import start_ids
from py_engine.guided.tools import ChoiceReader, split_events


async def create_message(ctx: ServerContext, body: MessagesRequest, raw: Request) -> Response:
    run = await start_chat(ctx, chat_request(body), raw, endpoint="messages", id_prefix="msg_")
    stops = tuple(body.stop_sequences or ())
    if body.stream:
        return await _stream(ctx, run, raw, stops)
    (result,) = await run_to_end(raw, run.generation)
    reader = ChoiceReader(run.plan)
    content, calls = reader.message(result.text)
    blocks = ([{"type": "text", "text": content}] if content else []) + [tool_use_block(c) for c in calls or []]
    sequence = _matched_stop(ctx, result.text, result.token_ids, result.finish_reason, stops)
    counts = run.generation.usage.as_dict()
    return JSONResponse(message_object(run.request_id, run.model, blocks,
                                       stop_reason(result.finish_reason, bool(calls), sequence), sequence,
                                       usage(counts["prompt_tokens"], counts["completion_tokens"],
                                             counts["prompt_tokens_details"]["cached_tokens"])))


async def count_tokens(ctx: ServerContext, body: CountTokensRequest) -> Response:
    """The prompt's tokens as /v1/messages would render it (template, system, tools)."""
    ctx.adapter_for(body.model)
    chat_config = ctx.check_chat()
    choice, parallel = chat_tool_choice(body.tool_choice)
    request = ChatCompletionRequest(messages=chat_messages(body.system, body.messages), tools=chat_tools(body.tools),
                                    tool_choice=choice, parallel_tool_calls=parallel)
    tool_plan(request, chat_config)  # a bad tool is a 400 here too
    messages, options = chat_render_args(request, chat_config, ctx.allow_client_chat_template)
    try:
        text = await ctx.templates.render(messages, chat_config, **options)
    except ChatTemplateError as exc:
        raise APIError(400, f"messages: the chat template could not render them: {exc}", "messages") from None
    ids = await asyncio.to_thread(start_ids, ctx.tokenizer, text, add_special_tokens=False)
    return JSONResponse({"input_tokens": len(ids)})


def _matched_stop(ctx: ServerContext, text: str, token_ids: list[int], finish: str | None,
                  stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the output, if one did: the tokens decoded whole hold it right
    where the text (which never includes it) ends."""
    if finish != "stop" or not stops:
        return None
    whole = ctx.tokenizer.decode(token_ids, skip_special_tokens=True)
    rest = whole[len(text):] if whole.startswith(text) else ""
    return next((s for s in sorted(stops, key=len, reverse=True) if rest.startswith(s)), None)


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageEvents:
    """Anthropic's stream events of one reply: one content block open at a time, in output order."""

    def __init__(self, reader: ChoiceReader) -> None:
        self.reader = reader
        self.index = -1  # the open block's index
        self.open: str | None = None  # "text" or a call's index (as a string)
        self.called = False

    def delta(self, delta: Delta) -> str:
        if delta.finish_reason == "abort":
            raise APIError(503, SHUTTING_DOWN)
        events = self.reader.feed(delta.text) + (self.reader.finish() if delta.finish_reason else [])
        content, calls = split_events(events)
        out = [self._text(content)] if content else []
        for kind, value in events:
            if kind == "tool_call_delta":
                out.append(self._input(value))
        if not self.reader.streams_arguments:
            for j, call in enumerate(calls):
                out.append(self._input({"index": f"w{j}", "id": call["id"], "function": call["function"]}))
        return "".join(out)

    def _start(self, key: str, block: dict[str, Any]) -> str:
        out = self.close()
        self.index += 1
        self.open = key
        return out + _sse("content_block_start", {"index": self.index, "content_block": block})

    def _text(self, text: str) -> str:
        out = self._start("text", {"type": "text", "text": ""}) if self.open != "text" else ""
        return out + _sse("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})

    def _input(self, piece: dict[str, Any]) -> str:
        key, out = f"call{piece['index']}", ""
        if "id" in piece:
            self.called = True
            out = self._start(key, {"type": "tool_use", "id": tool_use_id(piece["id"]),
                                    "name": piece["function"]["name"], "input": {}})
        text = piece["function"].get("arguments", "")
        if text and self.open == key:
            out += _sse("content_block_delta", {"index": self.index,
                                                "delta": {"type": "input_json_delta", "partial_json": text}})
        return out

    def close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return _sse("content_block_stop", {"index": self.index})


async def _stream(ctx: ServerContext, run: ChatRun, raw: Request, stops: tuple[str, ...]) -> Response:
    events = MessageEvents(ChoiceReader(run.plan))
    try:
        first, deltas = await prime(raw, run.generation.deltas())
    except Exception as exc:
        raise engine_error(exc) or exc from None

    async def body() -> AsyncIterator[str]:
        finish, text, ids = None, "", []
        try:
            counts = run.generation.usage.as_dict()
            yield _sse("message_start", {"message": message_object(run.request_id, run.model, [], None, None, usage(
                counts["prompt_tokens"], 0, counts["prompt_tokens_details"]["cached_tokens"]))})
            pending = [first] if first is not None else []
            async for delta in _chain(pending, deltas):
                finish = delta.finish_reason or finish
                text, ids = text + delta.text, ids + list(delta.token_ids)
                out = events.delta(delta)
                if out:
                    yield out
            yield events.close()
            sequence = _matched_stop(ctx, text, ids, finish, stops)
            counts = run.generation.usage.as_dict()
            yield _sse("message_delta", {"delta": {"stop_reason": stop_reason(finish, events.called, sequence),
                                                   "stop_sequence": sequence},
                                         "usage": {"output_tokens": counts["completion_tokens"]}})
            yield _sse("message_stop", {})
        except Exception as exc:
            yield _error_event(exc)
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]

    return EventStream(body(), deltas)


async def _chain(first: list[Delta], rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    for delta in first:
        yield delta
    async for delta in rest:
        yield delta


def _error_event(exc: BaseException) -> str:
    exc = engine_error(exc) or exc
    if not isinstance(exc, APIError):
        logger.error("stream failed", exc_info=exc)
        exc = APIError(500, f"internal server error ({type(exc).__name__}); see the server log")
    body = error_body(exc.status, exc.message, exc.param, exc.code, path="/v1/messages")
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
