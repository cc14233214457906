"""The server on a GGUF K-quant mix (Q4_K with Q6_K v/down/head and a Q4_K token embedding, llama.cpp's Q4_K_M
rule; Q5_0 and Q8_0 beside them where llama-quantize falls back): its paged path runs the block types' kernels.

- engine: a batch with chunked prefill (8-token steps), prefix hits and preemption gives the single-sequence
  engine's greedy tokens (every projection of both is kquant.c on x rounded per 32 values, and a row of a batch
  gets what it gets alone), and the seeded samples of a second run of the same batch;
- HTTP: a real uvicorn `ruvllm serve FILE.gguf`, concurrent greedy completions through the official openai
  client equal the single-sequence engine (steps below 32 rows: the same arithmetic row for row).
The kernels themselves against gguf's dequantization: tests/importers/test_gguf_kquants.py.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from py_engine.quant.ggml import GGMLWeight  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from py_engine.sampling_params import SamplingParams  # noqa: E402
from tests.importers.gguf_builder import byte_level_vocab, hf_model, write_gguf  # noqa: E402
from tests.importers.test_gguf_kquants import k_mix  # noqa: E402
from tests.server.server_harness import greedy_completions, no_traceback, running_server  # noqa: E402
from tests.server.test_server_engine import mixed_params, prompts, run  # noqa: E402
from tests.tiny_models import TEXT, train_tokenizer  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kq")
    train_tokenizer(folder)
    vocab = byte_level_vocab(folder / "tokenizer.json", "gpt-2")
    mix = k_mix("Q4_K", 3)

    def kind(name, data):  # the Q4_K_M rule, and llama-quantize's fallbacks for a layer's rows of 32 multiples
        if name == "blk.1.attn_q.weight":
            return "Q5_0"
        if name == "blk.1.attn_output.weight":
            return "Q8_0"
        return mix(name, data)
    model = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                     initializer_range=0.05, max_position_embeddings=256)
    return write_gguf(folder / "q4_k_m.gguf", model, vocab, kind)


@pytest.fixture(scope="module")
def dense(gguf_file, tmp_path_factory):
    from py_engine.backends.torch import LLM

    llm = LLM(str(gguf_file), device="cpu", cache_dir=str(tmp_path_factory.mktemp("cache")))
    layers = [m for m in llm.model.modules() if isinstance(m, QuantLinear)]
    assert {m.packed.type_name for m in layers if isinstance(m.packed, GGMLWeight)} == {"Q4_K", "Q5_0", "Q6_K"}
    return llm


def engine(gguf_file, **kwargs):
    from native_server.engine.llm_engine import LLMEngine

    return LLMEngine(str(gguf_file), device="cpu", **kwargs)


def test_a_mixed_batch_gives_the_single_sequence_engines_tokens(gguf_file, dense):
    corpus = dense.tokenizer.encode(TEXT)
    shared = corpus[:21]
    batch = [(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(corpus, 6, seed=4, lengths=(2, 30)))]
    batch += [("a", shared, SamplingParams.greedy(max_tokens=20)), ("b", shared + corpus[30:33], mixed_params(4))]
    kwargs = dict(block_size=4, kv_cache_memory=1 << 20, max_model_len=64, max_num_batched_tokens=8)
    eng = engine(gguf_file, **kwargs)
    got = run(eng, batch)
    assert eng.stats().prefix_cache_hits > 0
    assert run(engine(gguf_file, **kwargs), batch) == got  # seeded samples too
    greedy = [(request_id, prompt, params) for request_id, prompt, params in batch if params.temperature == 0]
    assert len(greedy) == 6
    for request_id, prompt, params in greedy:
        assert got[request_id][0]["token_ids"] == dense.generate(prompt, params).token_ids, request_id


def test_served_greedy_completions_equal_the_single_sequence_engine(gguf_file, dense, tmp_path):
    words = TEXT.split()
    texts = [" ".join(words[7 * i:7 * i + 4 + i]) for i in range(6)]
    # steps of at most 24 rows: every product on x rounded per 32 values in tiles, as the single-sequence engine's
    # (from 32 rows the integer panels sum the same products in another float order: near-ties could flip)
    with running_server(gguf_file, "--max-concurrent", "6", "--max-num-batched-tokens", "24", "--cache-dir",
                        str(tmp_path / "cache"), log_dir=tmp_path) as server:
        served = greedy_completions(server, texts, 16)
        assert no_traceback(server.log()), server.log()[-3000:]
    for text, got in zip(texts, served):
        want = dense.generate(text, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
        assert got == want.text, text
