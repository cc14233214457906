"""Structured outputs and tool calls on the server: plan the tools, compile the grammar off the server.

`tool_plan` / `with_tools` apply py_engine.guided.tools' rules (vLLM's: `required` and a named
function constrain the output to the calls' JSON; `auto` parses the template family's syntax)
and turn a bad tool into a 400. `prepare` has the context's GrammarCompiler (grammars.py) compile
whatever grammar the request carries: cached grammars at once, new ones in worker processes,
bounded in tree nodes, states and seconds, a few at a time and fairly between clients (the
request's `user`, else its address). A bad, unsupported or too large schema, regex or tool is a
400 naming the field the client sent; a client with too many grammars waiting gets a 429.
"""
from __future__ import annotations

from typing import Any

from native_server.api.errors import APIError
from native_server.api.grammars import GrammarQueueFull
from py_engine.guided import GuidedError
from py_engine.guided.tools import ToolPlan, apply_plan, plan_tools
from py_engine.sampling_params import SamplingParams


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


def client_of(request: Any, raw: Any) -> str:
    """Who a request comes from, for the compile queue's fairness: its `user`, else its peer address."""
    user = getattr(request, "user", None)
    if user:
        return f"user:{user[:256]}"
    peer = getattr(raw, "client", None)
    return f"peer:{peer.host if peer is not None else '?'}"


async def prepare(ctx: Any, params: SamplingParams, client: str) -> None:
    """Compile the request's grammar (if any) for the engine; a 400 (429) when it cannot be (yet)."""
    spec = params.structured_outputs
    if spec is None:
        return
    # The same EOS ids the engine's guide_for will ask for, so it finds the grammar on spec.compiled.
    eos = () if params.ignore_eos else tuple(getattr(ctx.engine, "eos_token_ids", ()))
    try:
        await ctx.grammars.compile(spec, ctx.tokenizer, eos, client)
    except GrammarQueueFull as exc:
        raise APIError(429, str(exc), code="rate_limited") from None
    except GuidedError as exc:
        param = spec.origin or exc.param or "structured_outputs"
        raise APIError(400, str(exc), param.split(".")[0]) from None
