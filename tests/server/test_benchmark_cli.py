"""`ruvllm benchmark`: its statistics and formats exactly, then short end-to-end runs on a tiny model.

Speed is measured by benchmarks, never asserted here: the end-to-end runs
check the report's shape and its token counts (fixed by ignore_eos), not
how fast anything was.
"""
from __future__ import annotations

import csv
import io
import json
import math

import pytest

from native_server.bench.offline import KVOccupancy, kv_occupancy, occupancy_at_peak
from native_server.bench.report import flatten, format_csv, format_table, render
from native_server.bench.stats import RequestTiming, Summary, percentile, summarize
from native_server.bench.workload import RESERVED_LOW_IDS, Workload, random_prompts
from native_server.engine.block_manager import BlockManager
from native_server.engine.scheduler import Scheduler
from native_server.engine.sequence import Sequence
from py_engine.sampling_params import SamplingParams
from ruvllm_cli.main import main
from tests.server.server_harness import no_traceback, running_server


# --- statistics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)])
def test_percentile_interpolates_between_ranks_as_numpy(q, expected):
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_edges():
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [((i * 7919) % 101) / 7 for i in range(37)]
    for q in (0, 1, 33.3, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_request_timing_ttft_itl_tpot():
    t = RequestTiming(start=10.0, prompt_tokens=5)
    for now in (10.5, 10.6, 10.8, 11.1):
        t.chunk(now)
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.1, 0.2, 0.3])
    assert t.tpot == pytest.approx(0.6 / 3)
    assert t.end == 11.1
    assert RequestTiming(0.0, 1).ttft is None and RequestTiming(0.0, 1).tpot is None


def test_summarize_counts_throughput_and_skips_failures():
    a, b, failed = RequestTiming(0.0, 10), RequestTiming(1.0, 10), RequestTiming(0.5, 10, error="HTTP 503")
    for now in (1.0, 2.0):
        a.chunk(now)
    for now in (2.0, 3.0, 4.0):
        b.chunk(now)
    run = summarize([a, b, failed], concurrency=2)
    assert (run.num_requests, run.num_errors, run.prompt_tokens, run.output_tokens) == (3, 1, 20, 5)
    assert run.duration_s == 4.0 and run.output_throughput == 1.25
    assert run.ttft_ms == Summary(2, 1000.0, 1000.0, 1000.0, 1000.0)
    assert run.itl_ms.count == 3 and run.itl_ms.p50 == pytest.approx(1000.0)
    assert summarize([a], 1, duration_s=0.5).output_throughput == 4.0


# --- formats ----------------------------------------------------------------------------------------
ROWS = [{"concurrency": 1, "output_throughput": 12.345, "ttft_ms_p50": float("nan")},
        {"concurrency": 16, "output_throughput": 123.456, "ttft_ms_p50": 5.0, "extra": "x"}]


def test_flatten_joins_nested_keys():
    assert flatten({"a": 1, "ttft_ms": {"p50": 2, "p99": 3}}) == {"a": 1, "ttft_ms_p50": 2, "ttft_ms_p99": 3}


def test_table_aligns_known_columns_and_dashes_missing_values():
    lines = format_table(ROWS).splitlines()
    assert lines[0].split() == ["conc", "out", "tok/s", "TTFT", "p50"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["1", "12.3", "-"]
    assert lines[3].split() == ["16", "123.5", "5.000"]
    assert len({len(line) for line in lines}) == 1  # right-aligned: every line as wide


def test_csv_has_every_key_of_every_row():
    rows = list(csv.DictReader(io.StringIO(format_csv(ROWS))))
    assert list(rows[0]) == ["concurrency", "output_throughput", "ttft_ms_p50", "extra"]
    assert rows[1]["extra"] == "x" and rows[0]["extra"] == ""


def test_json_wraps_rows_with_meta_and_has_no_nan():
    data = json.loads(render(ROWS, "json", {"mode": "offline"}))
    assert data["meta"] == {"mode": "offline"}
    assert data["runs"][0]["ttft_ms_p50"] is None and data["runs"][1]["extra"] == "x"
    with pytest.raises(ValueError):
        render(ROWS, "xml")


# --- workload and KV occupancy ----------------------------------------------------------------------
def test_random_prompts_are_exact_length_in_range_and_differ_by_label():
    a = random_prompts(3, 20, 50, seed=1, label="c4")
    assert a == random_prompts(3, 20, 50, seed=1, label="c4")
    assert a != random_prompts(3, 20, 50, seed=1, label="c16")
    assert all(len(p) == 20 and all(RESERVED_LOW_IDS <= t < 50 for t in p) for p in a)
    assert len({tuple(p[:4]) for p in a}) == 3  # no shared prefix block for the prefix cache to hit
    with pytest.raises(ValueError):
        Workload(prompt_len=0)


class _FakeEngine:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.block_manager = scheduler, scheduler.block_manager


def test_kv_occupancy_counts_filled_slots_of_held_blocks():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4)
    for seq_id, length in enumerate((5, 8)):  # 5 tokens: 2 blocks, 3 empty slots; 8: 2 full blocks
        scheduler.add(Sequence(seq_id, f"r{seq_id}", 0, list(range(1, length + 1)), params))
    out = scheduler.schedule()
    scheduler.update(out, {})  # prompts computed, nothing sampled
    occ = kv_occupancy(_FakeEngine(scheduler))
    assert occ == KVOccupancy(running=2, tokens_held=13, slots_reserved=16, slots_total=40)
    assert occ.utilization == 13 / 16


