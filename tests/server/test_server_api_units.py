"""Unit tests of the native server's API layer that need no model: protocol, prompts, metrics, middleware.

The end-to-end tests (test_server_api*.py with a real `ruvllm serve`) cover the
same paths with the engine; these pin the rules at the boundary exactly.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from native_server.api.app import create_app
from native_server.api.context import ServerContext
from native_server.api.errors import APIError
from native_server.api.metrics import ServerMetrics, histogram_lines
from native_server.api.middleware import APIKey, IsolationHeaders
from native_server.engine.outputs import (CompletionOutput, EngineShutdownError, EngineStats, PromptTooLongError,
                                   QueueFullError, RequestOutput)
from native_server.engine.outputs import Histogram
from native_server.api.prompts import completion_prompts, fit_to_context, sampling_params
from native_server.api.protocol import ChatCompletionRequest, CompletionRequest
from native_server.api.request_body import RequestBody
from native_server.serve import parse_size
from py_engine.sampling_params import SamplingParams


# --- protocol -------------------------------------------------------------------------------------
def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields", [{"temperature": "0.5"}, {"n": True}, {"max_tokens": 1.5}, {"stream": 1},
                                    {"stop": 3}, {"messages": "hi"}, {"logit_bias": {"1": "x"}},
                                    {"messages": [{"role": "robot", "content": "x"}]}])
def test_chat_request_types_are_strict(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_unknown_fields_are_ignored_and_ints_pass_as_floats():
    request = chat(temperature=1, store=True, metadata={"a": 1}, reasoning_effort="low")
    assert request.temperature == 1.0 and not hasattr(request, "store")


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_shapes(prompt):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_completion_prompt_rejects_mixed_lists():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": ["a", 1]})


# --- prompts ----------------------------------------------------------------------------------------
def test_fit_to_context_rules():
    params = SamplingParams(max_tokens=None)
    assert fit_to_context(params, 100, 128, explicit_max_tokens=False, prompt_param="prompt").max_tokens == 28
    clamped = fit_to_context(SamplingParams(max_tokens=16), 120, 128, explicit_max_tokens=False, prompt_param="prompt")
    assert clamped.max_tokens == 8  # the default 16 of completions shrinks to the room left
    with pytest.raises(APIError) as err:
        fit_to_context(SamplingParams(max_tokens=50), 100, 128, explicit_max_tokens=True, prompt_param="prompt")
    assert err.value.status == 400 and "128" in err.value.message and "150" in err.value.message
    assert err.value.param == "max_tokens"
    with pytest.raises(APIError) as err:
        fit_to_context(params, 128, 128, explicit_max_tokens=False, prompt_param="messages")
    assert "128" in err.value.message and err.value.param == "messages"


def test_sampling_params_errors_name_the_field():
    with pytest.raises(APIError) as err:
        sampling_params(chat(temperature=-1), vocab_size=100)
    assert err.value.status == 400 and err.value.param == "temperature"
    with pytest.raises(APIError) as err:
        sampling_params(chat(logit_bias={"100": 1}), vocab_size=100)
    assert err.value.param == "logit_bias" and "100" in err.value.message
    with pytest.raises(APIError) as err:
        sampling_params(chat(logprobs=True, top_logprobs=21), vocab_size=100)
    assert err.value.param == "top_logprobs"
    assert sampling_params(chat(logprobs=True, top_logprobs=3), vocab_size=100).logprobs == 3


class _Tok:
    bos_token_id, eos_token_id = None, 7

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 for c in text]


@pytest.mark.parametrize("prompt,expected", [("ab", [[47, 48]]), ("", [[7]]), ([1, 2], [[1, 2]]),
                                             (["a", "b"], [[47], [48]]), ([[1], [2, 3]], [[1], [2, 3]])])
def test_completion_prompts(prompt, expected):
    request = CompletionRequest.model_validate({"prompt": prompt})
    assert completion_prompts(request, _Tok(), 100) == expected  # "" starts from EOS: _Tok has no BOS


@pytest.mark.parametrize("prompt", [[], [[]], [5, 100]])
def test_completion_prompts_refused(prompt):
    with pytest.raises(APIError) as err:
        completion_prompts(CompletionRequest.model_validate({"prompt": prompt}), _Tok(), 100)
    assert err.value.status == 400 and err.value.param == "prompt"


def test_model_names():
    """`model` may name the served model by its name or path (None: it), a LoRA adapter, else a 404."""
    ctx = ServerContext(_ScriptedEngine([]), "m", ("m", "/path/m"), Path("."), None)
    assert ctx.adapter_for(None) is None and ctx.adapter_for("/path/m") is None
    with pytest.raises(APIError) as err:
        ctx.adapter_for("gpt-4")
    assert err.value.status == 404 and err.value.code == "model_not_found"


# --- metrics ----------------------------------------------------------------------------------------
def test_histogram_buckets_are_cumulative_with_le_inclusive():
    hist = Histogram([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 5.0):
        hist.observe(value)
    assert histogram_lines("h", hist) == ['h_bucket{le="0.1"} 2', 'h_bucket{le="1"} 3', 'h_bucket{le="+Inf"} 4',
                                          "h_sum 5.65", "h_count 4"]


def _stats() -> EngineStats:
    ttft = Histogram()
    ttft.observe(0.02)
    return EngineStats(num_running=1, num_waiting=2, kv_blocks_total=10, kv_blocks_used=4, kv_blocks_cached=3,
                       kv_blocks_free=6, block_size=16, prefix_cache_hits=16, prefix_cache_queries=64,
                       prompt_tokens=5, generation_tokens=2, num_preemptions=1, ttft=ttft,
                       inter_token_latency=Histogram())


def test_metrics_text():
    metrics = ServerMetrics()
    metrics.record_finish('st"op', 0.5)
    lines = set(metrics.render(_stats()).splitlines())
    for line in ("# TYPE ruvllm_num_requests_running gauge", "ruvllm_num_requests_waiting 2",
                 "ruvllm_kv_cache_usage_perc 0.4", "ruvllm_prefix_cache_hit_rate 0.25",
                 "ruvllm_prompt_tokens_total 5", "ruvllm_generation_tokens_total 2", "ruvllm_num_preemptions_total 1",
                 'ruvllm_request_success_total{finished_reason="st\\"op"} 1',
                 'ruvllm_time_to_first_token_seconds_bucket{le="0.025"} 1',
                 "ruvllm_time_to_first_token_seconds_count 1", "ruvllm_inter_token_latency_seconds_count 0",
                 "# TYPE ruvllm_e2e_request_latency_seconds histogram", "ruvllm_e2e_request_latency_seconds_count 1"):
        assert line in lines, line


@pytest.mark.parametrize("text,expected", [("1024", 1024), ("512M", 512 << 20), ("2GiB", 2 << 30),
                                           ("1.5k", 1536), ("64MB", 64 << 20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


# --- middleware and the app shell -------------------------------------------------------------------
async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


def _wrapped(api_key: str | None = None) -> TestClient:
    app = Starlette(routes=[Route("/v1/x", _echo, methods=["POST"]), Route("/health", _echo, methods=["POST"])])
    return TestClient(IsolationHeaders(APIKey(RequestBody(app, max_bytes=100), api_key=api_key)))


def test_body_limit_by_length_and_by_stream():
    client = _wrapped()
    assert client.post("/v1/x", content=b"x" * 100).json() == {"size": 100}
    response = client.post("/v1/x", content=b"x" * 101)
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    chunked = client.post("/v1/x", content=iter([b"x" * 60, b"x" * 60]))  # no Content-Length
    assert chunked.status_code == 413


def test_api_key_guards_v1_only():
    client = _wrapped(api_key="k")
    assert client.post("/v1/x").status_code == 401
    assert client.post("/v1/x", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.post("/v1/x", headers={"Authorization": "Bearer k"}).status_code == 200
    denied = client.post("/v1/x")
    assert denied.headers["www-authenticate"] == "Bearer" and denied.json()["error"]["code"] == 401
    assert client.post("/health").status_code == 200


class _StubEngine:
    tokenizer, max_model_len = None, 128

    def __init__(self) -> None:
        self.started, self.stopped = False, None

    def start(self) -> None:
        self.started = True

    async def shutdown(self, timeout: float) -> None:
        await asyncio.sleep(0)
        self.stopped = timeout


def test_app_shell_static_files_headers_and_lifecycle(tmp_path: Path):
    (tmp_path / "index.html").write_text("<p>demo</p>")
    (tmp_path / "app.wasm").write_bytes(b"\0asm")
    (tmp_path / "main.mjs").write_text("export {}")
    engine = _StubEngine()
    ctx = ServerContext(engine, "m", ("m",), tmp_path, None)
    with TestClient(create_app(ctx, static_dir=tmp_path, shutdown_timeout=3)) as client:
        assert engine.started
        for path, media in (("/", "text/html"), ("/app.wasm", "application/wasm"), ("/main.mjs", "text/javascript")):
            response = client.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith(media)
            assert response.headers["cross-origin-opener-policy"] == "same-origin"
            assert response.headers["cross-origin-embedder-policy"] == "require-corp"
        missing = client.get("/v1/nothing")
        assert missing.status_code == 404 and "error" in missing.json()
        wrong = client.get("/v1/completions")  # an API path with the wrong method is not the files' 404
        assert wrong.status_code == 405 and "error" in wrong.json() and "POST" in wrong.headers["allow"]
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    assert engine.stopped == 3 and ctx.draining


# --- how engine outcomes reach the client -----------------------------------------------------------
class _ScriptedEngine(_StubEngine):
    """Yields a fixed list of RequestOutputs, raising any exception in it where it stands."""

    model_config = SimpleNamespace(vocab_size=100)

    def __init__(self, script: list) -> None:
        super().__init__()
        self.script, self.aborted = script, []

    async def generate(self, request_id, prompt_token_ids, params):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _out(text: str, reason: str | None) -> RequestOutput:
    return RequestOutput("r", [1], [CompletionOutput(0, text, [5] if text else [], reason, None)],
                         reason is not None, 0)


def _post(script: list, stream: bool) -> tuple[httpx.Response, _ScriptedEngine]:
    engine = _ScriptedEngine(script)
    with TestClient(create_app(ServerContext(engine, "m", ("m",), Path("."), None))) as client:
        return client.post("/v1/completions", json={"prompt": [1, 2], "stream": stream}), engine


def _events(response: httpx.Response) -> list:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("failure,status", [(_out("", "abort"), 503), (RuntimeError("boom"), 500),
                                            (EngineShutdownError("closing"), 503)])
def test_a_failure_mid_stream_ends_with_an_error_event_then_done(failure, status):
    response, engine = _post([_out("Hi", None), failure], stream=True)
    assert response.status_code == 200
    events = _events(response)
    assert events[0]["choices"][0]["text"] == "Hi"
    assert events[-1]["error"]["code"] in (status, "shutting_down") and len(events) == 2
    assert len(engine.aborted) == (0 if isinstance(failure, RequestOutput) else 1)  # aborted only if still live


@pytest.mark.parametrize("failure,status", [(QueueFullError("full"), 503), (ValueError("n is 9"), 400),
                                            (PromptTooLongError("200 > 128"), 400)])
def test_a_refusal_before_the_first_token_is_a_plain_error_response(failure, status):
    for stream in (False, True):
        response, _ = _post([failure], stream)
        assert response.status_code == status and response.headers["content-type"] == "application/json"
        assert "error" in response.json()


def test_an_abort_without_streaming_is_503():
    response, _ = _post([_out("Hi", None), _out("", "abort")], stream=False)
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]


def test_draining_refuses_new_requests_and_fails_health():
    ctx = ServerContext(_ScriptedEngine([]), "m", ("m",), Path("."), None)
    with TestClient(create_app(ctx)) as client:
        assert client.get("/health").status_code == 200
        ctx.draining = True
        assert client.get("/health").status_code == 503
        refused = client.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"


def test_health_is_503_when_the_engine_loop_died():
    engine = _ScriptedEngine([])
    ctx = ServerContext(engine, "m", ("m",), Path("."), None)
    with TestClient(create_app(ctx)) as client:
        assert client.get("/health").status_code == 200
        engine.dead_reason = lambda: "the engine stopped after an error: RuntimeError('kaput')"
        response = client.get("/health")
        assert response.status_code == 503 and "kaput" in response.json()["error"]["message"]
