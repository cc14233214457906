"""The engine end to end on a tiny random model (CPU, fp32) against the reference single-sequence engine.

Batched, chunked, prefix-cached, preempted and forked runs must all give the
tokens, text and finish reasons of `py_engine.backends.torch.LLM.generate` for each
prompt alone; and every KV block must come back at the end.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from native_server.engine.async_engine import AsyncEngine
from native_server.engine.llm_engine import LLMEngine, PromptTooLongError, QueueFullError
from native_server.engine.kv_cache import kv_bytes_per_block
from native_server.engine.outputs import EngineDeadError, EngineShutdownError, RequestFailedError
from py_engine.backends.torch import LLM
from py_engine.sampling_params import SamplingParams
from tests.requires import kernels_missing
from tests.tiny_models import TEXT, build_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("server") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def corpus(reference):
    return reference.tokenizer.encode(TEXT)


def prompts(corpus, count, seed=0, lengths=(1, 40)):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(*lengths)
        start = rng.randrange(len(corpus) - n)
        out.append(corpus[start:start + n])
    return out


def engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(str(model_dir), dtype="float32", device="cpu", **kwargs)


def run(eng: LLMEngine, requests) -> dict[str, dict[int, dict]]:
    """Add (id, prompt, params) requests, step to the end, and join each sample's deltas."""
    for request_id, prompt, params in requests:
        eng.add_request(request_id, prompt, params)
    results: dict[str, dict[int, dict]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                r = results.setdefault(out.request_id, {}).setdefault(
                    c.index, {"text": "", "token_ids": [], "finish_reason": None})
                r["text"] += c.text
                r["token_ids"] += c.token_ids
                r["finish_reason"] = c.finish_reason
    return results


def expect(reference, prompt, params) -> dict:
    done = reference.generate(prompt, params)
    return {"text": done.text, "token_ids": done.token_ids, "finish_reason": done.finish_reason}


def assert_all_blocks_free(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


def mixed_params(i: int) -> SamplingParams:
    """Greedy, greedy with penalties, and seeded sampling with filters and a stop string."""
    kind = i % 4
    if kind == 0:
        return SamplingParams.greedy(max_tokens=12 + i % 7)
    if kind == 1:
        return SamplingParams.greedy(max_tokens=10, repetition_penalty=1.3, logit_bias={5: 2.0})
    if kind == 2:
        return SamplingParams(max_tokens=14, seed=i, temperature=0.8, top_p=0.9, top_k=50)
    return SamplingParams(max_tokens=16, seed=i, min_p=0.05, stop=["e", "th"], presence_penalty=0.5)


def test_a_batch_of_32_prompts_equals_each_prompt_alone(model_dir, reference, corpus):
    eng = engine(model_dir)
    batch = [(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(corpus, 32))]
    results = run(eng, batch)
    for request_id, prompt, params in batch:
        assert results[request_id][0] == expect(reference, prompt, params), request_id
    assert eng.stats().generation_tokens == sum(len(r[0]["token_ids"]) for r in results.values())
    assert_all_blocks_free(eng)


def test_the_cpu_kernels_run_under_the_paged_engine(model_dir, corpus):
    """On CPU the engine optimizes its model as LLM does (fused projections, the native kernels) and runs
    steps inside kernel_step; greedy outputs equal those of the same engine on torch's matmuls."""
    from py_engine.kernels import cpu_kernels
    from py_engine.cpu.transforms import KernelLinear

    if cpu_kernels() is None:
        pytest.skip(kernels_missing())
    fast, plain = engine(model_dir), engine(model_dir, optimize=False)
    assert fast.runner.kernels is cpu_kernels() and plain.runner.kernels is None
    assert any(isinstance(m, KernelLinear) for m in fast.model.modules())
    assert not any(isinstance(m, KernelLinear) for m in plain.model.modules())
    batch = [(f"r{i}", p, SamplingParams.greedy(max_tokens=12)) for i, p in enumerate(prompts(corpus, 8, seed=5))]
    threads = torch.set_num_threads(2) or torch.get_num_threads()
    seen = []  # torch's threads and the pool's while a step samples: one, and the step's two
    sample = fast._sample
    fast._sample = lambda *a: seen.append((torch.get_num_threads(), fast.runner.kernels.threads)) or sample(*a)
    try:
        assert run(fast, batch) == run(plain, batch)
        assert torch.get_num_threads() == threads  # kernel_step gives torch its threads back
    finally:
        torch.set_num_threads(1)
    assert seen and set(seen) == {(1, 2)}


def test_the_step_budget_defaults_to_512_tokens_on_cpu(model_dir):
    from native_server.engine.llm_engine import default_batched_tokens

    assert engine(model_dir).scheduler.max_num_batched_tokens == 512
    assert engine(model_dir, max_num_batched_tokens=40).scheduler.max_num_batched_tokens == 40
    assert default_batched_tokens(torch.device("cuda")) == 2048


SLIDING = {"mistral": {"sliding_window": 8},
           "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                      "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}}


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_families_batched_equal_alone(tmp_path, corpus, family):
    folder = build_tiny_model(tmp_path / family, family, seed=4, **SLIDING[family])
    reference = LLM(str(folder), dtype="float32", device="cpu")
    eng = engine(folder, block_size=4, max_num_batched_tokens=24)
    batch = [(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(corpus, 8, seed=5, lengths=(3, 30)))]
    results = run(eng, batch)
    for request_id, prompt, params in batch:
        assert results[request_id][0] == expect(reference, prompt, params), request_id
    assert_all_blocks_free(eng)


def test_longrope_models_stop_at_the_factor_switch(tmp_path):
    rope = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    folder = build_tiny_model(tmp_path / "phi3", "phi3", partial_rotary_factor=0.5, max_position_embeddings=64,
                              original_max_position_embeddings=16, rope_scaling=rope)
    assert engine(folder).max_model_len == 16


def test_chunked_prefill_leaves_outputs_unchanged(model_dir, reference, corpus):
    eng = engine(model_dir, max_num_batched_tokens=8, block_size=4)
    batch = [(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(corpus, 6, seed=1, lengths=(10, 30)))]
    for request_id, result in run(eng, batch).items():
        _, prompt, params = batch[int(request_id[1:])]
        assert result[0] == expect(reference, prompt, params)
    assert_all_blocks_free(eng)


def test_prefix_cache_hit_gives_the_same_tokens_and_is_counted(model_dir, reference, corpus):
    eng = engine(model_dir, block_size=4)
    shared = corpus[:37]
    first = run(eng, [("a", shared, SamplingParams.greedy(max_tokens=8))])
    eng.add_request("b", shared + corpus[40:45], SamplingParams.greedy(max_tokens=8))
    out = eng.step()[0]
    assert out.num_cached_tokens == 36  # nine full blocks of the shared prompt
    stats = eng.stats()
    assert stats.prefix_cache_hits == 36 and stats.prefix_cache_queries == 37 + 42
    rest = run(eng, [])
    second = out.outputs[0].token_ids + rest["b"][0]["token_ids"]
    assert first["a"][0] == expect(reference, shared, SamplingParams.greedy(max_tokens=8))
    assert second == expect(reference, shared + corpus[40:45], SamplingParams.greedy(max_tokens=8))["token_ids"]
    assert_all_blocks_free(eng)
    assert eng.stats().kv_blocks_cached > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_leaves_greedy_and_seeded_outputs_unchanged(model_dir, reference, corpus, prefix_caching):
    config = reference.config
    budget = 14 * kv_bytes_per_block(config, 4, torch.float32)  # 56 token slots for 8 sequences
    eng = engine(model_dir, block_size=4, kv_cache_memory=budget, max_model_len=48,
                 enable_prefix_caching=prefix_caching)
    assert eng.block_manager.num_blocks == 14
    params = [SamplingParams.greedy(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, seed=11, temperature=0.9, ignore_eos=True)]
    batch = [(f"r{i}", p, params[i % 2]) for i, p in enumerate(prompts(corpus, 8, seed=2, lengths=(5, 12)))]
    results = run(eng, batch)
    assert eng.stats().num_preemptions > 0
    for request_id, prompt, p in batch:
        assert results[request_id][0] == expect(reference, prompt, p), request_id
    assert_all_blocks_free(eng)


def test_n_samples_share_prompt_blocks_and_equal_seeded_single_runs(model_dir, reference, corpus):
    eng = engine(model_dir, block_size=4)
    prompt = corpus[:10]  # two full blocks and a half-full one, shared copy-on-write
    params = SamplingParams(n=3, seed=5, max_tokens=9, ignore_eos=True)
    eng.add_request("n3", prompt, params)
    eng.step()  # prefill, then the fork: three sequences on one prompt
    tables = [eng.block_manager.block_table(seq.seq_id) for seq in eng.scheduler.running]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
    assert [eng.block_manager.blocks[b].ref_cnt for b in tables[0]] == [3, 3, 3]
    eng.step()  # the first two writers copy the half-full block; full blocks stay shared
    tables = [eng.block_manager.block_table(seq.seq_id) for seq in eng.scheduler.running]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    eng.abort("n3")
    assert_all_blocks_free(eng)

    eng = engine(model_dir, block_size=4)
    results = run(eng, [("n3", prompt, params)])
    for i in range(3):
        single = SamplingParams(seed=5 + i, max_tokens=9, ignore_eos=True)
        assert results["n3"][i] == expect(reference, prompt, single)
    assert_all_blocks_free(eng)


def test_abort_frees_every_block(model_dir, corpus):
    eng = engine(model_dir, block_size=4, max_num_seqs=3)
    for i, prompt in enumerate(prompts(corpus, 6, seed=3, lengths=(8, 20))):
        eng.add_request(f"r{i}", prompt, SamplingParams(n=1 + i % 2, max_tokens=50, ignore_eos=True, seed=i))
    for _ in range(3):
        eng.step()
    assert eng.scheduler.running and eng.scheduler.waiting
    outs = [eng.abort(f"r{i}") for i in range(6)]
    assert all(o.finished and {c.finish_reason for c in o.outputs} == {"abort"} for o in outs)
    assert [len(o.outputs) for o in outs] == [1, 2] * 3
    assert eng.abort("r0") is None and not eng.has_unfinished_requests()
    assert_all_blocks_free(eng)


def test_request_validation(model_dir):
    eng = engine(model_dir, max_model_len=16, max_queue=1)
    with pytest.raises(PromptTooLongError, match="16 tokens.*max_model_len is 16"):
        eng.add_request("long", list(range(16)), SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("bias", [1], SamplingParams(logit_bias={10**6: 1.0}))
    eng.add_request("a", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already running"):
        eng.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(QueueFullError):
        eng.add_request("b", [1, 2], SamplingParams())
    assert PromptTooLongError.status_code == 400 and QueueFullError.status_code == 503


def test_async_engine_streams_cancels_and_refuses(model_dir, reference, corpus):
    async def main():
        engine_ = AsyncEngine(engine(model_dir, block_size=4))
        engine_.start()
        batch = [(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(corpus, 5, seed=4))]

        async def collect(request_id, prompt, params):
            tokens, text, reason = [], "", None
            async for out in engine_.generate(request_id, prompt, params):
                tokens += out.outputs[0].token_ids if out.outputs else []
                text += "".join(c.text for c in out.outputs)
                reason = out.outputs[0].finish_reason if out.outputs else reason
            return {"text": text, "token_ids": tokens, "finish_reason": reason}

        results = await asyncio.gather(*(collect(*r) for r in batch))
        for (_, prompt, params), got in zip(batch, results):
            assert got == expect(reference, prompt, params)

        # A client that leaves after two outputs: the request is aborted and its blocks freed.
        seen = 0
        async for _ in engine_.generate("gone", corpus[:30], SamplingParams(max_tokens=100, ignore_eos=True)):
            seen += 1
            if seen == 2:
                break
        for _ in range(500):
            if not engine_.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert engine_.stats().kv_blocks_used == 0 and not engine_.engine.has_unfinished_requests()

        with pytest.raises(PromptTooLongError):
            await engine_.generate("long", list(range(200)), SamplingParams()).__anext__()
        engine_.engine.max_queue = 0
        with pytest.raises(QueueFullError):
            await engine_.generate("full", [1], SamplingParams()).__anext__()
        engine_.engine.max_queue = 10

        # abort() ends a live stream with finish_reason "abort".
        reasons = []
        async for out in engine_.generate("ab", corpus[:5], SamplingParams(max_tokens=100, ignore_eos=True)):
            reasons += [c.finish_reason for c in out.outputs]
            if len(reasons) == 1:
                await engine_.abort("ab")
        assert reasons[-1] == "abort"
        await engine_.shutdown(timeout=1.0)
        stats = engine_.stats()
        assert stats.ttft.count == 7 and stats.inter_token_latency.count > 0

    asyncio.run(main())


def test_async_engine_failure_reaches_every_stream_and_shutdown_refuses(model_dir):
    async def main():
        eng = engine(model_dir)

        def broken_step():
            raise RuntimeError("kaput")

        eng.step = broken_step
        fatal = []
        async_engine = AsyncEngine(eng, on_fatal=fatal.append)
        async_engine.start()
        with pytest.raises(EngineDeadError, match="kaput"):
            async for _ in async_engine.generate("x", [1, 2], SamplingParams()):
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.generate("y", [1], SamplingParams()).__anext__()
        assert "kaput" in async_engine.dead_reason()  # what /health reports with its 503
        await asyncio.sleep(0.05)
        assert [str(e) for e in fatal] == ["kaput"]  # the server exits non-zero on this

        healthy = AsyncEngine(engine(model_dir))
        healthy.start()
        assert healthy.dead_reason() is None
        await healthy.shutdown(timeout=0.1)
        with pytest.raises(EngineShutdownError):
            await healthy.generate("z", [1], SamplingParams()).__anext__()

    asyncio.run(main())


def test_a_request_failing_in_sampling_or_detokenizing_fails_alone(model_dir, reference, corpus, monkeypatch):
    """Only the forward pass is the batch's; a request whose own sampling or text side raises ends with
    an error, its blocks freed, and every other request gives the reference's output."""
    import native_server.engine.llm_engine as engine_module

    batched = engine_module.sample

    def sample(logits, rows):  # a sampler bug that only one request's parameters reach
        if any(row.params.seed == 666 for row in rows):
            raise OverflowError("bad row")
        return batched(logits, rows)

    def broken_append(sample_output, num_output_tokens):
        raise UnicodeError("detokenizer bug")

    monkeypatch.setattr(engine_module, "sample", sample)
    eng = engine(model_dir, block_size=4)
    batch = [(f"r{i}", p, mixed_params(i)) for i, p in enumerate(prompts(corpus, 6, seed=5))]
    for request_id, prompt, params in batch[:3]:
        eng.add_request(request_id, prompt, params)
    eng.add_request("bad-sample", corpus[:9], SamplingParams(seed=666, n=2, max_tokens=5, temperature=1.0))
    eng.add_request("bad-text", corpus[:7], SamplingParams.greedy(max_tokens=5))
    eng._requests["bad-text"].streams[0].append = broken_append
    for request_id, prompt, params in batch[3:]:
        eng.add_request(request_id, prompt, params)
    results, errors = {}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.error is not None:
                assert out.finished and not out.outputs
                errors[out.request_id] = out.error
            for c in out.outputs:
                r = results.setdefault(out.request_id, {"text": "", "token_ids": [], "finish_reason": None})
                r["text"] += c.text
                r["token_ids"] += c.token_ids
                r["finish_reason"] = c.finish_reason
    assert errors == {"bad-sample": "OverflowError: bad row", "bad-text": "UnicodeError: detokenizer bug"}
    for request_id, prompt, params in batch:
        assert results[request_id] == expect(reference, prompt, params), request_id
    assert_all_blocks_free(eng)


def test_async_engine_delivers_one_request_failure_and_keeps_serving(model_dir, corpus):
    async def main():
        eng = engine(model_dir)
        async_engine = AsyncEngine(eng, on_fatal=lambda error: pytest.fail(f"fatal: {error!r}"))
        async_engine.start()
        real_add = eng.add_request

        def add_request(request_id, prompt, params):
            real_add(request_id, prompt, params)
            if request_id == "doomed":
                eng._requests[request_id].streams[0].append = lambda *args: 1 / 0

        eng.add_request = add_request

        async def run(request_id):
            text = ""
            async for out in async_engine.generate(request_id, corpus[:8], SamplingParams.greedy(max_tokens=6)):
                text += "".join(c.text for c in out.outputs)
            return text

        doomed, fine = await asyncio.gather(run("doomed"), run("fine"), return_exceptions=True)
        assert isinstance(doomed, RequestFailedError) and "ZeroDivisionError" in str(doomed)
        assert isinstance(fine, str) and fine
        assert async_engine.dead_reason() is None and await run("after")
        assert async_engine.stats().kv_blocks_used == 0
        await async_engine.shutdown(timeout=1.0)

    asyncio.run(main())
