"""Per-request timings and their summaries: TTFT, inter-token latency, percentiles. Stdlib only.

A request's timing is its start and the arrival times of the chunks that
carried its output tokens. From them, as vLLM's benchmark_serving defines them:
  * TTFT: first chunk - start;
  * ITL: the gaps between consecutive chunks (a chunk with k tokens counts
    its gap once, as a client sees it);
  * TPOT: (last chunk - first chunk) / (output tokens - 1), the mean time per
    output token after the first, which does not depend on chunking.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """Mean and percentiles of a list of latencies, in milliseconds (NaN when there were none)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Summary:
        ms = [v * 1000 for v in values]
        mean = sum(ms) / len(ms) if ms else math.nan
        return cls(len(ms), mean, *(percentile(ms, q) for q in PERCENTILES))


@dataclass
class RequestTiming:
    """One request as its client saw it (times from time.perf_counter(), in seconds)."""

    start: float
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output
    output_tokens: int = 0
    error: str | None = None

    def chunk(self, now: float, num_tokens: int = 1) -> None:
        self.chunk_times.append(now)
        self.output_tokens += num_tokens

    @property
    def end(self) -> float:
        return self.chunk_times[-1] if self.chunk_times else self.start

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RunResult:
    """One benchmark run: `concurrency` requests in flight at most, all of them finished."""

    concurrency: int
    num_requests: int
    num_errors: int
    duration_s: float  # first start to last token
    prompt_tokens: int
    output_tokens: int
    ttft_ms: Summary
    itl_ms: Summary
    tpot_ms: Summary

    @property
    def output_throughput(self) -> float:
        """Output tokens per second over the whole run: the aggregate decode rate."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.duration_s if self.duration_s > 0 else math.nan

    def to_dict(self) -> dict:
        return {**asdict(self), "output_throughput": self.output_throughput,
                "request_throughput": self.request_throughput}


def summarize(timings: Sequence[RequestTiming], concurrency: int, duration_s: float | None = None) -> RunResult:
    """Aggregate the requests of one run; the duration is first start to last token unless given
    (waves run one after another add up their own durations, not the gaps between them)."""
    ok = [t for t in timings if t.error is None]
    if duration_s is None:
        start = min((t.start for t in timings), default=0.0)
        duration_s = max((t.end for t in timings), default=start) - start
    return RunResult(
        concurrency=concurrency, num_requests=len(timings), num_errors=len(timings) - len(ok),
        duration_s=duration_s, prompt_tokens=sum(t.prompt_tokens for t in ok),
        output_tokens=sum(t.output_tokens for t in ok),
        ttft_ms=Summary.of_seconds([t.ttft for t in ok if t.ttft is not None]),
        itl_ms=Summary.of_seconds([gap for t in ok for gap in t.itls]),
        tpot_ms=Summary.of_seconds([t.tpot for t in ok if t.tpot is not None]))
