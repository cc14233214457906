"""POST /v1/completions: the legacy text completion API, prompts as text, token ids, or a batch.

A batch of P prompts with n samples each answers P * n choices, choice
`p * n + j` being sample j of prompt p (OpenAI's order). `echo` puts the
prompt's text before the completion (in the first chunk when streaming); it
cannot be combined with `logprobs`, which would need the prompt's logprobs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from native_server.api.context import ServerContext
from native_server.api.errors import APIError
from native_server.api.generation import Delta, Generation, Job
from native_server.api.guided import client_of, prepare
from native_server.api.logprobs import completion_logprobs
from native_server.api.prompts import (check_best_of, check_choices, completion_prompts, fit_to_context,
                                   sampling_params)
from native_server.api.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from native_server.api.serving import event_stream, run_to_end, usage_of
from native_server.api.streaming import event
from native_server.api.context import LEARNED_PREFIX
from native_server.learning.gated import completion_question, gated_route, log_adapter
from native_server.learning.witness_record import session_of, start_trace


DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for legacy completions, `null` included


def _jobs(ctx: ServerContext, request: CompletionRequest, prompts: list[list[int]], request_id: str,
          adapter: str | None = None) -> list[Job]:
    params = sampling_params(request, ctx.vocab_size)
    check_choices(params.n, len(prompts))
    check_best_of(request, params.n)
    if request.echo and params.logprobs is not None:
        raise APIError(400, "echo: cannot be combined with logprobs (prompt logprobs are not computed)", "echo")
    explicit = "max_tokens" in request.model_fields_set and request.max_tokens is not None
    if not explicit:  # omitted or null: OpenAI's default of 16 (then clamped to the room left)
        params = dataclasses.replace(params, max_tokens=DEFAULT_MAX_TOKENS)
    jobs = []
    for p, ids in enumerate(prompts):
        fitted = fit_to_context(params, len(ids), ctx.max_model_len, explicit_max_tokens=explicit,
                                prompt_param="prompt")
        jobs.append(Job(f"{request_id}-{p}", ids, fitted, p * params.n, adapter))
    return jobs


async def create_completion(ctx: ServerContext, request: CompletionRequest, raw: Request) -> Response:
    ctx.check_accepting()
    adapter = ctx.adapter_for(request.model)
    prompts = await asyncio.to_thread(completion_prompts, request, ctx.tokenizer, ctx.vocab_size)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    learned = None if adapter else (await gated_route(ctx, session_of(request),
                                                      lambda: completion_question(ctx, request.prompt)))[0]
    jobs = _jobs(ctx, request, prompts, request_id, adapter or learned)
    await prepare(ctx, jobs[0].params, client_of(request, raw))  # a grammar: cached, or in a worker process
    n = jobs[0].params.n
    texts = [_prompt_text(ctx, request, p, ids) for p, ids in enumerate(prompts)] if ctx.witness or request.echo \
        else [""] * len(prompts)
    trace = start_trace(ctx, request_id, "completions", request,
                        [{"text": t, "token_ids": ids} for t, ids in zip(texts, prompts)], jobs[0].params)
    log_adapter(ctx, trace, learned)
    generation = Generation(ctx.engine, jobs, ctx.metrics, trace=trace)
    echoes = [t if request.echo else "" for t in texts]
    echo_of = [echoes[c // n] for c in range(generation.num_choices)]  # the prompt text of each choice
    want_logprobs = jobs[0].params.logprobs is not None
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return await _stream(ctx, generation, raw, request_id, echo_of, want_logprobs, include_usage)
    results = await run_to_end(raw, generation)
    choices = [CompletionChoice(index=i, text=echo_of[i] + r.text, finish_reason=r.finish_reason,
                                logprobs=completion_logprobs(r.logprobs, ctx.texts, 0) if want_logprobs else None)
               for i, r in enumerate(results)]
    body = CompletionResponse(id=request_id, created=int(time.time()), model=adapter or ctx.model_name,
                              choices=choices,
                              usage=usage_of(generation))
    return JSONResponse(body.model_dump(mode="json"))


def _prompt_text(ctx: ServerContext, request: CompletionRequest, index: int, ids: list[int]) -> str:
    prompt: Any = request.prompt
    if isinstance(prompt, str):
        return prompt
    item = prompt[index] if prompt and not isinstance(prompt[0], int) else prompt
    return item if isinstance(item, str) else ctx.tokenizer.decode(ids, skip_special_tokens=False)


async def _stream(ctx: ServerContext, generation: Generation, raw: Request, request_id: str, echo_of: list[str],
                  want_logprobs: bool, include_usage: bool) -> Response:
    created = int(time.time())
    lora = generation.jobs[0].lora
    model = lora if lora and not lora.startswith(LEARNED_PREFIX) else ctx.model_name  # a learned one is no model
    offsets = [0] * generation.num_choices  # text offset of each choice's next token, for legacy logprobs

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return event(CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                        usage=usage))

    def delta_chunk(delta: Delta) -> str:
        logprobs = None
        if want_logprobs:
            logprobs = completion_logprobs(delta.logprobs or [], ctx.texts, offsets[delta.choice])
            offsets[delta.choice] += sum(len(t) for t in logprobs.tokens)
        return chunk([CompletionChoice(index=delta.choice, text=delta.text, logprobs=logprobs,
                                       finish_reason=delta.finish_reason)])

    head = [chunk([CompletionChoice(index=i, text=text, finish_reason=None)])
            for i, text in enumerate(echo_of) if text]
    return await event_stream(raw, generation, head, delta_chunk,
                              (lambda u: chunk([], u)) if include_usage else None)
