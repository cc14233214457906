"""The batching engine at tensor_parallel_size=2 (two gloo processes) against the same engine at 1.

One TP=2 engine for the module, with runtime LoRA on: concurrent greedy requests (prompt chunks of 8 tokens
beside decode rows, a shared prefix from the prefix cache, n=2 forking copy-on-write blocks) give the tokens
of the one-process engine; adapters loaded and unloaded while serving reach the worker (the adapter's tokens
differ from the base model's, and equal the one-process engine's with that adapter); the two-tier int8 KV
cache (blocks demoted on every rank) too. The one-process engine is itself tested against LLM and
transformers (tests/server).
"""
from __future__ import annotations

import pytest

from native_server.engine import LLMEngine
from py_engine.sampling_params import SamplingParams
from tests.server.lora_adapters import build_adapters

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore art thou", "First Citizen:\nBefore we proceed any further",
           "First Citizen:\nBefore we proceed any further, hear me speak.", "KING RICHARD III:"]
OPTIONS = dict(device="cpu", max_num_batched_tokens=8, enable_lora=True, max_loras=2)


def run(engine, prompts, lora=None, n=1, max_tokens=20):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", engine.tokenizer.encode(p), SamplingParams(temperature=0 if n == 1 else 0.8,
                           seed=i, n=n, max_tokens=max_tokens), lora=lora)
    tokens: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            for d in out.outputs:
                tokens.setdefault((out.request_id, d.index), []).extend(d.token_ids)
    return tokens


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return build_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def engines():
    one, two = LLMEngine("tiny-shakespeare", **OPTIONS), LLMEngine("tiny-shakespeare", tensor_parallel_size=2,
                                                                   **OPTIONS)
    yield one, two
    two.close()


def test_batches_chunks_prefix_cache_and_forks(engines):
    one, two = engines
    assert run(two, PROMPTS) == run(one, PROMPTS)
    assert run(two, PROMPTS[2:4], n=2) == run(one, PROMPTS[2:4], n=2)  # seeded samples: forks share blocks
    assert two.stats().prefix_cache_hits > 0


def test_adapters_loaded_and_unloaded_while_serving(engines, adapters):
    one, two = engines
    for engine in engines:
        engine.load_lora("all", str(adapters["all"]))
    with_adapter = run(two, PROMPTS[:3], lora="all")
    assert with_adapter == run(one, PROMPTS[:3], lora="all")
    assert with_adapter != run(two, PROMPTS[:3])
    for engine in engines:
        engine.unload_lora("all")
        engine.load_lora("mlp", str(adapters["mlp"]))  # the freed slot, on every rank
    assert run(two, PROMPTS[:2], lora="mlp") == run(one, PROMPTS[:2], lora="mlp")
    for engine in engines:
        engine.unload_lora("mlp")


def test_two_tier_int8_kv():
    options = dict(device="cpu", kv_cache_dtype="int8", kv_hot_tokens=32, max_num_batched_tokens=16)
    one = LLMEngine("tiny-shakespeare", **options)
    two = LLMEngine("tiny-shakespeare", tensor_parallel_size=2, **options)
    try:
        ref = run(one, PROMPTS[2:4], max_tokens=60)
        assert run(two, PROMPTS[2:4], max_tokens=60) == ref
        assert two.stats().kv_demoted_blocks > 0
    finally:
        two.close()
