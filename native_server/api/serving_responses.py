"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat pipeline.

The request becomes a chat request (responses_protocol.py) and runs as one (serving_chat.start_chat);
its output is written as Responses output items: a `message` with its output_text, and one
`function_call` item per tool call. Streamed, the typed events follow OpenAI's order:

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added, response.output_text.delta...,
      response.output_text.done, response.content_part.done, response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta...,
      response.function_call_arguments.done, response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens cut it)

each as `event: <type>` + `data: <json>` with a sequence_number; there is no [DONE]. A forced call's
arguments stream piece by piece as they are generated (ChoiceReader's tool_call_delta events).
With `store` (the default) the response and its conversation go to a bounded in-memory store for
previous_response_id and GET / DELETE.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from native_server.api.context import SHUTTING_DOWN, ServerContext, engine_error
from native_server.api.errors import APIError, error_body
from native_server.api.generation import Delta, Generation
from native_server.api.responses_protocol import (ResponsesRequest, call_item, chat_request, check_request,
                                                  message_item, output_messages, response_object, usage)
from native_server.api.responses_store import ResponseStore
from native_server.api.serving import run_to_end
from native_server.api.serving_chat import ChatRun, start_chat
from native_server.api.streaming import EventStream, logger, prime
from py_engine.guided.tools import ChoiceReader, split_events


def store_of(ctx: ServerContext) -> ResponseStore:
    store = getattr(ctx, "responses", None)
    if store is None:
        store = ctx.responses = ResponseStore()  # type: ignore[attr-defined]
    return store


def _history(ctx: ServerContext, previous: str | None) -> list[dict[str, Any]]:
    if previous is None:
        return []
    found = store_of(ctx).get(previous)
    if found is None:
        raise APIError(404, f"previous_response_id: no stored response {previous!r} (this server keeps the "
                            "latest responses in memory only)", "previous_response_id", "not_found")
    response, conversation = found
    return conversation + output_messages(response["output"])


async def create_response(ctx: ServerContext, body: ResponsesRequest, raw: Request) -> Response:
    check_request(body)
    request, conversation = chat_request(body, _history(ctx, body.previous_response_id))
    run = await start_chat(ctx, request, raw, endpoint="responses", id_prefix="resp_")
    if body.stream:
        return await _stream(ctx, body, run, raw, conversation)
    (result,) = await run_to_end(raw, run.generation)
    reader = ChoiceReader(run.plan)
    content, calls = reader.message(result.text)
    output = ([message_item(_item_id("msg"), content or "")] if content or not calls else [])
    output += [call_item(_item_id("fc"), call) for call in calls or []]
    status = "incomplete" if result.finish_reason == "length" else "completed"
    counts = run.generation.usage.as_dict()
    response = response_object(run.request_id, body, run.model, output, status,
                               usage(counts["prompt_tokens"], counts["completion_tokens"],
                                     counts.get("prompt_tokens_details", {}).get("cached_tokens", 0)))
    if body.store is not False:
        store_of(ctx).put(run.request_id, response, conversation)
    return JSONResponse(response)


def get_response(ctx: ServerContext, response_id: str) -> Response:
    found = store_of(ctx).get(response_id)
    if found is None:
        raise APIError(404, f"no stored response {response_id!r}", "response_id", "not_found")
    return JSONResponse(found[0])


def delete_response(ctx: ServerContext, response_id: str) -> Response:
    if not store_of(ctx).delete(response_id):
        raise APIError(404, f"no stored response {response_id!r}", "response_id", "not_found")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class ResponseEvents:
    """The typed events of one streamed response, and the output items they add up to."""

    def __init__(self, response_id: str, body: ResponsesRequest, model: str, reader: ChoiceReader) -> None:
        self.id, self.body, self.model, self.reader = response_id, body, model, reader
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.message: int | None = None  # output index of the open message item
        self.calls: dict[int, int] = {}  # a call's index -> its output index

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def head(self) -> list[str]:
        shell = response_object(self.id, self.body, self.model, [], "in_progress", None)
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def delta(self, delta: Delta) -> str:
        if delta.finish_reason == "abort":
            raise APIError(503, SHUTTING_DOWN)
        events = self.reader.feed(delta.text) + (self.reader.finish() if delta.finish_reason else [])
        out = []
        content, calls = split_events(events)
        if content:
            out += self._text(content)
        for kind, value in events:
            if kind == "tool_call_delta":
                out += self._call_piece(value)
        if not self.reader.streams_arguments:
            for call in calls:  # a parsed call arrives whole
                out += self._call_piece({"index": len(self.calls), "id": call["id"],
                                         "function": {"name": call["function"]["name"], "arguments": ""}})
                out += self._call_piece({"index": len(self.calls) - 1,
                                         "function": {"arguments": call["function"]["arguments"]}})
        return "".join(out)

    def _text(self, text: str) -> list[str]:
        out = []
        if self.message is None:
            self.message = len(self.output)
            item = message_item(_item_id("msg"), "", "in_progress")
            item["content"] = []
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=self.message, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.message,
                                  content_index=0, part=part))
        item = self.output[self.message]
        item["content"][0]["text"] += text
        out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.message,
                              content_index=0, delta=text, logprobs=[]))
        return out

    def _call_piece(self, piece: dict[str, Any]) -> list[str]:
        index = piece["index"]
        out = []
        if index not in self.calls:
            self.calls[index] = len(self.output)
            item = call_item(_item_id("fc"), {"id": piece["id"], "function": {
                "name": piece["function"]["name"], "arguments": ""}}, "in_progress")
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=self.calls[index], item=item))
        at = self.calls[index]
        item, text = self.output[at], piece["function"].get("arguments", "")
        if text:
            item["arguments"] += text
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                  delta=text))
        return out

    def tail(self, status: str, usage_: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        out = []
        for at, item in enumerate(self.output):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=at,
                                      content_index=0, text=part["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                      content_index=0, part=part))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                      name=item["name"], arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=at, item=item))
        response = response_object(self.id, self.body, self.model, self.output, status, usage_)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self.event(kind, response=response))
        return out, response


async def _stream(ctx: ServerContext, body: ResponsesRequest, run: ChatRun, raw: Request,
                  conversation: list[dict[str, Any]]) -> Response:
    events = ResponseEvents(run.request_id, body, run.model, ChoiceReader(run.plan))
    try:
        first, deltas = await prime(raw, run.generation.deltas())
    except Exception as exc:
        raise engine_error(exc) or exc from None

    async def body_events() -> AsyncIterator[str]:
        finish = None
        try:
            for text in events.head():
                yield text
            pending = [first] if first is not None else []
            async for delta in _chain(pending, deltas):
                finish = delta.finish_reason or finish
                text = events.delta(delta)
                if text:
                    yield text
            counts = run.generation.usage.as_dict()
            tail, response = events.tail("incomplete" if finish == "length" else "completed",
                                         usage(counts["prompt_tokens"], counts["completion_tokens"]))
            if body.store is not False:
                store_of(ctx).put(run.request_id, response, conversation)
            for text in tail:
                yield text
        except Exception as exc:
            yield _error_event(events, exc)
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]

    return EventStream(body_events(), deltas)


async def _chain(first: list[Delta], rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    for delta in first:
        yield delta
    async for delta in rest:
        yield delta


def _error_event(events: ResponseEvents, exc: BaseException) -> str:
    """Responses' `error` event: {type, code, message, param, sequence_number}."""
    exc = engine_error(exc) or exc
    if not isinstance(exc, APIError):
        logger.error("stream failed", exc_info=exc)
        exc = APIError(500, f"internal server error ({type(exc).__name__}); see the server log")
    error = error_body(exc.status, exc.message, exc.param, exc.code)["error"]
    return events.event("error", code=str(error["code"]), message=error["message"], param=error["param"])
