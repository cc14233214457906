"""Multi-LoRA in the engine (native_server/engine/lora.py), in process: one batch mixing four adapters and the base
gives every request the tokens it gets alone, and the tokens LLM(lora=...) gives (which equal peft's:
tests/adapters); prefix-cache blocks are never shared across adapters; unloading waits for running requests.
"""
from __future__ import annotations

import pytest

from tests.paths import BUILTIN
from tests.server.lora_adapters import ADAPTERS, build_adapters

torch = pytest.importorskip("torch")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from native_server.engine.llm_engine import LLMEngine  # noqa: E402
from native_server.engine.outputs import AdapterNotFoundError  # noqa: E402
from py_engine import LLM  # noqa: E402
from py_engine.adapters import AdapterError  # noqa: E402
from py_engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
MODELS = [None, *ADAPTERS]  # None: the base model
PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return build_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def llm(adapters):
    return LLM(str(BUILTIN), lora={k: str(v) for k, v in adapters.items()})


def _params(kind: str) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)


def _run(eng, requests):
    for request_id, ids, params, lora in requests:
        eng.add_request(request_id, ids, params, lora)
    tokens, cached = {}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    return tokens, cached


def test_mixed_batch_equals_each_alone_and_the_single_sequence_path(adapters, llm):
    eng = LLMEngine(str(BUILTIN), device="cpu", lora_modules={k: str(v) for k, v in adapters.items()},
                    enable_prefix_caching=False)
    requests = [(f"{m}-{kind}-{p}", llm.encode(text), _params(kind), m)
                for m in MODELS for kind in ("greedy", "seeded") for p, text in enumerate(PROMPTS)]
    solo = {}
    for request in requests:
        solo.update(_run(eng, [request])[0])
    mixed, _ = _run(eng, requests)
    assert mixed == solo
    for request_id, ids, params, lora in requests:  # the engine's path equals LLM's, tested against peft
        assert solo[request_id] == llm.generate(ids, params, lora=lora).token_ids, request_id
    greedy = {m: [solo[f"{m}-greedy-{p}"] for p in range(len(PROMPTS))] for m in MODELS}
    assert all(greedy[m] != greedy[None] for m in ADAPTERS), "each adapter should change the tokens"


def test_prefix_cache_never_shares_blocks_across_adapters(adapters, llm):
    eng = LLMEngine(str(BUILTIN), device="cpu", lora_modules={"attn": str(adapters["attn"]),
                                                              "mlp": str(adapters["mlp"])}, block_size=4)
    ids = llm.encode(PROMPTS[2])  # several full blocks
    greedy = _params("greedy")
    order = [("attn", "a1"), ("mlp", "m1"), (None, "b1"), ("attn", "a2"), (None, "b2"), ("mlp", "m2")]
    cached = {}
    for lora, request_id in order:
        tokens, hits = _run(eng, [(request_id, ids, greedy, lora)])
        cached[request_id] = hits[request_id]
    assert cached["a1"] == cached["m1"] == cached["b1"] == 0  # the same prompt, computed anew for each
    assert cached["a2"] > 0 and cached["b2"] > 0 and cached["m2"] > 0  # each reuses its own blocks
    owners: dict = {}
    for block_hash in eng.block_manager.cached:  # every cached chain is rooted in exactly one adapter
        owners.setdefault(block_hash.token_ids, set()).add(block_hash.value)
    assert any(len(values) == 3 for values in owners.values())


def test_unload_waits_for_running_requests_and_refuses_new_ones(adapters, llm):
    eng = LLMEngine(str(BUILTIN), device="cpu", enable_lora=True, max_loras=2)
    eng.load_lora("attn", str(adapters["attn"]))
    ids = llm.encode(PROMPTS[0])
    expected = llm.generate(ids, _params("greedy"), lora="attn").token_ids
    eng.add_request("r", ids, _params("greedy"), "attn")
    eng.step()
    eng.unload_lora("attn")
    with pytest.raises(AdapterNotFoundError):
        eng.add_request("late", ids, _params("greedy"), "attn")
    assert eng.adapters.retiring, "still used by the running request"
    tokens, _ = _run(eng, [])
    assert eng.adapters.manager.slots == {} and not eng.adapters.retiring
    eng2_tokens = tokens["r"]
    assert len(eng2_tokens) == 11  # the 11 tokens after the first step's
    eng.load_lora("attn", str(adapters["attn"]))  # the same name again: a new load, usable at once
    eng.load_lora("mlp", str(adapters["mlp"]))
    with pytest.raises(AdapterError, match="limit .*--max-loras"):
        eng.load_lora("qv", str(adapters["qv"]))
    assert _run(eng, [("again", ids, _params("greedy"), "attn")])[0]["again"] == expected
