"""ASGI middleware of the native server: API key, body-size limit, cross-origin isolation headers.

Plain ASGI classes rather than Starlette's BaseHTTPMiddleware: that one runs
the app in a separate task and buffers nothing for streaming, but it hides
the client's disconnect from a streaming response, and a disconnect must
reach the stream so the engine aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from native_server.errors import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Cross-origin isolation lets the browser demo use SharedArrayBuffer (threaded wasm).
ISOLATION_HEADERS = [(b"cross-origin-opener-policy", b"same-origin"),
                     (b"cross-origin-embedder-policy", b"require-corp")]


async def send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer with an OpenAI-shaped JSON error without going through the app."""
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class IsolationHeaders:
    """Add COOP and COEP to every HTTP response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *ISOLATION_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class APIKey:
    """Require `Authorization: Bearer <key>` on /v1/*; /health, /metrics and static files stay open."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # compare_digest: the time taken must not tell an attacker how much of the key matched.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            return await send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                    [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `max_bytes` with a 413, by Content-Length or by counting a streamed body.

    The body is read here in full (at most max_bytes) and replayed to the app:
    every endpoint parses the whole JSON anyway, and reading it first means an
    oversized chunked upload is cut off before any of it is parsed.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = f"request body is larger than the server's limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_error(send, 413, too_big)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await send_error(send, 413, too_big)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: http.disconnect when the client goes away

        await self.app(scope, replay, send)
