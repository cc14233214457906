"""POST /v1/responses (OpenAI's Responses API) against a real `ruvllm serve` with the official openai
client: create and .stream() give the chat endpoint's greedy text for the same conversation
(instructions, previous_response_id, function_call / function_call_output items), tools with
streamed arguments that add up to the call's, text.format through responses.parse, GET / DELETE,
and a 400 naming the field for what the server does not do. The built-in model, with the
self-made Hermes-style template of the structured-outputs test; SmolLM2 is in test_server_smollm2."""
from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from tests.server.server_harness import API_KEY, Server, no_traceback, running_server
from tests.server.test_structured_outputs_http import REPO, TEMPLATE, WEATHER

pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
TOOLS = [{"type": "function", "name": "get_weather", "description": "w", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": WEATHER}}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("responses") / "tiny-shakespeare-tools"
    shutil.copytree(REPO / "py_engine" / "data" / "tiny-shakespeare", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with running_server(model, "--api-key", API_KEY, "--served-model-name", "tiny",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert no_traceback(srv.log()), srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat_text(client, messages, **kw) -> str:
    done = client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)
    return done.choices[0].message.content


def test_create_and_stream_equal_chat(client):
    for instructions, text in ((None, "Speak of love."), ("Answer as Juliet.", "Who art thou?")):
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
            {"role": "user", "content": text}]
        want = chat_text(client, messages, max_tokens=24)
        got = client.responses.create(model="tiny", instructions=instructions, input=text, max_output_tokens=24,
                                      temperature=0)
        assert got.output_text == want and got.object == "response" and got.id.startswith("resp_")
        cut = got.usage.output_tokens == 24
        assert got.status == ("incomplete" if cut else "completed")
        assert (got.incomplete_details.reason if cut else got.incomplete_details) == ("max_output_tokens" if cut
                                                                                     else None)
        with client.responses.stream(model="tiny", instructions=instructions, input=text, max_output_tokens=24,
                                     temperature=0) as stream:
            events = list(stream)
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == want and [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created"
        assert events[-1].type == ("response.incomplete" if cut else "response.completed")
        assert events[-1].response.output_text == want
    done = client.responses.create(model="tiny", input="Speak.", max_output_tokens=200, temperature=0)
    with client.responses.stream(model="tiny", input="Speak.", max_output_tokens=200, temperature=0) as stream:
        final = stream.get_final_response()  # needs response.completed: the model ended on its own
    assert done.status == final.status == "completed" and final.output_text == done.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", instructions="Be brief.", input="Speak of love.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="And of death?",
                                     max_output_tokens=12, temperature=0)
    # the earlier instructions are not carried over (OpenAI's rule), the turns are
    want = chat_text(client, [{"role": "user", "content": "Speak of love."},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And of death?"}], max_tokens=12)
    assert second.output_text == want and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert client.responses.delete(first.id) is None or True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", previous_response_id=first.id, input="x", max_output_tokens=2)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_calls_whole_streamed_and_sent_back(client):
    for seed in range(3):
        body = dict(model="tiny", input="Weather in Verona?", tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=80, temperature=1.0, extra_body={"seed": seed})
        done = client.responses.create(**body)
        (call,) = [o for o in done.output if o.type == "function_call"]
        assert done.status == "completed" and call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        with client.responses.stream(**body) as stream:
            events = list(stream)
            final = stream.get_final_response()
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        (streamed,) = [o for o in final.output if o.type == "function_call"]
        assert "".join(pieces) == streamed.arguments == call.arguments and len(pieces) > 2
    # the call and its output sent back as items: the chat conversation with tool_calls and a tool message
    items = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    got = client.responses.create(model="tiny", input=[{"role": "user", "content": "Weather?"}, *items],
                                  tools=TOOLS, max_output_tokens=16, temperature=0)
    want = chat_text(client, [{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [
                                  {"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": call.arguments}}]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}],
                     tools=CHAT_TOOLS, max_tokens=16)
    assert got.output_text == want


def test_text_format_parses_into_a_pydantic_object(client):
    for seed in range(2):
        done = client.responses.parse(model="tiny", input="Who art thou?", text_format=Person,
                                      max_output_tokens=120, temperature=1.0, extra_body={"seed": seed})
        assert done.status == "completed" and isinstance(done.output_parsed, Person)
    done = client.responses.create(model="tiny", input="Who?", text={"format": {"type": "json_object"}},
                                   max_output_tokens=150, extra_body={"seed": 1})
    if done.status == "completed":
        assert isinstance(json.loads(done.output_text), dict)


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning' items are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "only text parts"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input", "role must be"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "needs a name, arguments"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "text.format.type"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice must be"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"input": "x", "max_output_tokens": 0}, "max_tokens", "max_tokens"),
    ({}, "input", "required"),
])
def test_what_is_not_supported_is_a_400_naming_it(server, body, param, words):
    response = httpx.post(f"{server.url}/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
