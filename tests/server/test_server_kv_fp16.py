"""The 16-bit KV cache in the server (`--kv-cache-dtype fp16` / `bf16`): sizing, engine, and `ruvllm serve` over HTTP.

- sizing: the same --kv-cache-memory holds twice an fp32 model's tokens, and the blocks are 16-bit in memory;
- engine: a batch with chunked prefill, prefix hits and preemption gives the torch oracle backend's tokens on
  the same 16-bit cache (the C decode rows read it, the torch path the prompt chunks), and the dense fp32
  engine's greedy tokens (on this model rounding the cache to fp16 flips none);
- HTTP: a real uvicorn `ruvllm serve --kv-cache-dtype fp16`, 8 concurrent greedy completions through the
  official openai client equal the dense engine; /metrics reports 2 bytes a value;
- bad values: the CLI and the engine refuse them, the dense engine (generate, chat, eval ppl, LLM) refuses
  fp16 / bf16 with a message naming the server.
The C kernel against the oracle, per variant: test_server_cpu_attention.py.
"""
from __future__ import annotations

import pytest
import torch

from native_server.engine.kv_cache import kv_bytes_per_block
from py_engine.sampling_params import SamplingParams
from tests.server.server_harness import Server, greedy_completions, metric, no_traceback, running_server
from tests.server.test_server_engine import assert_all_blocks_free, mixed_params, prompts, run
from tests.tiny_models import TEXT

torch.set_num_threads(1)
WORDS = TEXT.split()
PROMPTS = [" ".join(WORDS[(5 * i) % 40:(5 * i) % 40 + 3 + i]) for i in range(8)]


def engine(model_dir, **kwargs):
    from native_server.engine.llm_engine import LLMEngine

    return LLMEngine(str(model_dir), dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def dense(model_dir):
    from py_engine.backends.torch import LLM

    return LLM(str(model_dir), dtype="float32", device="cpu")


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_the_same_budget_holds_twice_the_tokens_in_16_bit_blocks(model_dir, kv_cache_dtype, dtype):
    budget = 40 * kv_bytes_per_block(engine(model_dir, kv_cache_memory=1 << 20).model_config, 16, torch.float32)
    fp32, half = engine(model_dir, kv_cache_memory=budget), engine(model_dir, kv_cache_memory=budget,
                                                                    kv_cache_dtype=kv_cache_dtype)
    assert (fp32.kv.num_blocks, half.kv.num_blocks) == (40, 80)
    assert fp32.kv.keys[0].dtype == torch.float32
    assert all(t.dtype == dtype for t in half.kv.keys + half.kv.values)
    held = sum(t.untyped_storage().nbytes() for t in half.kv.keys + half.kv.values)
    assert held == budget == sum(t.untyped_storage().nbytes() for t in fp32.kv.keys + fp32.kv.values)
    assert half.stats().kv_hot_bytes_per_token == fp32.stats().kv_hot_bytes_per_token / 2


def test_a_mixed_batch_on_fp16_kv_gives_the_oracle_backends_and_the_dense_engines_tokens(model_dir, dense,
                                                                                         monkeypatch):
    """Chunked prefill (8-token steps), prefix hits, preemption (a 12-block budget) and seeded sampling: the C
    backend equals the torch backend on the same fp16 cache; greedy requests equal the dense fp32 engine."""
    import native_server.engine.attention.cpu as cpu_attention

    c_calls, paged_decode = [], cpu_attention.paged_decode  # the backend falls back to torch where C refuses
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *a, **k: c_calls.append(1) or paged_decode(*a, **k))
    corpus = dense.tokenizer.encode(TEXT)
    shared = corpus[:21]
    batch = [(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(corpus, 6, seed=4, lengths=(2, 30)))]
    batch += [("a", shared, SamplingParams.greedy(max_tokens=20)), ("b", shared + corpus[30:33], mixed_params(4))]
    budget = 12 * kv_bytes_per_block(dense.config, 4, torch.float16)
    kwargs = dict(kv_cache_dtype="fp16", block_size=4, kv_cache_memory=budget, max_model_len=48,
                  max_num_batched_tokens=8)
    c_engine = engine(model_dir, **kwargs)
    assert c_engine.kv.backend.name == "cpu" and c_engine.kv.keys[0].dtype == torch.float16
    got = run(c_engine, batch)
    assert len(c_calls) > 50  # steps with decode rows, per layer, in C
    assert got == run(engine(model_dir, attention_backend="torch", **kwargs), batch)
    assert c_engine.stats().prefix_cache_hits > 0 and c_engine.stats().num_preemptions > 0
    assert_all_blocks_free(c_engine)
    greedy = [(request_id, prompt, params) for request_id, prompt, params in batch if params.temperature == 0]
    assert len(greedy) == 6
    for request_id, prompt, params in greedy:
        assert got[request_id][0]["token_ids"] == dense.generate(prompt, params).token_ids, request_id


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(model_dir, "--kv-cache-dtype", "fp16", "--kv-cache-memory", str(1 << 20),
                        "--max-concurrent", "8", log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert no_traceback(srv.log()), srv.log()[-3000:]


def test_serve_with_fp16_kv_answers_the_openai_client_as_the_dense_engine(server: Server, dense, model_dir):
    from py_engine.config import ModelConfig

    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    expected = [dense.generate(p, params).text for p in PROMPTS]

    assert greedy_completions(server, PROMPTS, 40) == expected
    config = ModelConfig.from_file(model_dir)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # k, v; 2 bytes
    metrics = server.metrics()
    assert metric(metrics, "kv_cache_hot_bytes_per_token") == per_token
    assert metric(metrics, "kv_cache_blocks_total") == (1 << 20) // (16 * per_token)
    assert "of float16) on cpu, cpu attention" in server.log()


@pytest.mark.parametrize("argv,message", [
    (["serve", "--kv-cache-dtype", "float16"], "invalid choice: 'float16'"),
    (["generate", "--kv-cache-dtype", "fp16"], "invalid choice: 'fp16'"),
])
def test_bad_kv_cache_dtypes_are_clear_errors(model_dir, capsys, argv, message):
    from ruvllm_cli.main import main

    with pytest.raises(SystemExit):
        main([argv[0], str(model_dir), *argv[1:]])
    assert message in capsys.readouterr().err


def test_the_engines_refuse_what_they_cannot_store(model_dir):
    from py_engine.backends.torch import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not one of auto, fp16, bf16, int8, int4"):
        engine(model_dir, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="'fp16' is the server's paged cache .*the dense cache takes auto, int8, int4"):
        LLM(str(model_dir), device="cpu", kv_cache_dtype="fp16")
