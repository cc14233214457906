"""What /v1/chat/completions and /v1/completions share: a generation run to its end, or streamed as events.

Both shapes map the engine's own errors to API errors (queue full, prompt too
long: 4xx/5xx before any header when streaming, since the first output is
awaited first) and answer 503 when the server's shutdown aborts a choice.
The endpoints only say how a choice, a delta and the usage are written.
"""
from __future__ import annotations

from typing import Callable

from starlette.requests import Request

from native_server.api.context import SHUTTING_DOWN, engine_error
from native_server.api.errors import APIError
from native_server.api.generation import ChoiceResult, Delta, Generation, collect
from native_server.api.protocol import Usage
from native_server.api.streaming import EventStream, cancel_on_disconnect, prime, sse_body


def usage_of(generation: Generation) -> Usage:
    """The token counts of the request so far, in the API's shape."""
    return Usage(**generation.usage.as_dict())


async def run_to_end(raw: Request, generation: Generation) -> list[ChoiceResult]:
    """Every choice's result; cancelled if the client goes away."""
    try:
        results = await cancel_on_disconnect(raw, collect(generation))
    except Exception as exc:
        raise engine_error(exc) or exc from None
    if any(r.finish_reason == "abort" for r in results):
        raise APIError(503, SHUTTING_DOWN)
    return results


async def event_stream(raw: Request, generation: Generation, head: list[str], render: Callable[[Delta], str],
                       usage_event: Callable[[Usage], str] | None) -> EventStream:
    """The response streaming `head`, each delta rendered, the usage event when asked for, then [DONE]."""
    try:
        first, deltas = await prime(raw, generation.deltas())
    except Exception as exc:
        raise engine_error(exc) or exc from None

    def live(delta: Delta) -> str:
        if delta.finish_reason == "abort":
            raise APIError(503, SHUTTING_DOWN)
        return render(delta)

    def tail() -> list[str]:
        return [usage_event(usage_of(generation))] if usage_event is not None else []

    return EventStream(sse_body(head, first, deltas, live, tail), deltas)
