"""Speculative decoding in the engine (LLM(speculative=...)): the same output as without it.

Greedy: every proposer (prompt lookup, a draft model) and k = 1..8 give the tokens, text, finish reason and
logprobs of plain decoding on the built-in model in fp32, int8 and int4 and on SmolLM2's Q4_1 file; with
penalties, a logit bias, structured outputs, stop strings and max_tokens too. Seeded sampling with prompt lookup
replays plain sampling token for token (it draws the same uniforms). The unit parts (config, n-gram lookup,
the throttle) are checked on exact values. The distribution of sampled output: test_speculative_distribution.py.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from py_engine import LLM, SamplingParams  # noqa: E402
from py_engine.guided.params import StructuredOutputsParams  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.speculative import NgramLookup, SpeculativeConfig, SpeculativeConfigError, Throttle  # noqa: E402
from tests.requires import kernels_missing  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))
# Text that repeats (prompt lookup finds its n-grams) and text that does not.
PROMPTS = ["ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft, what light",
           "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"]


def test_config_fields_and_errors():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (
        "ngram", 6, 5, 2)
    assert SpeculativeConfig.parse("ngram", 3).num_speculative_tokens == 3
    draft = SpeculativeConfig.parse({"model": "some/draft"})
    assert (draft.method, draft.model) == ("draft_model", "some/draft")
    assert SpeculativeConfig.parse(None) is None
    for bad, field in [({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
                       ({"method": "medusa"}, "method"), ({"method": "ngram", "model": "x"}, "model"),
                       ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
                       ({"method": "ngram", "speculative_model": "x"}, "speculative_model"),
                       ({"method": "draft_model"}, "model"), ({"method": "ngram", "acceptance_floor": 2}, "acceptance_floor"),
                       ("{not json", "json")]:
        with pytest.raises(SpeculativeConfigError) as error:
            SpeculativeConfig.parse(bad)
        assert error.value.field == field


def test_ngram_lookup_proposes_the_latest_longest_match():
    lookup = NgramLookup([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], max_n=3, min_n=1)
    assert lookup.propose(3) == [4, 9, 2]  # 1 2 3 occurred once before: what followed it
    lookup.extend([5])  # ... 2 3 5: "3 5" (n = 2) occurred at 6-7, followed by 7 1 2
    assert lookup.propose(3) == [7, 1, 2]
    assert lookup.propose(1) == [7]
    lookup.extend([8])  # 8 never occurred before
    assert lookup.propose(4) == []
    assert NgramLookup([6, 6, 6], max_n=2, min_n=2).propose(4) == [6]  # a run: its continuation is the last token
    assert NgramLookup([1, 2], max_n=3, min_n=2).propose(2) == []
    with pytest.raises(ValueError):
        NgramLookup([], max_n=1, min_n=2)


def test_throttle_pauses_after_misses_and_backs_off():
    throttle = Throttle(0.3)
    assert throttle.allows()
    throttle.record(4, 0)
    assert throttle.pause == 0 and throttle.average == 0.375  # from the prior 0.5, a quarter of the way to 0
    throttle.record(4, 0)
    assert throttle.pause == 8 and throttle.average == 0.5  # 0.28 < 0.3: paused, judged afresh afterwards
    assert [throttle.allows() for _ in range(9)] == [False] * 8 + [True]
    throttle.record(4, 0), throttle.record(4, 0)
    assert throttle.pause == 16  # the next pause is twice as long
    throttle.pause = 0
    for _ in range(6):
        throttle.record(4, 4)  # acceptance back above twice the floor: the pause length resets
    throttle.record(4, 0), throttle.record(4, 0), throttle.record(4, 0), throttle.record(4, 0)
    assert throttle.pause == 8
    assert Throttle(0.0).allows()


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert a.text == b.text and a.finish_reason == b.finish_reason
    assert a.logprobs == b.logprobs


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_greedy_prompt_lookup_changes_no_token(quantization):
    plain = LLM("tiny-shakespeare", quantization=quantization)
    drafted = 0
    for k in range(1, 9):
        spec = LLM("tiny-shakespeare", quantization=quantization,
                   speculative={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                "acceptance_floor": 0})
        for prompt in PROMPTS:
            params = SamplingParams(temperature=0, max_tokens=48, logprobs=2 if k == 3 else None)
            a, b = plain.generate(prompt, params), spec.generate(prompt, params)
            _same(a, b)
            drafted += b.speculative["num_draft_tokens"]
            assert b.speculative["num_accepted_tokens"] <= b.speculative["num_draft_tokens"]
    assert drafted > 100  # the lookup did propose, and the verify passes did reject some


@needs_kernels
def test_greedy_with_penalties_bias_grammar_stops_and_limits():
    plain = LLM("tiny-shakespeare")
    spec = LLM("tiny-shakespeare", speculative={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                                                "acceptance_floor": 0})
    romeo = plain.tokenizer.encode(" Romeo", add_special_tokens=False)[0]
    cases = [SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
             SamplingParams(temperature=0, max_tokens=40, frequency_penalty=0.8, presence_penalty=0.5),
             SamplingParams(temperature=0, max_tokens=40, logit_bias={romeo: 5.0}),
             SamplingParams(temperature=0, max_tokens=7),  # ends inside a step's accepted drafts
             SamplingParams(temperature=0, max_tokens=60, stop=("Romeo", "\n\n")),
             SamplingParams(temperature=0, max_tokens=60, stop_token_ids=(14,)),
             SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(
                 regex="(ROMEO|JULIET): [a-z ]{3,20}\\.")),
             SamplingParams(temperature=0, max_tokens=30, speculative=False)]
    for params in cases:
        for prompt in PROMPTS:
            a, b = plain.generate(prompt, params), spec.generate(prompt, params)
            _same(a, b)
    assert spec.generate(PROMPTS[0], cases[-1]).speculative["num_drafts"] == 0  # the request opted out


@needs_kernels
def test_seeded_sampling_with_prompt_lookup_replays_plain_sampling():
    plain = LLM("tiny-shakespeare")
    spec = LLM("tiny-shakespeare", speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                                "acceptance_floor": 0})
    accepted = 0
    for seed in range(4):
        params = SamplingParams(temperature=0.7, top_p=0.9, seed=seed, max_tokens=40)
        a, b = plain.generate(PROMPTS[seed % 3], params), spec.generate(PROMPTS[seed % 3], params)
        _same(a, b)
        accepted += b.speculative["num_accepted_tokens"]
    assert accepted > 0


@needs_kernels
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_draft_model_changes_no_token(k):
    """The built-in model drafting for itself in int4: a draft with the target's vocabulary that mostly agrees."""
    plain = LLM("tiny-shakespeare")
    spec = LLM("tiny-shakespeare", speculative={"model": "tiny-shakespeare", "quantization": "int4",
                                                "num_speculative_tokens": k, "acceptance_floor": 0})
    for prompt in PROMPTS[:2]:
        a, b = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40)), spec.generate(
            prompt, SamplingParams(temperature=0, max_tokens=40))
        _same(a, b)
        assert b.speculative["num_accepted_tokens"] > 0


