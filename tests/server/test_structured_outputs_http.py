"""Structured outputs and tool calls against a real `ruvllm serve` (uvicorn), with the official
openai client: `beta.chat.completions.parse` with a Pydantic model, tools with tool_choice
required / named / auto (whole and streamed), vLLM's structured_outputs extras, and the 400s.

The model is the built-in one with a self-made Hermes-style chat template (so `auto` has a
syntax to parse); one server for the module."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest

from tests.server.server_harness import API_KEY, Server, no_traceback, running_server

pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
            "<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, "
            "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "t", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
USER = [{"role": "user", "content": "What is the weather in Verona?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    alive: bool
    title: str | None = pydantic.Field(default=None, max_length=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("guided") / "tiny-shakespeare-tools"
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


def _validate(arguments: str, schema: dict) -> dict:
    value = json.loads(arguments)
    jsonschema.validate(value, schema)
    return value


def test_parse_returns_a_pydantic_object(client):
    for seed in range(3):
        done = client.beta.chat.completions.parse(model="tiny", messages=USER, response_format=Person,
                                                  max_tokens=120, temperature=1.0, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_n_samples(client):
    done = client.chat.completions.create(model="tiny", messages=USER, max_tokens=150, n=3, seed=4,
                                          response_format={"type": "json_object"},
                                          extra_body={"structured_outputs": None})
    for choice in done.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_required_tools_return_calls_whose_arguments_validate(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        done = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                              max_tokens=150, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _validate(call.function.arguments, schemas[call.function.name])
        pieces: list = []
        streamed = _stream_calls(client, dict(tools=TOOLS, tool_choice="required", max_tokens=150, seed=seed),
                                 pieces)
        # argument by argument as generated, and exactly the whole response's arguments when put together
        assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(pieces) > 2 * len(streamed)


def test_one_call_without_parallel_tool_calls(client):
    """parallel_tool_calls false with tool_choice required: the grammar closes the array after the
    first call, so every seeded sampled request (T=1, max_tokens 80, as the issue's report) returns
    exactly one valid call; streamed, the pieces put together are the same call."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(8):
        body = dict(tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0, seed=seed,
                    parallel_tool_calls=False)
        done = client.chat.completions.create(model="tiny", messages=USER, **body)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        (call,) = choice.message.tool_calls
        _validate(call.function.arguments, schemas[call.function.name])
        assert _stream_calls(client, body) == [(call.function.name, call.function.arguments)]


def _stream_calls(client, kwargs, pieces: list | None = None) -> list[tuple[str, str]]:
    """The calls of a streamed response, put together as OpenAI's clients do: by index, the name
    from the piece that opens a call, the arguments concatenated (`pieces` collects them)."""
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model="tiny", messages=USER, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                if c.id is not None:
                    assert c.index not in calls and c.function.name and c.id.startswith("call_")
                    calls[c.index] = [c.function.name, ""]
                calls[c.index][1] += c.function.arguments or ""
                if pieces is not None:
                    pieces.append(c.function.arguments)
            finish = choice.finish_reason or finish
    assert finish == ("tool_calls" if calls else "stop"), finish
    return [tuple(calls[i]) for i in sorted(calls)]


def test_named_function_is_called(client):
    done = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=100, seed=1,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and done.choices[0].finish_reason == "tool_calls"
    _validate(call.function.arguments, WEATHER)


def test_auto_parses_the_template_syntax(client):
    """The model is made to write a Hermes call (a regex constrains it; tool_choice stays auto):
    the server reads it out of the text, whole and streamed, content before it kept."""
    text = 'Let me see.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    body = dict(tools=TOOLS, max_tokens=80, extra_body={"structured_outputs": {"regex": re.escape(text)}})
    done = client.chat.completions.create(model="tiny", messages=USER, **body)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls" and message.content == "Let me see."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_time",
                                                                                                  {"tz": "CET"})]
    assert _stream_calls(client, body) == [("get_time", message.tool_calls[0].function.arguments)]
    plain = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=8, seed=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_vllm_extras_and_completions(client):
    done = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=20, seed=3,
                                     extra_body={"structured_outputs": {"regex": r"[A-Z]{2,5}-\d{3}"}})
    assert re.fullmatch(r"[A-Z]{2,5}-\d{3}", done.choices[0].text)
    done = client.chat.completions.create(model="tiny", messages=USER, max_tokens=10,
                                          extra_body={"guided_choice": ["Verona", "Mantua"]})
    assert done.choices[0].message.content in ("Verona", "Mantua")
    cut = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                       "contentSchema": {}}}}},
     "response_format", "contentSchema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "text, json_object or json_schema"),
    ({"structured_outputs": {"regex": "(a)\\1"}}, "structured_outputs", "backreferences"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "'x' is used but not defined"),
    ({"grammar": 'root ::= "(" root ")"'}, "grammar", "no output of root ends"),
    ({"guided_grammar": "root ::= [a-"}, "guided_grammar", "unexpected end"),
    ({"grammar": ["root ::= x"]}, "grammar", "string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 3000, "maxLength": 9000}}}}, "response_format", "states"),
])
def test_bad_grammars_and_tools_are_400(server, body, param, words):
    import httpx

    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"messages": USER, "max_tokens": 5, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_gbnf_grammars_on_completions_and_chat(server, client):
    """llama.cpp's grammars on the server's `grammar` field: the seeded T=1 run of tests/gbnf_cases.py
    gives the texts LLM.generate gives, and each is a sentence (or a cut prefix) by llama.cpp's engine."""
    from py_engine import LLM, SamplingParams
    from py_engine.guided import StructuredOutputsParams
    from tests.gbnf_cases import GRAMMARS, MAX_TOKENS, PROMPT, SEEDS
    from tests.guided.llama_grammar import llama_grammar_checker

    check = llama_grammar_checker()
    llm = LLM("tiny-shakespeare", device="cpu")
    for name in ("arithmetic", "list"):
        grammar = GRAMMARS[name]
        got = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0,
                                         seed=seed, extra_body={"grammar": grammar}).choices[0] for seed in SEEDS]
        want = [llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                                                    structured_outputs=StructuredOutputsParams(grammar=grammar)))
                for seed in SEEDS]
        assert [(c.text, c.finish_reason) for c in got] == [(w.text, w.finish_reason) for w in want], name
        verdicts = check(grammar, [c.text for c in got])
        for c, verdict in zip(got, verdicts):  # a cut output: a prefix, or a sentence that could go on
            assert verdict in (("complete",) if c.finish_reason == "stop" else ("complete", "prefix")), name
    done = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60, temperature=1.0, seed=2,
                                          extra_body={"grammar": GRAMMARS["list"]})
    (verdict,) = check(GRAMMARS["list"], [done.choices[0].message.content])
    assert verdict in (("complete",) if done.choices[0].finish_reason == "stop" else ("complete", "prefix"))
