"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Two sources. Gauges of the engine's state (requests running and waiting, KV
blocks used / cached / free) and its prefix-cache counters are read from
`AsyncEngine.stats()` when /metrics is scraped. Per-request latencies and
token counts are measured here, in the API layer, as each output reaches the
client: time to first token then includes queueing and detokenization, which
is what a user waits for.

Why not prometheus_client: its registry is process-global (a second app in
one process, as tests make, registers every metric twice) and the format is
twenty lines. Names use the `ruvllm_` prefix and underscores, not vLLM's
`vllm:` colons, which Prometheus reserves for recording rules.
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Iterable

PREFIX = "ruvllm_"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
               for k, v in labels.items())
    return "{" + ",".join(escaped) + "}"


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms expose them."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is (largest bound, +Inf)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value equal to a bound falls in it
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]


class ServerMetrics:
    """What the API layer measures per request; `render(stats)` adds the engine's state and writes the text."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish_reason -> requests (choices) that ended so
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def record_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens += num_tokens

    def record_tokens(self, num_tokens: int, *, first: bool, seconds: float) -> None:
        """New tokens of one request: `seconds` since arrival (first) or since its previous output."""
        self.generation_tokens += num_tokens
        (self.ttft if first else self.itl).observe(seconds)

    def record_finish(self, reason: str, seconds: float) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(seconds)

    def render(self, stats: Any) -> str:
        """The exposition text; `stats` is the engine's EngineStats (read by attribute name)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
            full = PREFIX + name
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"])
            lines.extend(f"{full}{_labels(labels)} {_number(value)}" for labels, value in samples)

        def histogram(name: str, help_text: str, hist: Histogram) -> None:
            full = PREFIX + name
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} histogram", *hist.lines(full)])

        for name, kind, help_text, value in engine_samples(stats):
            metric(name, kind, help_text, [({}, value)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of requests accepted by the API.",
               [({}, self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated and sent to clients.",
               [({}, self.generation_tokens)])
        metric("request_success_total", "counter", "Finished completions (choices) by finish reason.",
               [({"finished_reason": r}, n) for r, n in sorted(self.finished.items())])
        histogram("time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", self.ttft)
        histogram("inter_token_latency_seconds", "Seconds between consecutive outputs of a request.", self.itl)
        histogram("e2e_request_latency_seconds", "Seconds from a request's arrival to its end.", self.e2e)
        return "\n".join(lines) + "\n"


# (metric name, type, help, EngineStats attribute)
_ENGINE_FIELDS = (
    ("num_requests_running", "gauge", "Requests in the running batch.", "running"),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", "waiting"),
    ("kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("kv_cache_blocks_used", "gauge", "KV cache blocks held by live requests.", "kv_blocks_used"),
    ("kv_cache_blocks_cached", "gauge", "Free KV blocks still holding a reusable prefix.", "kv_blocks_cached"),
    ("kv_cache_blocks_free", "gauge", "KV cache blocks not held by any request.", "kv_blocks_free"),
    ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
    ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", "prefix_hits"),
)


def engine_samples(stats: Any) -> list[tuple[str, str, str, float]]:
    """The engine's gauges and counters, plus the derived usage fraction and prefix-cache hit rate."""
    out = [(name, kind, help_text, float(getattr(stats, attr))) for name, kind, help_text, attr in _ENGINE_FIELDS]
    values = {name: value for name, _, _, value in out}
    total, queries = values["kv_cache_blocks_total"], values["prefix_cache_queries_total"]
    out.append(("kv_cache_usage_perc", "gauge", "Fraction of KV blocks held by live requests (0 to 1).",
                values["kv_cache_blocks_used"] / total if total else 0.0))
    out.append(("prefix_cache_hit_rate", "gauge", "Prefix-cache hits over queries (tokens), since start.",
                values["prefix_cache_hits_total"] / queries if queries else 0.0))
    return out
