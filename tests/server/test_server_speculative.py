"""Speculative decoding in the server: the same output as without it, and cached, chunked and batched alike.

The engine on a tiny random model (CPU kernels, fp32) runs a mixed batch (greedy, seeded sampling with n = 2,
penalties, logprobs, stop strings, max_tokens, structured output) with prompt lookup at k = 1..8 and with
prefix caching and preemption, and each request's tokens, text, finish reason and logprobs must equal the same
engine's without speculation. Every KV block comes back. A draft model (the same tiny model in int4) too. Then a
real `ruvllm serve --speculative-config` with the official openai client: a request's opt-out
(`speculative: false`) gives its twin's exact result, and /metrics carries the spec_decode counters.
"""
from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from native_server.engine.kv_cache import kv_bytes_per_block
from native_server.engine.llm_engine import LLMEngine
from py_engine.guided.params import StructuredOutputsParams
from py_engine.kernels import cpu_kernels
from py_engine.sampling_params import SamplingParams
from tests.requires import kernels_missing
from tests.server.server_harness import no_traceback, running_server
from tests.tiny_models import TEXT, build_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))
torch.set_num_threads(1)
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "acceptance_floor": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "llama", seed=3, max_position_embeddings=512)


def requests(tokenizer):
    repeat = tokenizer.encode(TEXT[:300])  # the corpus repeats: prompt lookup finds its n-grams
    other = tokenizer.encode("Whether 'tis nobler in the mind to suffer")
    return [("greedy", repeat, SamplingParams.greedy(max_tokens=40, ignore_eos=True)),
            ("logprobs", repeat[40:], SamplingParams.greedy(max_tokens=30, logprobs=3, ignore_eos=True)),
            ("penalty", repeat, SamplingParams.greedy(max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.4,
                                                      ignore_eos=True)),
            ("seeded", repeat[10:], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, n=2,
                                                   ignore_eos=True)),
            ("stop", repeat, SamplingParams.greedy(max_tokens=60, stop=("sea",), ignore_eos=True)),
            ("short", repeat, SamplingParams.greedy(max_tokens=2, ignore_eos=True)),
            ("regex", other, SamplingParams.greedy(max_tokens=20, structured_outputs=StructuredOutputsParams(
                regex="(To|No) [a-z ]{2,12}\\."))),
            ("plain", other, SamplingParams.greedy(max_tokens=25, ignore_eos=True))]


def run(eng: LLMEngine, batch) -> dict:
    for request_id, prompt, params in batch:
        eng.add_request(request_id, prompt, params)
    results: dict = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                r = results.setdefault((out.request_id, c.index), {"text": "", "ids": [], "end": None, "lp": []})
                r["text"] += c.text
                r["ids"] += c.token_ids
                r["end"] = c.finish_reason
                r["lp"] += [(x.token_id, x.logprob, x.top_logprobs) for x in c.logprobs or ()]
    bm = eng.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    return results


def engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(str(model_dir), dtype="float32", device="cpu", **kwargs)


@pytest.mark.parametrize("k", range(1, 9))
def test_prompt_lookup_changes_no_output(model_dir, k):
    kwargs = dict(max_num_batched_tokens=48)  # prompts in chunks, decode rows beside them
    plain = engine(model_dir, **kwargs)
    batch = requests(plain.tokenizer)
    expected = run(plain, batch)
    spec = engine(model_dir, speculative_config={**NGRAM, "num_speculative_tokens": k}, **kwargs)
    got = run(spec, batch)
    assert got == expected
    stats = spec.stats().spec_decode
    assert stats.num_draft_tokens > 20 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(stats.accepted_per_position) == k
    again = run(spec, batch)  # the prompts' blocks are now cached: the same again
    assert again == expected and spec.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_drafts_changes_no_output(model_dir, prefix_caching):
    probe = engine(model_dir, max_model_len=64)
    budget = 20 * kv_bytes_per_block(probe.model_config, 4, torch.float32)  # 80 slots for 8 sequences of 50
    kwargs = dict(block_size=4, kv_cache_memory=budget, max_model_len=64, enable_prefix_caching=prefix_caching)
    tokens = probe.tokenizer.encode(TEXT)
    batch = [(f"r{i}", tokens[7 * i:7 * i + 10], SamplingParams.greedy(max_tokens=40, ignore_eos=True) if i % 4 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=40, ignore_eos=True)) for i in range(8)]
    expected = run(engine(model_dir, **kwargs), batch)
    spec = engine(model_dir, speculative_config={**NGRAM, "num_speculative_tokens": 4}, **kwargs)
    assert run(spec, batch) == expected
    assert spec.stats().num_preemptions > 0 and spec.stats().spec_decode.num_accepted_tokens > 0


def test_a_draft_model_and_the_batch_size_switch(model_dir):
    plain = engine(model_dir)
    batch = requests(plain.tokenizer)
    expected = run(plain, batch)
    draft = engine(model_dir, speculative_config={"model": str(model_dir), "quantization": "int4",
                                                  "num_speculative_tokens": 3, "acceptance_floor": 0})
    assert run(draft, batch) == expected
    assert draft.stats().spec_decode.num_accepted_tokens > 0
    off = engine(model_dir, speculative_config={**NGRAM, "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    assert run(off, batch) == expected
    assert off.stats().spec_decode.num_drafts < draft.stats().spec_decode.num_drafts  # off while > 2 run


def test_speculation_refuses_a_two_tier_cache(model_dir):
    with pytest.raises(ValueError, match="two-tier"):
        engine(model_dir, kv_cache_dtype="int8", speculative_config="ngram")


def test_served_with_opt_out_twins_and_metrics(model_dir, tmp_path):
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "acceptance_floor": 0}'
    with running_server(model_dir, "--speculative-config", config, "--max-concurrent", "16",
                        log_dir=tmp_path) as server:
        prompts = [TEXT[i * 40:i * 40 + 200] for i in range(8)]

        async def both() -> list:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
            async with client:
                calls = [client.completions.create(model=None, prompt=p, max_tokens=32, temperature=0, logprobs=2,
                                                   extra_body={"ignore_eos": True, "speculative": s})
                         for p in prompts for s in (True, False)]
                return await asyncio.gather(*calls)
        outs = asyncio.run(both())
        for spec, plain in zip(outs[::2], outs[1::2]):
            assert spec.choices[0].text == plain.choices[0].text
            assert spec.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
        metrics = server.metrics()
        drafted = metrics["ruvllm_spec_decode_num_draft_tokens_total"]
        assert 0 < metrics["ruvllm_spec_decode_num_accepted_tokens_total"] <= drafted
        assert metrics['ruvllm_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
        assert no_traceback(server.log())
