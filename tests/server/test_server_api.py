"""`ruvllm serve` end to end, driven by the official `openai` client: chat and completions,
streaming or not, n > 1, logprobs, usage, stop strings, seeds, the prefix cache; and
schemathesis, generating requests from the OpenAPI schema, finding no 5xx.

Greedy outputs are compared with `py_engine.backends.torch.LLM`, the single-sequence
reference path that shares no code with the batching engine's scheduler,
paged KV cache or batched sampler.
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from py_engine.backends.torch import LLM
from py_engine.sampling_params import SamplingParams
from tests.server.server_harness import API_KEY, Server, metric, no_traceback, running_server

CONVERSATIONS = [
    [{"role": "user", "content": "To be, or not to be"}],
    [{"role": "system", "content": "You speak like Hamlet."}, {"role": "user", "content": "What is the question?"}],
    [{"role": "user", "content": "Caf\u00e9 na\u00efve"}, {"role": "assistant", "content": "The slings"},
     {"role": "user", "content": "and arrows"}],
]
PROMPTS = ["To be, or not to be", "Whether 'tis nobler in the mind", "The heart-ache and the thousand", ""]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(model_dir, "--api-key", API_KEY, "--served-model-name", "tiny",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert no_traceback(srv.log()), srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def ref_chat(llm: LLM, messages, max_tokens: int, **params):
    prompt = llm.chat_prompt(messages)
    return llm.generate(prompt, SamplingParams.greedy(max_tokens=max_tokens, **params), add_special_tokens=False)


def test_models_lists_the_served_name(client, model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 128 and models[0].model_extra["root"] == "tiny"
    assert str(model_dir) not in client.models.list().model_dump_json()  # no disk paths for clients


def test_wrong_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401 and err.value.body["type"] == "authentication_error"


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_greedy_equals_reference(client, reference, messages):
    expected = ref_chat(reference, messages, 24)
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    choice = response.choices[0]
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert choice.finish_reason == expected.finish_reason
    usage = response.usage
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert response.id.startswith("chatcmpl-") and response.model == "tiny"


def test_chat_stream_equals_non_stream_with_usage(client, model_dir):
    kwargs = dict(model=str(model_dir), messages=CONVERSATIONS[1], max_completion_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_greedy_equals_reference_for_text_ids_and_batches(client, reference):
    expected = [reference.generate(p, SamplingParams.greedy(max_tokens=16)) for p in PROMPTS]
    batch = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in batch.choices] == [e.text for e in expected]
    assert batch.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    ids = client.completions.create(model="tiny", prompt=expected[0].prompt_token_ids, max_tokens=16, temperature=0)
    assert ids.choices[0].text == expected[0].text
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + expected[1].text


def test_completions_default_max_tokens_is_16(client, reference):
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 16 and response.choices[0].finish_reason == "length"


def test_n_choices_greedy_and_seeded(client):
    greedy = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1 and [c.index for c in greedy.choices] == [0, 1, 2]
    kwargs = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=7, n=4)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # four samples of a random model differ
    streamed = client.completions.create(**kwargs, stream=True)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in first.choices]


def test_chat_n_choices_stream(client):
    kwargs = dict(model="tiny", messages=CONVERSATIONS[0], max_tokens=10, temperature=1.0, seed=3, n=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert whole.usage.completion_tokens == 20 or any(c.finish_reason == "stop" for c in whole.choices)


def test_seeded_sampling_equals_reference(client, reference):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=123, max_tokens=20)
    expected = reference.generate(PROMPTS[2], params)
    response = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0.8,
                                         top_p=0.9, seed=123, extra_body={"top_k": 40})
    assert response.choices[0].text == expected.text


def test_chat_logprobs_match_reference(client, reference):
    messages = CONVERSATIONS[0]
    expected = ref_chat(reference, messages, 8, logprobs=3)
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids) == response.usage.completion_tokens
    for entry, sample in zip(content, expected.logprobs):
        assert entry.token == reference.tokenizer.decode([sample.token_id])
        assert math.isclose(entry.logprob, sample.logprob, abs_tol=1e-4)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy takes the most likely token
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)


def test_completion_logprobs_legacy_shape(client):
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    n = response.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top.get(token) is not None and logprob <= 0
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                         stream=True)
    tokens = [t for chunk in streamed for choice in chunk.choices for t in choice.logprobs.tokens]
    assert tokens == lp.tokens


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0).choices[0].text
    pairs = (full[i:i + 2] for i in range(3, len(full) - 2))
    stop = next((pair for pair in pairs if pair.strip() and "\ufffd" not in pair), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {full!r}")
    cut = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_prefix_cache_hit_shows_in_usage_and_metrics(client, server):
    prompt = " ".join(PROMPTS[:3]) * 2  # several full KV blocks
    before = metric(server.metrics(), "prefix_cache_hits_total")
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    after = server.metrics()
    assert metric(after, "prefix_cache_hits_total") >= before + 16
    assert 0 < metric(after, "prefix_cache_hit_rate") <= 1
    assert metric(after, "time_to_first_token_seconds_count") > 0


def test_schemathesis_finds_no_server_errors(server: Server, tmp_path: Path):
    """Property-based requests generated from /openapi.json; time-boxed so it stays under a minute. One
    worker: with two, hypothesis parses lambda sources in two threads at once, which CPython 3.11's ast
    module does not survive ("AST constructor recursion depth mismatch", a SystemError inside
    schemathesis, not a server error) once the schema has the Responses and Messages operations."""
    command = [str(Path(sys.executable).parent / "schemathesis"), "run", f"{server.url}/openapi.json",
               "--checks", "not_a_server_error", "--max-examples", "10", "--seed", "1", "--max-time", "30",
               "--phases", "coverage,fuzzing", "--workers", "1", "--request-timeout", "60",
               "--header", f"Authorization: Bearer {API_KEY}", "--generation-database", "none", "--no-color"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout
