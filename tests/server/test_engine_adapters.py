"""The learning loops' adapters in the batching engine (to_lora_adapter, replace_lora): a request with an
adapter and one without, in the same steps, give what each gives alone (the single-sequence LLM with the
adapter loaded from its peft folder, and the base); prefix-cache blocks are never shared across adapters or
across versions of one swapped in by replace_lora."""
from __future__ import annotations

import itertools

import pytest
import torch

from native_server.engine.llm_engine import LLMEngine
from native_server.engine.outputs import AdapterNotFoundError
from py_engine import LLM
from py_engine.learning.lora import TrainableLora, to_lora_adapter
from py_engine.models import load_model
from py_engine.sampling_params import SamplingParams
from tests.paths import BUILTIN

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPT = list(range(40, 90))  # 50 tokens: three full 16-token blocks
_ids = itertools.count()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    model, _ = load_model(BUILTIN, dtype="float32")
    lora = TrainableLora.for_model(model, ("o_proj", "down_proj"), layers=0, rank=4, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for B in lora.B:
            B.copy_(torch.randn(B.shape, generator=gen) * 0.05)
    return lora.save_peft(tmp_path_factory.mktemp("adapter") / "a", base=str(BUILTIN)), lora.adapter()


def run(engine, requests):
    """{request_id: output token ids} of requests run together: [(prompt, adapter)]."""
    out, names = {}, []
    for prompt, adapter in requests:
        rid = f"r{next(_ids)}"
        names.append(rid)
        engine.add_request(rid, prompt, GREEDY, lora=adapter)
    cached = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(t for c in o.outputs for t in c.token_ids)
            cached[o.request_id] = o.num_cached_tokens
    return [out[n] for n in names], [cached[n] for n in names]


def test_mixed_batch_equals_each_alone(adapter_dir):
    folder, modules = adapter_dir
    reference = LLM(str(BUILTIN), lora={"a": str(folder)})
    want_a = reference.generate(PROMPT, GREEDY, lora="a").token_ids
    want_base = reference.generate(PROMPT, GREEDY).token_ids
    assert want_a != want_base
    engine = LLMEngine(str(BUILTIN), device="cpu", max_num_seqs=4, enable_prefix_caching=False, enable_lora=True)
    engine.replace_lora("a", to_lora_adapter(modules, "a"))
    (got_a, got_base, got_a2), _ = run(engine, [(PROMPT, "a"), (PROMPT, None), (PROMPT, "a")])
    assert got_a == want_a and got_a2 == want_a and got_base == want_base


def test_prefix_cache_is_kept_apart_per_adapter_and_version(adapter_dir):
    _, modules = adapter_dir
    engine = LLMEngine(str(BUILTIN), device="cpu", max_num_seqs=4, enable_prefix_caching=True, enable_lora=True)
    engine.replace_lora("a", to_lora_adapter(modules, "a"))
    (base,), _ = run(engine, [(PROMPT, None)])
    (with_a,), (cached,) = run(engine, [(PROMPT, "a")])
    assert cached == 0 and with_a != base  # the base's blocks are not the adapter's
    (again,), (cached,) = run(engine, [(PROMPT, "a")])
    assert cached == 48 and again == with_a  # the adapter's own blocks are
    engine.replace_lora("a", to_lora_adapter(modules, "a"))  # a new version, the same name
    (_,), (cached,) = run(engine, [(PROMPT, "a")])
    assert cached == 0
    (after,), (cached,) = run(engine, [(PROMPT, None)])
    assert cached == 48 and after == base
    engine.replace_lora("a", None)
    assert engine.lora_names() == [] and engine.adapters.manager.slots == {}  # unused: gone from the model
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("late", PROMPT, GREEDY, lora="a")
