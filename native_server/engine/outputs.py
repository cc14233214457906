"""What the engine hands back: per-step deltas of each request's samples, its errors and its counters.

`SampleStream` is one sample's text side, the same steps as py_engine's
single-sequence loop (`generate.stream`) so the server emits the same text
and finish reasons: the incremental detokenizer, stop tokens / EOS / length
via `py_engine.stopping.finish_reason`, stop strings via `StopStringMatcher`
(a matched stop string never reaches the client), the sample's own
random stream, and its place in its grammar (`guide`, structured outputs). Stdlib only.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from py_engine.generate import PromptTooLongError as _GeneratePromptTooLong
from py_engine.guided import guide_for
from py_engine.sampling import SampleOutput
from py_engine.sampling_params import SamplingParams
from py_engine.stopping import StopStringMatcher, finish_reason
from py_engine.tokenizer import IncrementalDecoder, Tokenizer


class EngineError(Exception):
    """Base of the errors the engine raises to its callers; status_code is the HTTP status to answer."""

    status_code = 500


class QueueFullError(EngineError):
    """The waiting queue holds max_queue requests: try again later."""

    status_code = 503


class EngineShutdownError(EngineError):
    """The engine is shutting down (or has) and takes no new requests."""

    status_code = 503


class EngineDeadError(EngineError):
    """The engine's loop failed; the message names the original error."""


class RequestFailedError(EngineError):
    """The engine failed this one request after accepting it (a bug, logged with its traceback); the
    engine itself goes on serving the others."""


class AdapterNotFoundError(EngineError):
    """A request names a LoRA adapter that is not loaded (or is being unloaded)."""

    status_code = 404


class PromptTooLongError(EngineError, _GeneratePromptTooLong):
    """The prompt leaves no room to generate within max_model_len."""

    status_code = 400


@dataclass
class CompletionOutput:
    """One of the n samples: what is new since the last output."""

    index: int
    text: str  # new text (a matched stop string is never emitted)
    token_ids: list[int]  # new token ids (a stop token or EOS is included, as in py_engine's Completion)
    finish_reason: str | None  # None | "stop" | "length" | "abort"
    logprobs: list[SampleOutput] | None  # one per new token when the request asked for logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # only the samples with something new
    finished: bool  # every sample has finished
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # set on the last output of a request the engine failed (then outputs is [])


class SampleStream:
    """One sample's random stream, detokenizer, stop matching and not-yet-returned output."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, index: int, eos_token_ids: Sequence[int],
                 room: int) -> None:
        self.params, self.index = params, index
        # Sample i of a seeded request draws from Random(seed + i): it equals an n=1 request with that seed.
        self.rng = random.Random(None if params.seed is None else params.seed + index)
        self._eos, self._room = tuple(eos_token_ids), room
        self.guide = guide_for(params, tokenizer, eos_token_ids)  # compiled already, off the engine thread
        self._detok = IncrementalDecoder(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop)
        self.finish_reason: str | None = None
        self.last_token_time: float | None = None
        self._text: list[str] = []
        self._tokens: list[int] = []
        self._logprobs: list[SampleOutput] = []
        self._reported = False  # whether finish_reason has been returned by take()

    def append(self, sample: SampleOutput, num_output_tokens: int) -> str | None:
        """Record the sample's next token (its num_output_tokens-th); returns a finish reason or None."""
        token = sample.token_id
        self._tokens.append(token)
        if self.params.logprobs is not None:
            self._logprobs.append(sample)
        reason = finish_reason(self.params, token, num_output_tokens, self._eos, self._room)
        text, stop = "", None
        if reason != "stop":  # a stop token's own text is never shown
            text, stop = self._stops.feed(self._detok.push(token))
        if self.guide is not None:
            self.guide.advance(token)
            if self.guide.terminated and reason != "stop":  # the structured output is complete
                reason = "stop"
        if stop is not None:
            reason = "stop"
        elif reason is not None:
            text += self._stops.feed(self._detok.flush()).text + self._stops.flush()
        self._text.append(text)
        self.finish_reason = reason
        return reason

    def abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"

    def take(self) -> CompletionOutput | None:
        """The delta since the last take, or None when there is nothing new."""
        if not self._tokens and (self.finish_reason is None or self._reported):
            return None
        self._reported = self.finish_reason is not None
        out = CompletionOutput(self.index, "".join(self._text), self._tokens, self.finish_reason,
                               self._logprobs if self.params.logprobs is not None else None)
        self._text, self._tokens, self._logprobs = [], [], []
        return out


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class Histogram:
    """Latency samples in seconds: counts[i] holds values <= buckets[i] and > buckets[i - 1];
    the last count is the overflow (> buckets[-1]). Prometheus wants the cumulative sums of counts."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    sum: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def __post_init__(self) -> None:
        self.buckets = tuple(sorted(self.buckets))
        if len(self.counts) != len(self.buckets) + 1:  # other buckets than the default: fresh counts for them
            if any(self.counts):
                raise ValueError("a histogram's counts must be one longer than its buckets")
            self.counts = [0] * (len(self.buckets) + 1)

    def snapshot(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequences (a request with n samples runs as n)
    num_waiting: int  # sequences waiting for admission, preempted ones included
    kv_blocks_total: int
    kv_blocks_used: int  # held by at least one sequence
    kv_blocks_cached: int  # free, but still holding a reusable prefix
    kv_blocks_free: int  # can be handed out now (cached ones included: they are evicted on demand)
    block_size: int
    prefix_cache_hits: int  # prompt tokens found in the prefix cache
    prefix_cache_queries: int  # prompt tokens looked up
    prompt_tokens: int  # of every request added
    generation_tokens: int  # sampled
    num_preemptions: int
    ttft: Histogram  # seconds from add_request to the request's first token
    inter_token_latency: Histogram  # seconds between consecutive tokens of one sample
    # The two-tier (int8/int4) KV cache: kv_blocks_* above are the hot pool's
    kv_cold_blocks_total: int = 0
    kv_cold_blocks_used: int = 0
    kv_hot_bytes_per_token: float = 0.0  # every layer's keys and values of one token
    kv_cold_bytes_per_token: float = 0.0  # codes, scales and zero points
    kv_capacity_tokens: int = 0  # token slots of both pools
    kv_demoted_blocks: int = 0  # blocks quantized into the cold pool, since start
    spec_decode: Any = None  # py_engine.speculative.SpecStats of the steps so far, or None without speculation

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
