"""The two-tier (int8/int4) KV cache in the server: block manager, engine, and `ruvllm serve` over HTTP.

- block manager: demotion hands out cold ids and lets the hot ones go, the prefix-cache entry moves
  with the block, a cold prefix hit is cut where the new sequence's first query would read it hot,
  forks share one cold copy, freeing returns both pools (exact ids, brute-force accounting);
- engine: greedy tokens equal the dense engine's (`LLM` with the same KV settings) through chunked
  prefill, shared prefixes and preemption;
- HTTP: 32 concurrent greedy streams with int4 KV equal the dense engine; client disconnects free hot
  and cold blocks alike; /metrics reports both pools, bytes per token and capacity; bad flags are
  start-up errors.
"""
from __future__ import annotations

import httpx
import pytest

from native_server.engine.block_manager import BlockManager, extend_block_hashes
from tests.server.server_harness import Server, greedy_completions, metric, no_traceback, running_server, wait_until
from tests.tiny_models import TEXT

WORDS = TEXT.split()
PROMPTS = [" ".join(WORDS[(7 * i) % 40:(7 * i) % 40 + 2 + i % 16]) for i in range(32)]
HOT = ("--kv-cache-dtype", "int4", "--kv-hot-tokens", "16")


def check_accounting(bm: BlockManager) -> None:
    for blocks, queue in ((bm.blocks, bm.free_queue), (bm.cold_blocks, bm.cold_free_queue)):
        used = sum(b.ref_cnt > 0 for b in blocks)
        assert len(blocks) - used == len(queue.block_ids()) == len(queue)
    every = bm.blocks + bm.cold_blocks
    assert bm.num_cached_blocks == sum(b.ref_cnt == 0 and b.block_hash is not None for b in every)
    assert all(bm.cached[b.block_hash] is b for b in every if b.block_hash is not None)
    assert len(bm.cached) == sum(b.block_hash is not None for b in every)


def test_demotion_moves_blocks_and_their_prefix_entries_to_the_cold_pool():
    bm = BlockManager(8, block_size=4, num_cold_blocks=4, hot_tokens=4)
    tokens = list(range(100, 114))
    assert bm.allocate("a", 0, 13) == [] and bm.block_table("a") == [0, 1, 2, 3]
    bm.cache_blocks("a", extend_block_hashes([], tokens, 4), 13)  # blocks 0-2 full and computed
    assert bm.take_demotions() == []
    # a query at 13 reads (13 + 1 - 4) // 4 = 2 blocks cold: blocks 0, 1 go to cold 0, 1
    assert bm.allocate("a", 13, 1) == []
    assert bm.take_demotions() == [(0, 0), (1, 1)] and bm.take_demotions() == []
    assert bm.block_table("a") == [0, 1, 2, 3] and bm.num_cold("a") == 2
    assert (bm.num_used_blocks, bm.num_used_cold_blocks) == (2, 2)
    assert [bm.cached[h].cold for h in extend_block_hashes([], tokens[:12], 4)] == [True, True, False]
    assert bm.free_queue.block_ids()[:2] == [1, 0]  # the freed hot blocks are handed out first
    check_accounting(bm)
    bm.free("a")
    assert (bm.num_used_blocks, bm.num_used_cold_blocks, bm.num_cached_blocks) == (0, 0, 3)
    check_accounting(bm)


