"""Units of issue 33's server pieces: the Responses store's bounds, vLLM's metric names only when asked
for, Anthropic's error shape and x-api-key in the middleware."""
from __future__ import annotations

from starlette.testclient import TestClient

from native_server.api.metrics import ServerMetrics
from native_server.api.responses_store import ResponseStore
from tests.server.test_server_api_units import _stats, _wrapped


def test_the_store_is_bounded_by_count_and_size_least_recent_first():
    store = ResponseStore(max_items=3, max_chars=2_000)
    for i in range(4):
        assert store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and len(store) == 3
    store.get("r1")  # used: r2 is now the oldest
    store.put("big", {"id": "big"}, [{"role": "user", "content": "y" * 1_500}])
    assert store.get("r2") is None and store.get("r1") is not None and store.get("big") is not None
    assert not store.put("huge", {"id": "huge"}, [{"role": "user", "content": "z" * 3_000}])  # over the budget
    assert store.get("huge") is None
    assert store.delete("r1") and not store.delete("r1") and store.get("r1") is None


def test_vllm_names_only_when_asked_for():
    assert "vllm:" not in ServerMetrics().render(_stats())
    text = ServerMetrics("vllm", "m").render(_stats())
    assert 'vllm:num_requests_waiting{model_name="m"} 2' in text.splitlines()
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.4' in text.splitlines()


def test_x_api_key_and_anthropics_401():
    client: TestClient = _wrapped("k")
    assert client.post("/v1/x", content=b"{}", headers={"x-api-key": "k"}).status_code == 200
    assert client.post("/v1/x", content=b"{}", headers={"authorization": "Bearer k"}).status_code == 200
    refused = client.post("/v1/x", content=b"{}", headers={"x-api-key": "no"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def test_errors_on_anthropic_paths_take_its_shape():
    from native_server.api.errors import error_body

    assert error_body(400, "bad", "max_tokens", path="/v1/messages") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: bad"}}
    assert error_body(503, "busy", path="/v1/messages/count_tokens")["error"]["type"] == "overloaded_error"
    assert set(error_body(400, "bad", "x", path="/v1/responses")["error"]) == {"message", "type", "param", "code"}