def test_occupancy_at_peak_pools_the_steps_with_most_running():
    samples = [KVOccupancy(1, 5, 8, 40), KVOccupancy(2, 9, 16, 40), KVOccupancy(2, 15, 16, 40)]
    assert occupancy_at_peak(samples) == KVOccupancy(2, 24, 32, 80)
    assert occupancy_at_peak([]) is None


def test_capacity_paged_blocks_against_contiguous_slabs(model_dir):
    import torch

    from native_server.bench.capacity import admit_all, kv_capacity
    from native_server.engine.llm_engine import LLMEngine
    from py_engine.config import ModelConfig

    config = ModelConfig.from_file(model_dir)  # 2 layers x (k, v) x 2 kv heads x head_dim 16 x 4 bytes
    budget = 2 * 128 * 512  # two contiguous max-length (128-token) sequences
    cap = kv_capacity(config, torch.float32, 16, 32, budget)
    assert (cap.bytes_per_token, cap.blocks, cap.paged_seqs, cap.contiguous_seqs, cap.ratio) == (512, 16, 8, 2, 4)
    assert kv_capacity(config, torch.float32, 16, 33, budget).paged_seqs == 5  # 3 blocks each
    engine = LLMEngine(str(model_dir), device="cpu", kv_cache_memory=budget, max_num_seqs=10,
                       max_num_batched_tokens=10 * 32)
    assert admit_all(engine, 32, 10, config.vocab_size) == (8, 2)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0


# --- end to end -------------------------------------------------------------------------------------
def test_offline_benchmark_json(model_dir, capsys):
    assert main(["benchmark", str(model_dir), "--device", "cpu", "--prompt-length", "20", "--gen-length", "5",
                 "--concurrency", "1,3", "--iterations", "2", "--warmup", "1", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["meta"]["mode"] == "offline" and data["meta"]["block_size"] == 16
    single, batch = data["runs"]
    assert (single["concurrency"], single["num_requests"], single["output_tokens"]) == (1, 2, 10)
    assert (batch["concurrency"], batch["num_requests"], batch["output_tokens"]) == (3, 6, 30)
    assert batch["prompt_tokens"] == 6 * 20 and batch["num_errors"] == 0
    assert single["prefill_ms"] > 0 and single["decode_tok_s"] > 0 and "prefill_ms" not in batch
    assert batch["kv_peak_running"] == 3 and 0 < batch["kv_utilization"] <= 1
    assert batch["itl_ms_count"] == 6 * 4 and single["peak_rss_mib"] > 0


def test_offline_benchmark_table_and_output_file(model_dir, tmp_path, capsys):
    out = tmp_path / "report.csv"
    assert main(["benchmark", str(model_dir), "--device", "cpu", "--prompt-length", "8", "--gen-length", "3",
                 "--iterations", "1", "--warmup", "0", "--format", "csv", "--output", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["concurrency"] for r in rows] == ["1"] and rows[0]["output_tokens"] == "3"
    assert capsys.readouterr().out.strip() == out.read_text().strip()


def test_benchmark_options_are_validated(capsys):
    for bad in (["--concurrency", "0"], ["--concurrency", "1,x"], ["--iterations", "0"], ["--format", "xml"]):
        with pytest.raises(SystemExit):
            main(["benchmark", "m", *bad])
    capsys.readouterr()


def test_server_benchmark_drives_concurrency_levels(model_dir, tmp_path, capsys):
    with running_server(model_dir, log_dir=tmp_path) as server:
        assert main(["benchmark", str(model_dir), "--url", server.url, "--prompt-length", "12", "--gen-length",
                     "4", "--concurrency", "1,4", "--iterations", "1", "--format", "json"]) == 0
        assert no_traceback(server.log())
    data = json.loads(capsys.readouterr().out)
    assert data["meta"]["mode"] == "server" and data["meta"]["model"] == model_dir.name  # the served name, no path
    assert [(r["concurrency"], r["num_requests"], r["num_errors"], r["output_tokens"]) for r in data["runs"]] \
        == [(1, 1, 0, 4), (4, 4, 0, 16)]
    assert all(r["ttft_ms_count"] == r["num_requests"] and r["itl_ms_count"] == 3 * r["num_requests"]
               for r in data["runs"])


def test_serve_no_prefix_caching_recomputes_a_repeated_prompt(model_dir, tmp_path):
    """The B side of the prefix-caching A/B (with the cache on, the second request would reuse 32 tokens:
    tests/server/test_server_api.py covers that side)."""
    import httpx

    prompt = list(range(10, 10 + 40))  # two full 16-token blocks, then a partial one
    with running_server(model_dir, "--no-prefix-caching", log_dir=tmp_path) as server:
        usages = [httpx.post(f"{server.url}/v1/completions", timeout=60,
                             json={"prompt": prompt, "max_tokens": 2, "temperature": 0}).json()["usage"]
                  for _ in range(2)]
        metrics = server.metrics()
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 0]
    assert metrics.get("ruvllm_prefix_cache_hits_total", 0) == 0
