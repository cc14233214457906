"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) against a real `ruvllm serve`
with the official anthropic client: messages.create and messages.stream give the chat endpoint's
greedy text for the same conversation (system, turns, tool_use / tool_result), stop_sequences name
the one that matched, tools with tool_choice any stream their input piece by piece, count_tokens
counts what create bills, x-api-key is the key, and errors come in Anthropic's shape. The
built-in model with the self-made Hermes-style template; SmolLM2 is in test_server_smollm2."""
from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from tests.server.server_harness import API_KEY, Server, no_traceback, running_server
from tests.server.test_structured_outputs_http import REPO, TEMPLATE, WEATHER

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
TOOLS = [{"name": "get_weather", "description": "w", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": WEATHER}}]
GREEDY = {"temperature": 0}  # the anthropic client has no temperature argument any more: sent as an extra


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("messages") / "tiny-shakespeare-tools"
    shutil.copytree(REPO / "py_engine" / "data" / "tiny-shakespeare", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with running_server(model, "--api-key", API_KEY, "--served-model-name", "tiny",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert no_traceback(srv.log()), srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat_text(oai, messages, **kw):
    done = oai.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)
    return done.choices[0].message.content, done.choices[0].finish_reason, done.usage


def test_create_and_stream_equal_chat(client, oai):
    turns = [{"role": "user", "content": "Speak of love."}, {"role": "assistant", "content": "I will."},
             {"role": "user", "content": [{"type": "text", "text": "Then do."}]}]
    for system, messages in ((None, turns[:1]), ("Answer as Juliet.", turns)):
        chat_turns = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                       m["content"][0]["text"]} for m in messages]
        want, finish, use = chat_text(oai, ([{"role": "system", "content": system}] if system else []) + chat_turns,
                                      max_tokens=24)
        kwargs = dict(model="tiny", max_tokens=24, messages=messages, extra_body=GREEDY,
                      **({"system": system} if system else {}))
        done = client.messages.create(**kwargs)
        assert [b.type for b in done.content] == ["text"] and done.content[0].text == want
        assert done.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
        assert (done.usage.input_tokens, done.usage.output_tokens) == (use.prompt_tokens, use.completion_tokens)
        assert done.id.startswith("msg_") and done.role == "assistant" and done.model == "tiny"
        with client.messages.stream(**kwargs) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        assert final.content[0].text == want and final.stop_reason == done.stop_reason
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
        count = client.messages.count_tokens(model="tiny", messages=messages, **({"system": system} if system else {}))
        assert count.input_tokens == done.usage.input_tokens


def test_stop_sequences_say_which_matched(client):
    free = client.messages.create(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "Speak."}],
                                  extra_body=GREEDY).content[0].text
    stop = free[3:5]
    done = client.messages.create(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "Speak."}],
                                  stop_sequences=["qqq", stop], extra_body=GREEDY)
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == stop
    assert done.content[0].text == free[:free.index(stop)]
    with client.messages.stream(model="tiny", max_tokens=30, messages=[{"role": "user", "content": "Speak."}],
                                stop_sequences=["qqq", stop], extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_whole_streamed_and_answered(client, oai):
    for seed in range(3):
        kwargs = dict(model="tiny", max_tokens=80, tools=TOOLS,
                      tool_choice={"type": "any", "disable_parallel_tool_use": True},
                      messages=[{"role": "user", "content": "Weather in Verona?"}],
                      extra_body={"temperature": 1.0, "seed": seed})
        done = client.messages.create(**kwargs)
        (use,) = done.content
        assert done.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER)
        pieces = []
        with client.messages.stream(**kwargs) as stream:
            for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    pieces.append(event.delta.partial_json)
            final = stream.get_final_message()
        assert json.loads("".join(pieces)) == final.content[0].input == use.input and len(pieces) > 2
    named = client.messages.create(model="tiny", max_tokens=80, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"}], tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"seed": 1})
    assert named.content[0].type == "tool_use" and named.stop_reason == "tool_use"
    # the call and its result sent back: the chat conversation with tool_calls and a tool message
    arguments = json.dumps(use.input)
    got = client.messages.create(model="tiny", max_tokens=16, tools=TOOLS, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}])
    want, _, _ = chat_text(oai, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}], tools=CHAT_TOOLS, max_tokens=16)
    assert "".join(b.text for b in got.content if b.type == "text") == (want or "")


@pytest.mark.parametrize("body,kind,words", [
    ({"messages": [{"role": "user", "content": "x"}]}, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "invalid_request_error", "'image' blocks are not supported"),
    ({"max_tokens": 4, "messages": [{"role": "wizard", "content": "x"}]}, "invalid_request_error", "role must be"),
    ({"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "messages": [{"role": "user", "content": "x"}]}, "invalid_request_error", "thinking"),
    ({"max_tokens": 4, "tool_choice": {"type": "sometimes"}, "messages": [{"role": "user", "content": "x"}]},
     "invalid_request_error", "tool_choice"),
    ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "x"}]}, "invalid_request_error", "only client tools"),
    ({"max_tokens": 4, "model": "claude-opus-9", "messages": [{"role": "user", "content": "x"}]},
     "not_found_error", "does not exist"),
    ({"max_tokens": 100_000, "messages": [{"role": "user", "content": "x"}]}, "invalid_request_error",
     "max_tokens"),
])
def test_errors_in_anthropics_shape(server, body, kind, words):
    response = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY},
                          json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == (404 if kind == "not_found_error" else 400), response.text
    payload = response.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == kind and words in payload["error"]["message"], payload


def test_the_key_goes_in_x_api_key(server):
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    ok = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-api-key": API_KEY}, timeout=60,
                    json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert ok.status_code == 200