def test_a_cold_prefix_hit_is_cut_where_the_first_query_reads_it_hot():
    bm = BlockManager(16, block_size=4, num_cold_blocks=8, hot_tokens=8)
    tokens = list(range(200, 240))
    hashes = extend_block_hashes([], tokens, 4)
    bm.allocate("a", 0, 24)
    bm.cache_blocks("a", hashes, 24)
    bm.allocate("a", 24, 1)  # (24 + 1 - 8) // 4 = 4 blocks cold
    bm.take_demotions()
    bm.free("a")
    # b's prompt: a's 24 tokens and more. A hit of n blocks makes b's first query n * 4, which reads
    # (4n + 1 - 8) // 4 = n - 2 blocks cold: hits whose cold blocks all lie before that.
    hit = bm.cached_prefix(hashes, 40)
    assert [b.cold for b in hit] == [True, True, True, True, False, False]
    bm.allocate("b", 24, 16, hit)
    assert bm.take_demotions() == [] and bm.num_cold("b") == 4  # 4 = n - 2 already cold
    # c shares only the first 5 blocks: its first query (20) reads 3 blocks cold but block 3 is cold too
    c_hashes = extend_block_hashes([], tokens[:20] + [1] * 8, 4)
    assert [b.cold for b in bm.cached_prefix(c_hashes, 28)] == []  # no run of 1..5 blocks is consistent
    check_accounting(bm)


def test_forks_share_one_cold_copy_and_free_both_pools():
    bm = BlockManager(8, block_size=4, num_cold_blocks=4, hot_tokens=4)
    bm.allocate("a", 0, 10)
    bm.fork("a", "b")
    assert bm.allocate("a", 10, 1) == [(2, 3)]  # a's own copy of the shared block it writes into
    assert bm.take_demotions() == [(0, 0)]
    assert bm.allocate("b", 10, 1) == [] and bm.take_demotions() == []  # b reuses a's cold copy of block 0
    assert bm.block_table("a")[:1] == bm.block_table("b")[:1] == [0] and bm.cold_blocks[0].ref_cnt == 2
    check_accounting(bm)
    bm.free("a")
    bm.free("b")
    assert (bm.num_used_blocks, bm.num_used_cold_blocks) == (0, 0)
    check_accounting(bm)


