"""A load generator for OpenAI-compatible servers: streaming /v1/completions at a fixed concurrency.

Each request sends its prompt as token ids (exact length, no tokenizer on
either side's clock), asks for `max_tokens` greedy tokens with
`ignore_eos` (vLLM's extra field; ruvllm accepts it) and streams them as
server-sent events. The client times the arrival of every event that
carries output. A semaphore keeps `concurrency` requests in flight, the
closed loop of vLLM's `--max-concurrency`. Needs httpx.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Sequence

from native_server.bench.stats import RequestTiming

DEFAULT_TIMEOUT_S = 600.0


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ImportError(f"benchmarking a server needs httpx: pip install httpx ({exc})") from exc
    return httpx


def completion_body(prompt: Sequence[int] | str, gen_len: int, model: str | None,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": list(prompt) if not isinstance(prompt, str) else prompt,
                            "max_tokens": gen_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return {**body, **(extra or {})}


async def stream_one(client: Any, url: str, body: dict[str, Any], timing: RequestTiming) -> None:
    """POST one streaming completion, recording each output event; errors end up in timing.error."""
    usage_tokens = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    timing.error = str(event["error"])[:200]
                    return
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if event.get("choices"):  # a token's event, even when its text is empty (a partial UTF-8
                    timing.chunk(time.perf_counter())  # character); the usage event has no choices
    except Exception as exc:  # a benchmark reports failed requests rather than stopping
        timing.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    if usage_tokens is not None:
        timing.output_tokens = usage_tokens  # one event per token is not a contract; the count is


async def run_level(url: str, prompts: Sequence[Sequence[int] | str], gen_len: int, concurrency: int,
                    model: str | Sequence[str] | None = None, extra: dict[str, Any] | None = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RequestTiming]:
    """Send every prompt, at most `concurrency` in flight; one RequestTiming per prompt, in order.
    model: one name for every request, or a list that prompt i takes entry i % len of (LoRA adapters mixed)."""
    httpx = _import_httpx()
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timings: list[RequestTiming] = []

    models = [model] if model is None or isinstance(model, str) else list(model)

    async def one(client: Any, i: int, prompt: Sequence[int] | str) -> None:
        async with semaphore:
            length = len(prompt) if not isinstance(prompt, str) else 0
            timing = RequestTiming(time.perf_counter(), length)
            timings.append(timing)
            await stream_one(client, url, completion_body(prompt, gen_len, models[i % len(models)], extra), timing)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))
    return timings


def served_model(url: str, timeout_s: float = 30.0) -> str:
    """The id of the first model the server lists at /v1/models."""
    httpx = _import_httpx()
    response = httpx.get(f"{url}/v1/models", timeout=timeout_s)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run_level_sync(url: str, prompts: Sequence[Sequence[int] | str], gen_len: int, concurrency: int,
                   model: str | Sequence[str] | None = None, extra: dict[str, Any] | None = None
                   ) -> list[RequestTiming]:
    return asyncio.run(run_level(url, prompts, gen_len, concurrency, model, extra))
