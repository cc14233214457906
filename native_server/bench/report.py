"""Benchmark rows as an aligned text table, JSON or CSV. Stdlib only.

A row is a flat dict (nested dicts are flattened with `_`, so a run's
`ttft_ms.p50` becomes `ttft_ms_p50`); every format sees the same rows. The
table shows the columns that matter at a glance; JSON and CSV keep them all.
"""
from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Iterable, Mapping, Sequence

FORMATS = ("table", "json", "csv")

# (row key, header) of the table; a column is shown only if some row has its key.
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("concurrency", "conc"), ("num_requests", "reqs"), ("num_errors", "errs"),
    ("prompt_len", "prompt"), ("gen_len", "gen"),
    ("prefill_ms", "prefill ms"), ("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"),
    ("output_throughput", "out tok/s"), ("speedup", "x 1-stream"),
    ("ttft_ms_p50", "TTFT p50"), ("ttft_ms_p90", "TTFT p90"), ("ttft_ms_p99", "TTFT p99"),
    ("itl_ms_p50", "ITL p50"), ("itl_ms_p90", "ITL p90"), ("itl_ms_p99", "ITL p99"),
    ("tpot_ms_mean", "TPOT ms"), ("kv_utilization", "KV util"), ("peak_rss_mib", "peak RSS MiB"),
)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a_b": 1}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "_"))
        else:
            out[name] = value
    return out


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Iterable[tuple[str, str]] = TABLE_COLUMNS) -> str:
    """Right-aligned columns (latencies in ms), one line per row; '-' for a missing or NaN value."""
    shown = [(key, header) for key, header in columns if any(key in row for row in rows)]
    cells = [[header for _, header in shown]] + [[_cell(row.get(key)) for key, _ in shown] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(shown))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue().rstrip("\n")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None  # JSON has no NaN
    return value


def render(rows: Sequence[Mapping[str, Any]], fmt: str, meta: Mapping[str, Any] | None = None) -> str:
    """The rows in `fmt` (table, json or csv); json wraps them as {"meta": ..., "runs": [...]}."""
    if fmt == "table":
        return format_table(rows)
    if fmt == "csv":
        return format_csv(rows)
    if fmt == "json":
        runs = [{k: _json_safe(v) for k, v in row.items()} for row in rows]
        return json.dumps({"meta": dict(meta or {}), "runs": runs}, indent=2)
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
