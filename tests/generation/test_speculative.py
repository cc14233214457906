"""Speculative decoding in the engine (LLM(speculative=...)): the same output as without it.

Greedy: every proposer (prompt lookup, a draft model) and k = 1..8 give the tokens, text, finish reason and
logprobs of plain decoding on the built-in model in fp32, int8 and int4 and on SmolLM2's Q4_1 file; with
penalties, a logit bias, structured outputs, stop strings and max_tokens too. Seeded sampling with prompt lookup
replays plain sampling token for token (it draws the same uniforms). The unit parts (config, n-gram lookup,
the draft length: DraftLength, StepCosts) are checked on exact values; the loop times its steps. The distribution of sampled output: test_speculative_distribution.py.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from py_engine import LLM, SamplingParams  # noqa: E402
from py_engine.guided.params import StructuredOutputsParams  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.speculative import (DraftLength, NgramLookup, SpeculativeConfig,  # noqa: E402
                                  SpeculativeConfigError, StepCosts)
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


def test_draft_length_drafts_as_far_as_it_pays():
    costs = StepCosts(4)
    assert costs.cost(0) == 1.0 and costs.cost(4) == pytest.approx(1.4)  # nothing timed: in decodes, optimistic
    costs.record(0, 0.010)
    assert costs.cost(2) == pytest.approx(0.012)  # one length timed: a tenth of a decode a row
    costs.record(4, 0.012)
    costs.record(4, 0.016)  # a moving average: a tenth of the way
    assert costs.seconds[4] == pytest.approx(0.0124)
    # two lengths timed: the line through them, a step of k drafts 0.010 + 0.0006 k
    assert [costs.cost(k) for k in range(5)] == pytest.approx([0.010, 0.0106, 0.0112, 0.0118, 0.0124])
    length = DraftLength(0.2, 4, costs)
    # p = 0.5: 1.75 tokens for 0.0112 s beat 1 for 0.010 and 1.5 for 0.0106; 1.875 for 0.0118 is not 2% better
    assert length.p == 0.5 and length.choose(10) == 2
    assert length.choose(1) == 1  # no more than the room left
    length.record(2, 0)  # a miss: (0.8 accepted, 2.6 tries): p = 0.31
    assert length.p == pytest.approx(0.8 / 2.6) and length.choose(10) == 1
    length.record(1, 0)
    length.record(1, 0)  # p = 0.512 / 3.464 = 0.148, below the floor: no drafts, then a probe after 8 steps
    assert length.p == pytest.approx(0.512 / 3.464)
    assert [length.choose(10) for _ in range(9)] == [0] * 8 + [4]  # the probe drafts as p = 0.8 would
    assert length.wait == 16  # the next probe waits twice as long ...
    length.record(2, 1)
    assert length.wait == 8  # ... unless this one paid
    by_match = DraftLength(0.2, 4, costs)  # prompt lookup: one estimate per length of the n-gram matched
    for _ in range(4):
        by_match.record(4, 4, key=4)  # a 4-gram's continuations kept ...
        by_match.record(4, 0, key=2)  # ... a 2-gram's rejected
    assert by_match.p_of(4) > 0.9 > 0.2 > by_match.p_of(2) and by_match.p == 0.5  # None: its own prior
    assert by_match.choose(10, key=4) == 4 and by_match.choose(10, key=2) == 0
    lookup = NgramLookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], max_n=3, min_n=2)
    assert lookup.propose(2) == [9, 2] and lookup.matched == 3
    lookup.extend([5, 2, 3])
    assert lookup.propose(2) == [5, 2] and lookup.matched == 2  # "2 3" last followed by 5
    lookup.extend([8])
    assert lookup.propose(2) == [] and lookup.matched is None
    noisy = StepCosts(4)
    for k, t in ((0, 0.010), (1, 0.012), (2, 0.011), (3, 0.030), (4, 0.014)):  # one slow step at k = 3
        noisy.record(k, t)
    assert noisy.cost(3) < noisy.seconds[3] / 1.5 and noisy.cost(4) < noisy.seconds[3]  # the line shares it out
    flat = StepCosts(2)
    flat.record(0, 0.020)
    flat.record(2, 0.010)  # noise says drafts are cheaper than none: never below the plain step
    assert flat.cost(2) == pytest.approx(0.015) == flat.cost(0)
    assert DraftLength(0.0, 4, StepCosts(4)).choose(10) == 4  # floor 0: always k
    drafting = StepCosts(4)
    drafting.record(3, 0.05)  # drafts were timed but no plain step yet: the next step is a plain one, timed
    assert DraftLength(0.2, 4, drafting).choose(10) == 0


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
def test_the_loop_times_its_steps_for_the_draft_length():
    plain, spec = LLM("tiny-shakespeare"), LLM("tiny-shakespeare", speculative="ngram")  # the default floor
    params = SamplingParams(temperature=0, max_tokens=48)
    for prompt in PROMPTS:
        _same(plain.generate(prompt, params), spec.generate(prompt, params))
    timed = [t for t in spec.speculation.costs.seconds if t is not None]
    assert timed and all(0 < t < 10 for t in timed)


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


@needs_kernels
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_with_speculation_is_transformers_greedy(tmp_path, proposer):
    """The reference itself: transformers' generate (do_sample=False) on a tiny random Llama, against ruvllm with
    prompt lookup (k = 4) or a draft model (the same model in int4, k = 3) on the CPU kernels."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_models import TEXT, build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny", "llama", seed=5, initializer_range=0.5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "acceptance_floor": 0} \
        if proposer == "ngram" else {"model": str(folder), "quantization": "int4", "num_speculative_tokens": 3,
                                     "acceptance_floor": 0}
    llm = LLM(str(folder), speculative=spec)
    counts = []
    for start in (0, 90, 200):
        ids = llm.tokenizer.encode(TEXT[start:start + 120], add_special_tokens=False)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                                   pad_token_id=0)[0, len(ids):].tolist()
        got = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        assert got.token_ids == expected
        counts.append((got.speculative["num_draft_tokens"], got.speculative["num_accepted_tokens"]))
    drafted, accepted = map(sum, zip(*counts))
    assert drafted > 0 and (accepted > 0 or proposer == "ngram")  # a random model seldom repeats its prompt
