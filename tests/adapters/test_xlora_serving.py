"""X-LoRA on the paged server: batched, chunked and prefix-cached runs equal each prompt alone.

The engine keeps the scaling pass's KV in layers L..2L-1 of its paged cache, and each
token's scalings come from its own row's hidden state, so a flattened batch of many
sequences needs no per-sequence state. The reference is LLM(xlora=...) (itself equal
to peft: test_xlora_builtin.py); one real `ruvllm serve --xlora` answers over HTTP.
"""
from __future__ import annotations

import httpx
import pytest

from tests.paths import BUILTIN, REPO

torch = pytest.importorskip("torch")
from native_server.engine.llm_engine import LLMEngine  # noqa: E402
from py_engine import LLM, SamplingParams  # noqa: E402
from tests.server.server_harness import running_server  # noqa: E402
from tests.server.test_server_engine import assert_all_blocks_free, expect, run  # noqa: E402

XLORA = REPO / "py_engine" / "data" / "adapters" / "tiny-shakespeare" / "xlora"
PROMPTS = ["ROMEO:", "Of Man's first disobedience, and the fruit", "MALVOLIO. Some are born great,",
           "First Citizen:\nBefore we proceed any further, hear me speak.", "O", "HAMLET."]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def reference():
    return LLM(str(BUILTIN), dtype="float32", device="cpu", xlora=str(XLORA))


def params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=14, ignore_eos=True)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8}], ids=["batched", "chunked"])
def test_batch_equals_each_prompt_alone(reference, options):
    eng = LLMEngine(str(BUILTIN), dtype="float32", device="cpu", xlora=str(XLORA), **options)
    assert len(eng.kv.keys) == 2 * eng.model_config.num_hidden_layers
    batch = [(f"r{i}", reference.encode(p), params(i)) for i, p in enumerate(PROMPTS)]
    results = run(eng, batch + [("again", reference.encode(PROMPTS[1]), params(0))])  # a prefix-cache hit
    for request_id, prompt, p in batch:
        assert results[request_id][0] == expect(reference, prompt, p), request_id
    assert results["again"][0] == expect(reference, reference.encode(PROMPTS[1]), params(0))
    assert_all_blocks_free(eng)


def test_serve_xlora_over_http(reference, tmp_path):
    want = reference.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).text
    with running_server(BUILTIN, "--xlora", str(XLORA), log_dir=tmp_path) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "tiny-shakespeare", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