def test_engine_equals_the_dense_engine_through_chunks_shared_prefixes_and_preemption(model_dir):
    from native_server.engine.llm_engine import LLMEngine
    from py_engine.backends.torch import LLM
    from py_engine.sampling_params import SamplingParams

    dense = LLM(str(model_dir), device="cpu", kv_cache_dtype="int8", kv_hot_tokens=16)
    hot_block = 2 * 2 * 2 * 16 * 4 * 16  # layers x (k, v) x kv heads x head dim x float32 x block size
    engine = LLMEngine(str(model_dir), device="cpu", kv_cache_dtype="int8", kv_hot_tokens=16, max_num_seqs=4,
                       max_num_batched_tokens=24, kv_cache_memory=10 * hot_block)
    params = SamplingParams.greedy(max_tokens=60, ignore_eos=True)
    prompts = [TEXT[:60], TEXT[:60] + " again", TEXT[100:130], TEXT[:61]]  # shared prefixes, chunked prefill
    for i, p in enumerate(prompts):
        engine.add_request(str(i), dense.encode(p), params)
    tokens: dict[str, list[int]] = {}
    peak_cold = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        peak_cold = max(peak_cold, engine.block_manager.num_used_cold_blocks)
    assert peak_cold > 0 and engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == dense.generate(p, params).token_ids, p
    assert engine.block_manager.num_used_blocks == engine.block_manager.num_used_cold_blocks == 0


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(model_dir, *HOT, "--max-concurrent", "32",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert no_traceback(srv.log()), srv.log()[-3000:]


def test_32_concurrent_int4_streams_equal_the_dense_engine(server: Server, model_dir):
    from py_engine.backends.torch import LLM
    from py_engine.sampling_params import SamplingParams

    dense = LLM(str(model_dir), device="cpu", kv_cache_dtype="int4", kv_hot_tokens=16)
    expected = [dense.generate(p, SamplingParams.greedy(max_tokens=64, ignore_eos=True)).text for p in PROMPTS]

    assert greedy_completions(server, PROMPTS, 64) == expected
    metrics = server.metrics()
    assert metric(metrics, "kv_cache_cold_blocks_total") > 0 and metric(metrics, "kv_cache_demoted_blocks_total") > 0
    assert metric(metrics, "kv_cache_cold_bytes_per_token") < metric(metrics, "kv_cache_hot_bytes_per_token") / 3
    capacity = (metric(metrics, "kv_cache_blocks_total") + metric(metrics, "kv_cache_cold_blocks_total")) * 16
    assert metric(metrics, "kv_cache_capacity_tokens") == capacity
    assert "int4 with 16 hot tokens" in server.log()


def test_disconnects_free_hot_and_cold_blocks(server: Server):
    body = {"prompt": "To be, or not to be", "max_tokens": 100, "ignore_eos": True, "temperature": 0,
            "stream": True, "n": 2}
    cold_seen = False
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i % 4 == 0 and metric(server.metrics(), "kv_cache_cold_blocks_used") > 0:
                    cold_seen = True
                    break  # hang up while the request holds cold blocks
    assert cold_seen
    metrics = wait_until(server, lambda m: metric(m, "num_requests_running") == 0
                         and metric(m, "kv_cache_blocks_used") == 0 and metric(m, "kv_cache_cold_blocks_used") == 0)
    assert metric(metrics, 'request_success_total{finished_reason="abort"}') == 2


@pytest.mark.parametrize("flags, message", [
    (("--kv-cache-dtype", "fp8"), "invalid choice: 'fp8'"),
    (("--kv-cache-dtype", "int4", "--kv-hot-tokens", "8"), "kv_hot_tokens is 8 but must be at least one block"),
    (("--kv-cache-dtype", "int8", "--kv-hot-tokens", "200"), "at most the context (128 tokens)"),
])
def test_bad_kv_flags_are_start_up_errors(model_dir, capsys, flags, message):
    from ruvllm_cli.main import main

    with pytest.raises(SystemExit) if "fp8" in flags else _no_raise():
        assert main(["serve", str(model_dir), "--device", "cpu", *flags]) == 1
    assert message in capsys.readouterr().err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_cold_pool_takes_the_bytes_it_is_accounted_in(model_dir, dtype):
    import torch

    from native_server.engine.kv_cache import ColdPool, cold_bytes_per_block, kv_bytes_per_block, split_budget
    from py_engine.config import ModelConfig
    from py_engine.models.kv_quant import KVQuantConfig

    config, quant = ModelConfig.from_file(model_dir), KVQuantConfig(dtype, 32)
    pool = ColdPool(config, 10, quant, "cpu")
    assert pool.nbytes == 10 * cold_bytes_per_block(config, quant)
    hot, cold = split_budget(config, quant, torch.float32, 1 << 20, 4, 64, 128)
    assert hot == 4 * (2 + 2) + 4  # four sequences' windows and one step of 64 tokens
    hot_bytes = hot * kv_bytes_per_block(config, 16, torch.float32)
    assert hot_bytes + cold * cold_bytes_per_block(config, quant) <= 1 << 20
    assert (1 << 20) - hot_bytes - cold * cold_bytes_per_block(config, quant) < cold_bytes_per_block(config, quant)


def test_default_cpu_sizing_has_room_for_every_sequence_and_a_small_budget_is_refused(model_dir):
    from native_server.engine.llm_engine import LLMEngine

    eng = LLMEngine(str(model_dir), device="cpu", kv_cache_dtype="int4", kv_hot_tokens=32, max_num_seqs=4)
    # max_model_len 128: each sequence 2 + 2 hot blocks and 6 cold ones; one step of 128 tokens hot
    assert (eng.kv.num_blocks, eng.kv.num_cold_blocks) == (4 * 4 + 8, 4 * 6)
    with pytest.raises(ValueError, match="too few for one sequence of max_model_len 128"):
        LLMEngine(str(model_dir), device="cpu", kv_cache_dtype="int4", kv_hot_tokens=32, kv_cache_memory=100_000)
