"""The FastAPI app of the native server: OpenAI's endpoints over one `AsyncEngine`.

    POST /v1/chat/completions   chat, streaming (SSE) or not          serving_chat.py
    POST /v1/completions        legacy completions, prompts or ids    serving_completions.py
                                (what the two share: serving.py)
    POST /v1/feedback           a rating / correction of a logged completion feedback.py
                                (with --witness-log; the log: witness.py)
    GET  /v1/learning           the learning loops' state (with --learning)   learner.py
    DELETE /v1/feedback/{id}?user=  forget a feedback: its pattern, its adapter; the log marks it deleted
    POST /v1/learning/consolidate   start a consolidation now (202)
    POST /v1/learning/rollback  {"version": N}: serve consolidated sona-vN again (0: none)
    GET  /v1/models             the served model and its LoRA adapters (`parent`)
    POST /v1/load_lora_adapter  {lora_name, lora_path}: with --enable-runtime-lora only   lora.py
    POST /v1/unload_lora_adapter {lora_name}
    GET  /health                200 while serving, 503 once shutting down or when the engine loop died
    GET  /metrics               Prometheus text                        metrics.py
    GET  /openapi.json, /docs   the schema of all of the above
    GET  /*                     web/dist (the browser demo), when it exists

`create_app` builds the app around a loaded engine (wrapped in a
`ServerContext`); the app starts the engine's loop on startup and drains it
on shutdown. Middleware, from the outside in: cross-origin isolation headers
on every response, the Host allow-list, the API key on /v1 and the schema,
the request body's bounds (request_body.py). Errors are OpenAI-shaped
(errors.py). /v1/models names the model, never its folder on disk; the demo
files never include dotfiles (.git, .env).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from native_server.api.context import SHUTTING_DOWN, ServerContext, engine_error
from native_server.api.errors import APIError, error_response, install_error_handlers
from native_server.learning.feedback import FeedbackRequest, FeedbackResponse
from native_server.learning.learner import learning_metrics
from native_server.engine.lora import confined_path
from native_server.engine.outputs import EngineError
from native_server.api.middleware import AllowedHosts, APIKey, IsolationHeaders
from native_server.api.request_body import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, OffLoopJSONRoute, RequestBody
from native_server.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, ErrorResponse, Int, LoadLoraAdapterRequest, ModelCard,
                                    ModelList, UnloadLoraAdapterRequest)
from native_server.api.messages_protocol import CountTokensRequest, MessagesRequest
from native_server.api.responses_protocol import ResponsesRequest
from native_server.api.serving_messages import count_tokens, create_message
from native_server.api.serving_responses import create_response, delete_response, get_response
from native_server.api.serving_chat import create_chat_completion
from native_server.api.serving_completions import create_completion
from native_server.api.streaming import ClientDisconnected
from py_engine.adapters import AdapterError, load_lora

logger = logging.getLogger("ruvllm.server")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SHUTDOWN_TIMEOUT = 10.0
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "invalid request: bad JSON, types or values, or a prompt longer than the context"),
        (401, "missing or wrong API key"), (404, "unknown model"), (408, "request body not received in time"),
        (413, "request body too large"), (429, "too many request bodies being received at once"),
        (503, "waiting queue full, or the server is shutting down"))}
_FEEDBACK_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "bad shape: unknown fields, wrong types, a rating not 1 or -1, an empty correction"),
        (401, "missing or wrong API key"), (404, "no logged completion with this id"),
        (409, "this choice was rated already"), (413, "correction too long"),
        (429, "too many feedbacks (server, session) or the learner's queue is full"))}
_STREAM = {"description": "the response, or with `stream: true` server-sent events of chunks",
           "content": {"text/event-stream": {}}}


class DemoFiles(StaticFiles):
    """Static files with the content types browsers insist on for wasm streaming compilation and modules.

    Mounted at "/", it fully matches every path, so an API route asked with the wrong method (GET
    /v1/completions) would reach the files and get their 404; it answers 405 with Allow instead,
    as the app does without the page."""

    TYPES = {".wasm": "application/wasm", ".js": "text/javascript", ".mjs": "text/javascript"}

    def __init__(self, *, api_methods: dict[str, set[str]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_methods = api_methods or {}  # path -> methods of the app's own routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        methods = self.api_methods.get(path)
        if scope["type"] == "http" and methods:
            raise HTTPException(405, headers={"Allow": ", ".join(sorted(methods))})
        if any(part.startswith(".") for part in path.split("/")):  # .git/, .env: never published
            raise HTTPException(404)
        await super().__call__(scope, receive, send)

    def file_response(self, full_path: Any, stat_result: Any, scope: Any, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        media_type = self.TYPES.get(Path(str(full_path)).suffix)
        if media_type is not None:
            response.headers["content-type"] = media_type
        return response


def create_app(ctx: ServerContext, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, allowed_hosts: tuple[str, ...] = ("*",),
               static_dir: Path | None = None, shutdown_timeout: float = SHUTDOWN_TIMEOUT,
               runtime_lora: bool = False) -> FastAPI:
    """The app serving `ctx.engine`; the engine starts with the app and is shut down with it.

    `allowed_hosts` defaults to any here (in-process tests); `ruvllm serve` passes loopback names
    unless told otherwise (serve.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
            await ctx.drain(shutdown_timeout)
        finally:
            await ctx.templates.close()
            await ctx.grammars.close()
            if ctx.learner is not None:
                ctx.learner.close()
            if ctx.witness is not None:
                ctx.witness.close()

    app = FastAPI(title="ruvllm", summary="OpenAI-compatible server of the ruvllm engine", lifespan=lifespan)
    app.state.ctx = ctx
    app.router.route_class = OffLoopJSONRoute  # large bodies parsed in a thread, not on the event loop
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _on_client_gone)
    _add_routes(app, ctx)
    if runtime_lora:  # as vLLM: the routes exist only when asked for (a 404 otherwise)
        _add_lora_routes(app, ctx)
    if static_dir is not None and static_dir.is_dir():
        api_methods = {r.path: set(r.methods) for r in app.routes if isinstance(r, APIRoute) and r.methods}
        app.mount("/", DemoFiles(directory=static_dir, html=True, api_methods=api_methods), name="web")
    # add_middleware wraps: the last added runs first.
    app.add_middleware(RequestBody, max_bytes=max_body_bytes, timeout=body_timeout)
    app.add_middleware(APIKey, api_key=api_key)
    app.add_middleware(AllowedHosts, hosts=allowed_hosts)
    app.add_middleware(IsolationHeaders)
    return app


