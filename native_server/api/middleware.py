"""ASGI middleware of the native server: Host allow-list, API key, cross-origin isolation headers.

(The request body's bounds are request_body.py's.)

Plain ASGI classes rather than Starlette's BaseHTTPMiddleware: that one runs
the app in a separate task and buffers nothing for streaming, but it hides
the client's disconnect from a streaming response, and a disconnect must
reach the stream so the engine aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from native_server.api.errors import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# With a key set, the schema is behind it too: it lists every endpoint and field a caller could probe.
KEYED_PREFIXES = ("/v1", "/docs", "/redoc", "/openapi.json")
# Cross-origin isolation lets the browser demo use SharedArrayBuffer (threaded wasm).
ISOLATION_HEADERS = [(b"cross-origin-opener-policy", b"same-origin"),
                     (b"cross-origin-embedder-policy", b"require-corp")]


async def send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] = (),
                     path: str | None = None) -> None:
    """Answer with a JSON error (OpenAI's shape, Anthropic's on its paths) without going through the app."""
    body = json.dumps(error_body(status, message, path=path)).encode()
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
    """Require `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on /v1/* and the
    schema (/docs, /openapi.json); /health, /metrics and static files stay open."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not scope["path"].startswith(KEYED_PREFIXES):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest: the time taken must not tell an attacker how much of the key matched.
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        keyed = b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"].strip(), self.key)
        if not (bearer or keyed):
            return await send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                                    "(or 'x-api-key: <key>')", [(b"www-authenticate", b"Bearer")], scope["path"])
        await self.app(scope, receive, send)


class AllowedHosts:
    """Answer 400 to a request whose Host header names no allowed host.

    The defence against DNS rebinding: a web page whose domain is made to
    resolve to 127.0.0.1 can make the victim's browser call a keyless server
    on this machine, but the Host header still carries the page's domain.
    `hosts` are names without the port; "*" allows any, "*.example.com" any
    subdomain. Requests without a Host header (HTTP/1.0) pass: browsers always send one.
    """

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...] = LOOPBACK_HOSTS) -> None:
        self.app = app
        self.any = "*" in hosts
        self.names = {h.lower().strip("[]") for h in hosts if not h.startswith("*")}
        self.suffixes = tuple(h[1:].lower() for h in hosts if h.startswith("*."))

    def allows(self, host: str) -> bool:
        name = host.lower()
        if name.startswith("["):  # [::1]:8000
            name = name[1:].partition("]")[0]
        elif name.count(":") == 1:  # name:port; more colons is a bare IPv6 address
            name = name.partition(":")[0]
        return self.any or name in self.names or (bool(self.suffixes) and name.endswith(self.suffixes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.any:
            host = dict(scope["headers"]).get(b"host")
            if host is not None and not self.allows(host.decode("latin-1")):
                return await send_error(send, 400, "invalid Host header: this server answers only to "
                                        f"{', '.join(sorted(self.names)) or 'no name'}; start it with "
                                        "--allowed-hosts to add names", path=scope["path"])
        await self.app(scope, receive, send)
