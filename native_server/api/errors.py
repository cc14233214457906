"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right status
(Anthropic's `{"type": "error", "error": {"type", "message"}}` on /v1/messages).

Every failure a client can cause maps to a 4xx here, in one table, so no
handler invents its own status:

    400 invalid_request_error   bad JSON, wrong types, bad values, prompt too long
    401 authentication_error    missing or wrong API key
    403 permission_error        feedback on another session's completion
    404 not_found_error         unknown model or path
    413 invalid_request_error   body over the size limit
    503 service_unavailable     waiting queue full, or the server is shutting down
    500 internal_server_error   a bug: logged with its traceback, message kept generic
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("ruvllm.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          503: "service_unavailable", 500: "internal_server_error"}


class APIError(Exception):
    """An error the client should see, with its HTTP status and the request field it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# Anthropic's error types (its Messages API answers in its own shape: {"type": "error", "error": {...}}).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_path(path: str | None) -> bool:
    """The paths of Anthropic's Messages API, whose errors take Anthropic's shape."""
    return path is not None and (path == "/v1/messages" or path.startswith("/v1/messages/"))


def error_body(status: int, message: str, param: str | None = None, code: Any = None,
               path: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response (also sent as an SSE event when a stream fails), in
    OpenAI's shape, or Anthropic's for its paths (the field, when known, is named in the message)."""
    if anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        named = f"{param}: " if param and not message.startswith(param) else ""
        return {"type": "error", "error": {"type": kind, "message": named + message}}
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code: Any = None,
                   headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, path), status_code=status, headers=headers)


def _field_path(errors: list[dict[str, Any]]) -> tuple[Any, ...]:
    """Where the first error is, as a path under the body; for a union field (stop, prompt, content)
    pydantic reports one error per member, tagged with the member's type, so take their common prefix."""
    locs = [tuple(p for p in e.get("loc", ()) if p != "body") for e in errors]
    same_field = [loc for loc in locs if loc[:1] == locs[0][:1]]
    path = same_field[0]
    for loc in same_field[1:]:
        n = next((i for i, (a, b) in enumerate(zip(path, loc)) if a != b), min(len(path), len(loc)))
        path = path[:n]
    return path


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    path = _field_path(errors)
    param = ".".join(str(p) for p in path) or None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        # A form-encoded or empty body (curl -d without a JSON Content-Type) lands here.
        return "the body must be a JSON object, sent with 'Content-Type: application/json'", None
    detail = first.get("msg", "invalid value")
    members = sum(1 for e in errors if tuple(p for p in e.get("loc", ()) if p != "body")[:len(path)] == path)
    if members > 1 and len(first.get("loc", ())) > len(path) + 1:
        detail = f"matches none of the accepted types (first: {detail})"
    return f"{param or 'body'}: {detail}", param


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return error_response(400, message, param, path=request.url.path)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, path=request.url.path)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None), path=request.url.path)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal server error ({type(exc).__name__}); see the server log",
                          path=request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI can raise through the OpenAI error shape."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