def _add_lora_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS, tags=["lora"])
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        ctx.check_accepting()
        if body.lora_name in ctx.accepted_names:
            raise APIError(400, f"lora_name {body.lora_name!r} is the served model's name", "lora_name")
        try:  # reading the files happens here, off the engine's thread; placing them, on it
            path = confined_path(ctx.lora_dir, body.lora_path)
            adapter = await asyncio.to_thread(load_lora, path, ctx.max_lora_rank, ctx.lora_dir)
            await ctx.engine.load_lora(body.lora_name, adapter)
        except AdapterError as exc:
            raise APIError(400, str(exc).replace(str(ctx.lora_dir.resolve()), "<lora-dir>"), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS, tags=["lora"])
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        try:
            await ctx.engine.unload_lora(body.lora_name)
        except EngineError as exc:
            raise engine_error(exc) or exc from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    # Nobody reads this; 499 (nginx's "client closed request") keeps access logs honest.
    return Response(status_code=499)


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Int  # 0: the base model, no consolidated adapter


def _learner(ctx: ServerContext) -> Any:
    if ctx.learner is None:
        raise APIError(404, "this server does not learn (start it with --learning --witness-log DIR)",
                       code="not_found")
    return ctx.learner


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: _STREAM}, tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, 200: _STREAM}, tags=["openai"])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/responses", responses={**_ERRORS, 200: _STREAM}, tags=["openai"])
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(ctx, body, request)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS, tags=["openai"])
    async def response_get(response_id: str) -> Response:
        return get_response(ctx, response_id)

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS, tags=["openai"])
    async def response_delete(response_id: str) -> Response:
        return delete_response(ctx, response_id)

    @app.post("/v1/messages", responses={**_ERRORS, 200: _STREAM}, tags=["anthropic"])
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(ctx, body, request)

    @app.post("/v1/messages/count_tokens", responses=_ERRORS, tags=["anthropic"])
    async def messages_count_tokens(body: CountTokensRequest) -> Response:
        return await count_tokens(ctx, body)

    @app.post("/v1/feedback", response_model=FeedbackResponse, responses=_FEEDBACK_ERRORS, tags=["learning"])
    async def feedback(body: FeedbackRequest) -> FeedbackResponse:
        ctx.check_accepting()
        if ctx.feedback is None:
            raise APIError(404, "this server keeps no witness log, so it takes no feedback (start it with "
                                "--witness-log DIR)", "id", "not_found")
        return ctx.feedback.accept(body)

    @app.delete("/v1/feedback/{feedback_id}", tags=["learning"],
                responses={400: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                           404: {"model": ErrorResponse}})
    async def feedback_delete(feedback_id: str, user: str | None = None) -> Response:
        """Forget a feedback (`?user=` the session it was given in): its pattern leaves the bank (no request
        finds it again), its adapter the engine, and the log marks it deleted (no consolidation trains on it)."""
        if ctx.feedback is None:
            raise APIError(404, "this server keeps no witness log, so it holds no feedback", "id", "not_found")
        await asyncio.to_thread(ctx.feedback.forget, feedback_id[:1024], user, ctx.learner)
        return JSONResponse({"id": feedback_id, "object": "feedback.deleted", "deleted": True})

    @app.get("/v1/learning", tags=["learning"], responses={404: {"model": ErrorResponse}})
    async def learning() -> Response:
        return JSONResponse(_learner(ctx).status())

    @app.post("/v1/learning/consolidate", tags=["learning"], status_code=202,
              responses={404: {"model": ErrorResponse}})
    async def consolidate() -> Response:
        learner = _learner(ctx)
        learner.consolidate_soon()
        return JSONResponse(learner.status(), status_code=202)

    @app.post("/v1/learning/rollback", tags=["learning"], responses={400: {"model": ErrorResponse}})
    async def rollback(body: RollbackRequest) -> Response:
        learner = _learner(ctx)
        if not 0 <= body.version < 1 << 31:
            raise APIError(400, f"version: an integer >= 0 (0: the base model), got {body.version}", "version")
        try:
            await asyncio.to_thread(learner.rollback, body.version)
        except ValueError as exc:
            raise APIError(400, f"version: {exc}", "version") from None
        return JSONResponse(learner.status())

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def models() -> ModelList:
        card = ModelCard(id=ctx.model_name, created=ctx.created, root=ctx.model_name,
                         max_model_len=ctx.max_model_len)
        adapters = [ModelCard(id=name, created=ctx.created, root=name, parent=ctx.model_name,
                              max_model_len=ctx.max_model_len)
                    for name in ctx.public_lora_names()]
        return ModelList(data=[card, *adapters])

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if ctx.draining:
            return error_response(503, SHUTTING_DOWN)
        dead = getattr(ctx.engine, "dead_reason", lambda: None)()
        if dead is not None:  # a load balancer should stop sending here: every request would fail
            return error_response(503, dead, code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        text = ctx.metrics.render(ctx.engine.stats()) + learning_metrics(ctx.witness, ctx.learner)
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)
