"""A request body read under bounds (size, time, memory shared by all uploads) and checked before parsing.

Every POST body is read here in full and replayed to the app: every
endpoint parses the whole JSON anyway, and reading it first lets the limits
act before any of it is parsed.

    size     over `max_bytes` (by Content-Length or by counting)      -> 413
    time     not all there within `timeout` seconds of the first read -> 408
    memory   bodies being received hold at most `budget_bytes`
             between them; an upload that would pass it               -> 429
    shape    not UTF-8, a lone UTF-16 surrogate escape ("\\ud800"),
             or JSON nested deeper than `max_depth`                   -> 400

The memory budget is what keeps slow uploads from bloating the server: a
hundred connections stalled just short of the size limit once held 4 MiB
each for as long as they stayed open. After a body over TRIM_AFTER_BYTES is
answered, glibc's free heap pages go back to the system (its many short-lived
copies would otherwise stay in the server's RSS). The shape checks run on the raw bytes,
before the JSON parser or pydantic recurse into the document, in linear
time (regular expressions, bytes.translate, a cumulative sum): a 4 MiB body
takes some tens of milliseconds, in a thread. Lone surrogates are refused, not replaced: no tokenizer can
encode them, and silently changing a prompt would be worse than a 400.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import re
from typing import Any, Awaitable, Callable

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from native_server.api.middleware import send_error
from native_server.api.workers import release_memory

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0
MAX_JSON_DEPTH = 64  # a tool's JSON schema nests a dozen levels; nothing legitimate nears 64
_OFFLOAD_BYTES = 64 * 1024  # shape checks of larger bodies run in a thread, off the event loop
TRIM_AFTER_BYTES = 1 << 20  # after a body this large is done with, free heap pages go back to the system

# A JSON string literal (escapes included); what is inside one is not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
# A \uD800-\uDFFF escape; lone_surrogate checks that an even number of backslashes precede it (an odd one
# escapes the escape). The pattern starts with a literal, so the engine skips ahead with a fast search: a
# look-behind first (as before) tried every byte, ~0.1-0.4 s for a 3 MB body, holding the GIL.
_SURROGATE_ESCAPE = re.compile(rb"\\u([dD][89a-fA-F][0-9a-fA-F]{2})")


class BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def json_too_deep(body: bytes, max_depth: int) -> bool:
    """Whether the JSON document nests arrays/objects deeper than max_depth.

    Strings are cut out and every other byte but brackets dropped; the depth
    is then the largest running sum of +1 per opening and -1 per closing
    bracket (a cumulative sum in torch for long documents: linear and
    outside the GIL). An unbalanced document may count as too deep: it is
    a 400 either way."""
    steps = _STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)  # b"\x01" opens, b"\xff" closes
    if len(steps) <= max_depth:
        return False
    if len(steps) < 4096:
        return max(itertools.accumulate(1 if b == 1 else -1 for b in steps)) > max_depth
    import torch  # the server's dependency already; imported here so the module stays light

    deltas = torch.frombuffer(bytearray(steps), dtype=torch.int8)
    return int(deltas.cumsum(0, dtype=torch.int32).max()) > max_depth


def lone_surrogate(body: bytes) -> str | None:
    """The first \\uXXXX escape of a UTF-16 surrogate that is not half of a high-low pair, or None."""
    pending = None  # a high surrogate escape and where its low half must start
    for match in _SURROGATE_ESCAPE.finditer(body):
        start = i = match.start()
        while i > 0 and body[i - 1] == 0x5C:  # each run of backslashes is walked once: linear overall
            i -= 1
        if (start - i) % 2:  # "\\\\u...": the backslash of "\\u" is itself escaped; text, not an escape
            continue
        code = int(match.group(1), 16)
        if pending is not None and (code < 0xDC00 or start != pending[1]):
            return f"\\u{pending[0]:04x}"
        if code >= 0xDC00 and pending is None:
            return f"\\u{code:04x}"
        pending = (code, match.end()) if code < 0xDC00 else None
    return None if pending is None else f"\\u{pending[0]:04x}"


def check_json_shape(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise BodyError(400) for a body no JSON endpoint should parse."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    surrogate = lone_surrogate(body)
    if surrogate is not None:
        raise BodyError(400, f"the body contains a lone UTF-16 surrogate ({surrogate}): strings must be "
                             "valid Unicode (a high surrogate must be followed by a low one)")
    if json_too_deep(body, max_depth):
        raise BodyError(400, f"the body nests arrays and objects more than {max_depth} levels deep")


class UploadBudget:
    """Bytes held by bodies still being received, across all connections (event loop only: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class RequestBody:
    """ASGI middleware: read POST/PUT/PATCH bodies under the bounds above, then replay them to the app."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES, timeout: float = DEFAULT_BODY_TIMEOUT,
                 budget_bytes: int | None = None, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app, self.max_bytes, self.timeout, self.max_depth = app, max_bytes, timeout, max_depth
        self.budget = UploadBudget(budget_bytes if budget_bytes is not None else 16 * max_bytes)

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        try:
            body = await self._read(scope, receive)
            if body is None:  # the client left before sending it all
                return
            if _is_json(scope):
                if len(body) > _OFFLOAD_BYTES:
                    await asyncio.to_thread(check_json_shape, body, self.max_depth)
                else:
                    check_json_shape(body, self.max_depth)
        except BodyError as exc:
            return await send_error(send, exc.status, exc.message, [(b"connection", b"close")], scope.get("path"))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect when the client goes away

        try:
            await self.app(scope, replay, send)
        finally:
            if len(body) > TRIM_AFTER_BYTES:  # its copies (JSON, pydantic, a grammar's key) are garbage now
                body = b""
                await asyncio.to_thread(release_memory)

    async def _read(self, scope: Message, receive: Receive) -> bytes | None:
        too_big = f"request body is larger than the server's limit of {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            raise BodyError(413, too_big)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    raise BodyError(408, f"the request body did not arrive within {self.timeout:g} s") from None
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                if size + len(chunk) > self.max_bytes:
                    raise BodyError(413, too_big)
                if not self.budget.take(len(chunk)):
                    raise BodyError(429, "the server is receiving too many request bodies at once; retry shortly")
                chunks.append(chunk)
                size += len(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            self.budget.give(size)
            chunks.clear()


def _is_json(scope: Message) -> bool:
    """What FastAPI would parse as JSON: an application/json or +json body, or one without a type."""
    content_type = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return not content_type or content_type == b"application/json" or content_type.endswith(b"+json")


class OffLoopJSONRoute(APIRoute):
    """A route that parses a large JSON body in a thread before FastAPI reads it (`request._json`,
    Starlette's cache of request.json()). json.loads of a few MiB held the event loop, and every
    stream on it, for tens of milliseconds a body (a second for six at once on a loaded machine); in
    a thread the loop runs between the parser's GIL slices. A body that does not parse is left to
    FastAPI, which answers its usual 400."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def parse_off_loop(request: Request) -> Response:
            body = await request.body()
            if len(body) > _OFFLOAD_BYTES:
                try:
                    request._json = await asyncio.to_thread(json.loads, body)
                except ValueError:
                    pass
            return await handler(request)

        return parse_off_loop
