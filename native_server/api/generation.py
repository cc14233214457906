"""Running one API request on the engine: its jobs, their outputs as deltas, usage and metrics.

An API request becomes one engine request (a *job*) per prompt; a job's n
samples fill choices `first_choice .. first_choice + n - 1`, OpenAI's
numbering for a batch of prompts. `Generation.deltas()` merges the jobs'
outputs in arrival order and, whatever way it ends (done, client gone, server
shutting down), leaves no engine request behind: a job that did not finish is
closed and aborted inside a shielded scope, since Starlette cancels a stream's
task with an anyio scope that would otherwise cancel the cleanup too.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio

from native_server.api.errors import APIError
from native_server.api.metrics import ServerMetrics
from native_server.engine.outputs import EngineError
from native_server.learning.witness_record import Trace
from py_engine.sampling import SampleOutput
from py_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Job:
    """One engine request: a prompt and the choice index its first sample fills."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_choice: int
    lora: str | None = None  # the LoRA adapter the request's `model` named (None: the base model)


@dataclass(frozen=True)
class Delta:
    """New output of one choice since its previous delta."""

    choice: int
    text: str
    token_ids: list[int]
    logprobs: list[SampleOutput] | None
    finish_reason: str | None


@dataclass
class UsageCount:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Generation:
    """The jobs of one API request; iterate `deltas()` once."""

    engine: Any  # native_server.engine.async_engine.AsyncEngine
    jobs: list[Job]
    metrics: ServerMetrics
    usage: UsageCount = field(default_factory=UsageCount)
    arrival: float = field(default_factory=time.monotonic)
    trace: Trace | None = None  # the witness line this request fills (witness_record.py), when logging

    @property
    def num_choices(self) -> int:
        return sum(job.params.n for job in self.jobs)

    async def deltas(self) -> AsyncIterator[Delta]:
        for job in self.jobs:
            self.usage.prompt_tokens += len(job.prompt_ids)
        # aclosing: `async for` alone leaves the inner generator suspended (its
        # engine request alive) when this one is closed early.
        inner = self._run(self.jobs[0]) if len(self.jobs) == 1 else self._merged()
        status = "aborted"
        try:
            async with aclosing(inner):
                async for delta in inner:
                    if self.trace is not None:
                        self.trace.add(delta.choice, delta.text, delta.token_ids, delta.finish_reason)
                    yield delta
            status = "ok"
        except Exception:
            status = "error"
            raise
        finally:
            if self.trace is not None:
                self.trace.finish(status)

    async def _merged(self) -> AsyncIterator[Delta]:
        """Several jobs at once: one task each feeding a queue; None marks a job's end."""
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async with aclosing(self._run(job)) as run:
                    async for delta in run:
                        queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as exc:  # handed to the consumer, who raises it
                queue.put_nowait(exc)

        tasks = [asyncio.ensure_future(pump(job)) for job in self.jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, job: Job) -> AsyncIterator[Delta]:
        extra = {"lora": job.lora} if job.lora is not None else {}
        outputs = self.engine.generate(job.request_id, job.prompt_ids, job.params, **extra)
        finished = False
        running = set(range(job.params.n))  # samples without a finish_reason yet
        try:
            out = await _first(outputs)
            while out is not None:
                deltas = []
                for o in out.outputs:
                    self.usage.completion_tokens += len(o.token_ids)
                    if o.finish_reason is not None:
                        running.discard(o.index)
                        self.metrics.record_finish(o.finish_reason, time.monotonic() - self.arrival)
                    if o.text or o.token_ids or o.finish_reason is not None:
                        deltas.append(Delta(job.first_choice + o.index, o.text, list(o.token_ids), o.logprobs,
                                            o.finish_reason))
                if out.finished:  # before yielding: the consumer may stop at the last delta
                    self.usage.cached_tokens += out.num_cached_tokens
                    finished = True
                for delta in deltas:
                    yield delta
                out = await anext(outputs, None)
        finally:
            if not finished:  # the client left (or an error): the engine's "abort" output reaches nobody
                for _ in running:
                    self.metrics.record_finish("abort", time.monotonic() - self.arrival)
                with anyio.CancelScope(shield=True):
                    await outputs.aclose()
                    await self.engine.abort(job.request_id)


async def _first(outputs: AsyncIterator[Any]) -> Any:
    """The first output; a ValueError before it is the engine refusing the request (its contract): a 400."""
    try:
        return await anext(outputs, None)
    except EngineError:
        raise
    except ValueError as exc:
        raise APIError(400, f"invalid request: {exc}") from None


@dataclass
class ChoiceResult:
    """One choice gathered from its deltas, for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleOutput] = field(default_factory=list)
    finish_reason: str | None = None


async def collect(generation: Generation) -> list[ChoiceResult]:
    """Run a generation to the end and gather its choices in index order."""
    results = [ChoiceResult() for _ in range(generation.num_choices)]
    parts: list[list[str]] = [[] for _ in results]
    async with aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            result = results[delta.choice]
            parts[delta.choice].append(delta.text)
            result.token_ids += delta.token_ids
            if delta.logprobs:
                result.logprobs += delta.logprobs
            result.finish_reason = delta.finish_reason or result.finish_reason
    for result, texts in zip(results, parts):
        result.text = "".join(texts)
    return results
