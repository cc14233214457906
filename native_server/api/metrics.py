"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Most numbers are the engine's, read from `AsyncEngine.stats()` when /metrics
is scraped: requests running and waiting, KV blocks used / cached / free,
prefix-cache hits and queries, prompt and generation tokens, preemptions,
and the time-to-first-token and inter-token latency histograms (measured in
the engine, where tokens are made). The API layer adds what only it sees:
requests by finish reason and their end-to-end latency as the client saw it.

Why not prometheus_client: its registry is process-global (a second app in
one process, as tests make, registers every metric twice) and the format is
twenty lines. Names use the `ruvllm_` prefix and underscores, not vLLM's
`vllm:` colons, which Prometheus reserves for recording rules.

`--metrics-compat vllm` adds, beside them, the same numbers under the names vLLM's Grafana
dashboard and autoscalers read (VLLM_ALIASES, with vLLM's `model_name` label), so an existing
dashboard works unchanged; nothing is computed twice, the aliases repeat the samples.
"""
from __future__ import annotations

import math
from typing import Any

from native_server.engine.outputs import Histogram

PREFIX = "ruvllm_"
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


def histogram_lines(name: str, hist: Any) -> list[str]:
    """Cumulative `_bucket{le=...}` lines, then `_sum` and `_count`, of an engine.outputs.Histogram."""
    out, running = [], 0
    for bound, n in zip((*hist.buckets, math.inf), hist.counts):
        running += n
        out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
    return out + [f"{name}_sum {_number(hist.sum)}", f"{name}_count {hist.count}"]


# vLLM's name -> ours (without the prefix); counters carry _total as vLLM's exposition does.
VLLM_ALIASES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_perc",  # its name before v1, still on older dashboards
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:num_preemptions_total": "num_preemptions_total",
    "vllm:request_success_total": "request_success_total",
    "vllm:time_to_first_token_seconds": "time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds": "inter_token_latency_seconds",  # v0's name of the same histogram
    "vllm:e2e_request_latency_seconds": "e2e_request_latency_seconds",
}
COMPAT_SETS = ("none", "vllm")


class ServerMetrics:
    """What the API layer measures; `render(stats)` adds the engine's numbers and writes the text."""

    def __init__(self, compat: str = "none", model_name: str = "") -> None:
        if compat not in COMPAT_SETS:
            raise ValueError(f"metrics compat must be one of {', '.join(COMPAT_SETS)}, got {compat!r}")
        self.finished: dict[str, int] = {}  # finish_reason -> choices that ended so
        self.e2e = Histogram(E2E_BUCKETS)  # engine.outputs' layout, other buckets
        self.compat, self.model_name = compat, model_name

    def record_finish(self, reason: str, seconds: float) -> None:
        """A choice ended, `seconds` after its request reached the API."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(seconds)

    def render(self, stats: Any) -> str:
        """The exposition text; `stats` is the engine's EngineStats."""
        lines: list[str] = []

        def header(name: str, kind: str, help_text: str) -> str:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            return name

        for name, kind, help_text, value in engine_samples(stats):
            lines.append(f"{header(PREFIX + name, kind, help_text)} {_number(value)}")
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:  # vLLM's spec_decode counters
            for name, help_text, value in (
                    ("spec_decode_num_drafts_total", "Verify steps that carried speculative drafts.", spec.num_drafts),
                    ("spec_decode_num_draft_tokens_total", "Draft tokens proposed.", spec.num_draft_tokens),
                    ("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", spec.num_accepted_tokens)):
                lines.append(f"{header(PREFIX + name, 'counter', help_text)} {value}")
            name = header(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total", "counter",
                          "Draft tokens accepted at each position of a step's drafts (0: the first).")
            lines.extend(f'{name}{_labels({"position": str(i)})} {n}' for i, n in enumerate(spec.accepted_per_position))
        name = header(PREFIX + "request_success_total", "counter", "Finished choices by finish reason.")
        lines.extend(f'{name}{_labels({"finished_reason": r})} {n}' for r, n in sorted(self.finished.items()))
        for name, help_text, hist in (
                ("time_to_first_token_seconds", "Seconds from a request's arrival in the engine to its first "
                                                "token.", stats.ttft),
                ("inter_token_latency_seconds", "Seconds between consecutive tokens of one sample.",
                 stats.inter_token_latency),
                ("e2e_request_latency_seconds", "Seconds from a request's arrival at the API to the end of "
                                                "a choice.", self.e2e)):
            lines.extend(histogram_lines(header(PREFIX + name, "histogram", help_text), hist))
        if self.compat == "vllm":
            lines.extend(vllm_aliases(lines, self.model_name))
        return "\n".join(lines) + "\n"


def vllm_aliases(lines: list[str], model_name: str) -> list[str]:
    """The samples of `lines` again under vLLM's names, each with vLLM's model_name label."""
    label = f'model_name="{model_name}"'
    ours: dict[str, list[str]] = {}  # our metric name -> its lines (HELP, TYPE, samples)
    for line in lines:
        name = line.split(" ", 3)[2] if line.startswith("#") else line.split("{", 1)[0].split(" ", 1)[0]
        for suffix in ("_bucket", "_sum", "_count"):
            if not line.startswith("#") and name.endswith(suffix) and name[:-len(suffix)] in ours:
                name = name[:-len(suffix)]
        ours.setdefault(name, []).append(line)
    out = []
    for alias, target in VLLM_ALIASES.items():
        for line in ours.get(PREFIX + target, []):
            line = line.replace(PREFIX + target, alias, 1)
            if not line.startswith("#"):
                head, _, value = line.rpartition(" ")
                head = head[:-1] + "," + label + "}" if head.endswith("}") else head + "{" + label + "}"
                line = f"{head} {value}"
            out.append(line)
    return out


# (metric name, type, help, EngineStats attribute)
_ENGINE_FIELDS = (
    ("num_requests_running", "gauge", "Sequences in the running batch (a request with n samples counts n).",
     "num_running"),
    ("num_requests_waiting", "gauge", "Sequences waiting to be scheduled, preempted ones included.", "num_waiting"),
    ("kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("kv_cache_blocks_used", "gauge", "KV cache blocks held by live sequences.", "kv_blocks_used"),
    ("kv_cache_blocks_cached", "gauge", "Free KV blocks still holding a reusable prefix.", "kv_blocks_cached"),
    ("kv_cache_blocks_free", "gauge", "KV cache blocks that can be handed out (cached ones included).",
     "kv_blocks_free"),
    ("kv_cache_cold_blocks_total", "gauge", "Quantized (int8/int4) KV blocks in the cold pool; 0 without one.",
     "kv_cold_blocks_total"),
    ("kv_cache_cold_blocks_used", "gauge", "Cold KV blocks held by live sequences.", "kv_cold_blocks_used"),
    ("kv_cache_hot_bytes_per_token", "gauge", "Bytes of one token's keys and values (all layers) in a hot block.",
     "kv_hot_bytes_per_token"),
    ("kv_cache_cold_bytes_per_token", "gauge", "Bytes of one token's keys and values (all layers) in a cold block, "
                                               "scales and zero points included.", "kv_cold_bytes_per_token"),
    ("kv_cache_capacity_tokens", "gauge", "Token slots of the KV cache, hot and cold pools together.",
     "kv_capacity_tokens"),
    ("kv_cache_demoted_blocks_total", "counter", "KV blocks quantized into the cold pool as they left the hot "
                                                 "window.", "kv_demoted_blocks"),
    ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("prompt_tokens_total", "counter", "Prompt tokens of the requests the engine took.", "prompt_tokens"),
    ("generation_tokens_total", "counter", "Tokens sampled.", "generation_tokens"),
    ("num_preemptions_total", "counter", "Sequences preempted (their KV freed, to be recomputed).",
     "num_preemptions"),
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
