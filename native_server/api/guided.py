"""Structured outputs and tool calls on the server: plan the tools, compile off the engine thread.

`tool_plan` / `with_tools` apply py_engine.guided.tools' rules (vLLM's: `required` and a named
function constrain the output to the calls' JSON; `auto` parses the template family's syntax)
and turn a bad tool into a 400. `prepare` compiles whatever grammar the request carries in a
worker thread, bounded in states and seconds and at most COMPILE_CONCURRENCY at a time, then
precomputes the token masks of the states nearest the start for up to PRECOMPUTE_SECONDS: the
engine thread then mostly looks masks up (a state past those walks the vocabulary once, in a
few milliseconds). A bad or unsupported schema, regex or tool is a 400 naming the field.
"""
from __future__ import annotations

import asyncio
from typing import Any

from native_server.api.errors import APIError
from py_engine.guided import Budget, GuidedError, token_grammar
from py_engine.guided.tools import ToolPlan, apply_plan, plan_tools
from py_engine.sampling_params import SamplingParams

COMPILE_SECONDS = 10.0
COMPILE_STATES = 50_000
PRECOMPUTE_SECONDS = 2.0
COMPILE_CONCURRENCY = 2
_compiling: asyncio.Semaphore | None = None


def tool_plan(request: Any, chat_config: Any) -> ToolPlan:
    """What the request's tools ask of the output (400 on a bad tool or tool_choice)."""
    try:
        return plan_tools(request.tools, request.tool_choice, chat_config.templates,
                          getattr(request, "parallel_tool_calls", None))
    except GuidedError as exc:
        raise APIError(400, str(exc), exc.param) from None


def with_tools(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    try:
        return apply_plan(params, plan)
    except GuidedError as exc:
        raise APIError(400, str(exc), exc.param) from None


async def prepare(params: SamplingParams, tokenizer: Any, eos_token_ids: Any) -> None:
    """Compile the request's grammar (if any) in a worker thread; a 400 when it cannot be."""
    if params.structured_outputs is None:
        return
    global _compiling
    if _compiling is None:
        _compiling = asyncio.Semaphore(COMPILE_CONCURRENCY)
    async with _compiling:
        try:
            await asyncio.to_thread(_compile, params, tokenizer, tuple(eos_token_ids))
        except GuidedError as exc:
            param = params.structured_outputs.origin or exc.param or "structured_outputs"
            raise APIError(400, str(exc), param.split(".")[0]) from None


def _compile(params: SamplingParams, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
    # The same EOS ids the engine's guide_for will ask for, so it finds this on params.structured_outputs.
    grammar = token_grammar(params.structured_outputs, tokenizer, () if params.ignore_eos else eos_token_ids,
                            Budget(max_states=COMPILE_STATES, seconds=COMPILE_SECONDS))
    grammar.precompute(PRECOMPUTE_SECONDS)
