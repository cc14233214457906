"""POST /v1/chat/completions: render the conversation, run it, answer in OpenAI's chat shape.

Streaming sends, per choice, a first chunk with `role: "assistant"`, then one
chunk per output step with the new text (and logprobs), the last carrying
`finish_reason`; with `stream_options.include_usage` a final chunk with no
choices carries the usage; `data: [DONE]` ends every stream, failed or not.
With tools, text that may be a tool call is held back and the calls go out as
`delta.tool_calls` once complete, with finish_reason "tool_calls" (guided.py).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from native_server.api.context import ServerContext
from native_server.api.errors import APIError
from native_server.api.generation import Delta, Generation, Job
from native_server.api.guided import client_of, prepare, tool_plan, with_tools
from native_server.api.logprobs import chat_logprobs
from native_server.api.prompts import chat_render_args, check_choices, fit_to_context, sampling_params
from native_server.api.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                    ChatCompletionResponse, ChatDelta, ChatResponseMessage, DeltaToolCall, DeltaToolCallPiece, Usage)
from native_server.api.serving import event_stream, run_to_end, usage_of
from native_server.api.streaming import event
from native_server.api.context import LEARNED_PREFIX
from native_server.learning.gated import chat_question, gated_route, log_adapter
from native_server.learning.witness_record import session_of, start_trace
from py_engine.chat import ChatTemplateError
from py_engine.generate import start_ids
from py_engine.guided.tools import ChoiceReader, ToolPlan, split_events


@dataclass
class ChatRun:
    """A chat request rendered, validated and started: what each API shape writes its answer from."""

    generation: Generation
    plan: ToolPlan
    request_id: str
    model: str


async def start_chat(ctx: ServerContext, request: ChatCompletionRequest, raw: Request | None = None,
                     endpoint: str = "chat.completions", id_prefix: str = "chatcmpl-") -> ChatRun:
    """Render the conversation, check the request and start it on the engine (not yet read).
    /v1/responses and /v1/messages convert their requests to this one, so the same conversation
    gives the same tokens on every endpoint. `raw` (the HTTP request) names the client whose
    grammar compiles queue together when the request has no `user`."""
    ctx.check_accepting()
    adapter = ctx.adapter_for(request.model)
    chat_config = ctx.check_chat()
    params = sampling_params(request, ctx.vocab_size)
    check_choices(params.n, 1)
    plan = tool_plan(request, chat_config)
    params = with_tools(params, plan)
    messages, options = chat_render_args(request, chat_config, ctx.allow_client_chat_template)
    learned, context = (None, []) if adapter else await gated_route(ctx, session_of(request),
                                                                     chat_question(request.messages))
    if context:  # the nearest pattern as a previous exchange, before the last user message
        from py_engine.learning.recall import with_context

        messages = with_context(messages, context)
    try:  # in a worker process, bounded in time and size (templates.py)
        text = await ctx.templates.render(messages, chat_config, **options)
    except ChatTemplateError as exc:
        raise APIError(400, f"messages: the chat template could not render them: {exc}", "messages") from None
    # A long conversation takes a while to tokenize in pure Python: keep it off the event loop.
    prompt_ids = await asyncio.to_thread(start_ids, ctx.tokenizer, text, add_special_tokens=False)
    await prepare(ctx, params, client_of(request, raw))  # a grammar: cached, or in a worker process
    explicit = request.max_tokens is not None or request.max_completion_tokens is not None
    params = fit_to_context(params, len(prompt_ids), ctx.max_model_len, explicit_max_tokens=explicit,
                            prompt_param="messages")
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    trace = start_trace(ctx, request_id, endpoint, request, [
        {"messages": [m.model_dump(exclude_none=True) for m in request.messages], "text": text,
         "token_ids": prompt_ids}], params)
    log_adapter(ctx, trace, learned)
    job = Job(request_id, prompt_ids, params, 0, adapter or learned)
    generation = Generation(ctx.engine, [job], ctx.metrics, trace=trace)
    return ChatRun(generation, plan, request_id, adapter or ctx.model_name)


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest, raw: Request) -> Response:
    run = await start_chat(ctx, request, raw)
    generation, plan, request_id, params = run.generation, run.plan, run.request_id, run.generation.jobs[0].params
    want_logprobs = params.logprobs is not None
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return await _stream(ctx, generation, raw, request_id, want_logprobs, include_usage, plan)
    results = await run_to_end(raw, generation)
    choices = []
    for i, r in enumerate(results):
        reader = ChoiceReader(plan)
        content, calls = reader.message(r.text)
        choices.append(ChatChoice(index=i, message=ChatResponseMessage(content=content, tool_calls=calls),
                                  finish_reason=reader.finish_reason(r.finish_reason),
                                  logprobs=chat_logprobs(r.logprobs, ctx.texts) if want_logprobs else None))
    body = ChatCompletionResponse(id=request_id, created=int(time.time()), model=run.model,
                                  choices=choices,
                                  usage=usage_of(generation))
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(ctx: ServerContext, generation: Generation, raw: Request, request_id: str,
                  want_logprobs: bool, include_usage: bool, plan: ToolPlan) -> Response:
    created = int(time.time())
    lora = generation.jobs[0].lora
    model = lora if lora and not lora.startswith(LEARNED_PREFIX) else ctx.model_name  # a learned one is no model
    readers = [ChoiceReader(plan) for _ in range(generation.num_choices)] if plan.active else None

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                         usage=usage))

    def delta_chunk(delta: Delta) -> str:
        logprobs = chat_logprobs(delta.logprobs or [], ctx.texts) if want_logprobs else None
        if readers is None:
            return chunk([ChatChunkChoice(index=delta.choice, delta=ChatDelta(content=delta.text),
                                          logprobs=logprobs, finish_reason=delta.finish_reason)])
        reader = readers[delta.choice]
        events = reader.feed(delta.text) + (reader.finish() if delta.finish_reason else [])
        content, calls = split_events(events)
        if reader.streams_arguments:  # forced calls went out piece by piece: not again whole
            pieces = [DeltaToolCallPiece(**v) for k, v in events if k == "tool_call_delta"]
        else:
            pieces = [DeltaToolCall(index=j, **c) for j, c in enumerate(calls)]
        if not (content or pieces or delta.finish_reason or logprobs):
            return ""  # text held back (it may open a tool call): no event yet
        return chunk([ChatChunkChoice(index=delta.choice, delta=ChatDelta(content=content or None,
                                                                          tool_calls=pieces or None),
                                      logprobs=logprobs, finish_reason=reader.finish_reason(delta.finish_reason))])

    head = [chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(generation.num_choices)]
    return await event_stream(raw, generation, head, delta_chunk,
                              (lambda u: chunk([], u)) if include_usage else None)
