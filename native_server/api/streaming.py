"""Server-sent events and client disconnects.

A stream is `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`, as
OpenAI's clients expect. An error after the 200 headers went out can only be
an event: `data: {"error": {...}}`, which OpenAI's SDK raises as an APIError.

Disconnects: Starlette cancels a streaming body when the client goes away,
and `EventStream` then also closes the body's generator, so the engine
request behind it is aborted at once rather than when the garbage collector
finds it. A non-streaming request has no body to cancel, so
`cancel_on_disconnect` watches the connection while it waits.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from native_server.api.context import engine_error
from native_server.api.errors import APIError, error_body

T = TypeVar("T")
logger = logging.getLogger("ruvllm.server")
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of events


def event(data: BaseModel | dict[str, Any]) -> str:
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


def error_event(exc: BaseException) -> str:
    """The event that ends a stream which failed after its headers went out; bugs are logged."""
    exc = engine_error(exc) or exc
    if isinstance(exc, APIError):
        return event(error_body(exc.status, exc.message, exc.param, exc.code))
    logger.error("stream failed", exc_info=exc)
    return event(error_body(500, f"internal server error ({type(exc).__name__}); see the server log"))


class EventStream(StreamingResponse):
    """text/event-stream that always closes its body and the generation behind it, even when the
    client left before the first event (Starlette then never starts the body, so its own cleanup
    would never run)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], upstream: AsyncIterator[Any]) -> None:
        super().__init__(body, headers=SSE_HEADERS)
        self._closers = (body, upstream)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                for stream in self._closers:
                    await stream.aclose()  # type: ignore[attr-defined]


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _disconnected(request: Request) -> None:
    # After the body was read, the next ASGI message is http.disconnect, whenever it comes.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def prime(request: Request, stream: AsyncIterator[T]) -> tuple[T | None, AsyncIterator[T]]:
    """The stream's first item, awaited before any header is sent.

    Errors that come with the first item (queue full, prompt too long) then
    become a proper 4xx/5xx response rather than an event inside a 200.
    """
    async def first_item() -> T | None:
        return await anext(stream, None)

    try:
        first = await cancel_on_disconnect(request, first_item())
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()  # type: ignore[attr-defined]
        raise
    return first, stream


async def sse_body(head: Iterable[str], first: T | None, rest: AsyncIterator[T], render: Callable[[T], str],
                   tail: Callable[[], Iterable[str]]) -> AsyncIterator[str]:
    """Events of a primed stream: `head`, each item rendered, `tail()`, then [DONE], errors as an event."""
    try:
        for text in head:
            yield text
        if first is not None:
            yield render(first)
        async for item in rest:
            yield render(item)
        for text in tail():
            yield text
    except Exception as exc:
        yield error_event(exc)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    yield DONE