@needs_kernels
def test_smollm2_q4_1_greedy_prompt_lookup_k_1_to_8():
    pytest.importorskip("gguf")
    from tests.importers.smollm2_file import smollm2_path

    smollm2_path()
    plain = LLM("smollm2-135m-instruct")
    question = [{"role": "user", "content": "Copy the following text exactly: The committee met on Tuesday to review "
                                            "the budget for the new library building."}]
    prompt = plain.chat_prompt(question)
    expected = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40), add_special_tokens=False)
    for k in (1, 2, 4, 8):
        spec = LLM("smollm2-135m-instruct", speculative={"method": "ngram", "num_speculative_tokens": k,
                                                         "acceptance_floor": 0})
        got = spec.generate(prompt, SamplingParams(temperature=0, max_tokens=40), add_special_tokens=False)
        _same(expected, got)
        assert got.speculative["num_accepted_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_one_clear_error(tmp_path):
    pytest.importorskip("transformers")
    from tests.tiny_models import build_tiny_model

    other = build_tiny_model(tmp_path / "other")
    with pytest.raises(ValueError, match="another vocabulary"):
        LLM("tiny-shakespeare", speculative={"model": str(other)})


@needs_kernels
def test_speculation_refuses_what_it_could_change():
    with pytest.raises(ValueError, match="two-tier KV cache"):
        LLM("tiny-shakespeare", kv_cache_dtype="int8", speculative="ngram")
