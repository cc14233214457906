"""`ruvllm serve --witness-log DIR` end to end (a real uvicorn server, the official `openai` client):
each request and its response as a JSON line, rotated and bounded, no header or API key in it;
POST /v1/feedback joined to a logged completion, and every way to misuse it refused.

The server rotates at 8 KiB and keeps 3 files a stream, so a few dozen requests rotate it; it takes
10 feedbacks a second (bursts of 20).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.server_harness import API_KEY, Server, no_traceback, running_server
from tests.tiny_models import build_tiny_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SECRET_HEADER = "x-private-note"
SECRET_VALUE = "hunter2-in-a-header"
FILE_BYTES, FILES = 8192, 3


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("witness")


@pytest.fixture(scope="module")
def server(tmp_path_factory, log_dir):
    model = build_tiny_model(tmp_path_factory.mktemp("server") / "tiny-llama", "llama")
    with running_server(model, "--api-key", API_KEY, "--witness-log", str(log_dir), "--witness-log-file-size",
                        str(FILE_BYTES), "--witness-log-files", str(FILES), "--feedback-rate", "10",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert no_traceback(srv.log()), srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120,
                         default_headers={SECRET_HEADER: SECRET_VALUE})


def lines(log_dir: Path, prefix: str) -> list[dict]:
    out = []
    for path in sorted(log_dir.glob(f"{prefix}-*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def logged(log_dir: Path, rid: str, prefix: str = "witness", key: str = "id", timeout: float = 20.0) -> dict:
    """The line whose `key` is rid, once the writer thread has written it."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in lines(log_dir, prefix) if r.get(key) == rid]
        if found:
            assert len(found) == 1, found
            return found[0]
        assert time.monotonic() < deadline, f"{rid} not in the {prefix} log"
        time.sleep(0.1)


def test_chat_completion_is_witnessed(client, server, log_dir):
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "To be"}],
                                           max_tokens=6, temperature=0, user="alice")
    record = logged(log_dir, reply.id)
    assert record["type"] == "completion" and record["endpoint"] == "chat.completions"
    assert record["session"] == "alice" and record["model"] == "tiny-llama" and record["status"] == "ok"
    (prompt,) = record["prompts"]
    assert prompt["messages"] == [{"role": "user", "content": "To be"}]
    assert prompt["text"].startswith("<|im_start|>user\nTo be")
    assert len(prompt["token_ids"]) == reply.usage.prompt_tokens
    (out,) = record["outputs"]
    assert out["text"] == reply.choices[0].message.content
    assert len(out["token_ids"]) == reply.usage.completion_tokens
    assert out["finish_reason"] == reply.choices[0].finish_reason
    assert record["sampling"]["temperature"] == 0 and record["sampling"]["max_tokens"] == 6
    assert record["timings"]["total_s"] > 0 and record["timings"]["output_tokens"] == reply.usage.completion_tokens


def test_stream_and_legacy_completions_are_witnessed(client, log_dir):
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Or not"}],
                                            max_tokens=5, temperature=0.7, seed=3, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    record = logged(log_dir, chunks[0].id)
    assert record["session"] is None and record["outputs"][0]["text"] == text
    assert record["sampling"]["seed"] == 3 and record["timings"]["ttft_s"] is not None

    reply = client.completions.create(model="tiny-llama", prompt=["To be", "or not"], max_tokens=4, n=2,
                                      temperature=0, user="bob")
    record = logged(log_dir, reply.id)
    assert record["endpoint"] == "completions" and record["session"] == "bob"
    assert [p["text"] for p in record["prompts"]] == ["To be", "or not"]
    assert [o["text"] for o in record["outputs"]] == [c.text for c in sorted(reply.choices, key=lambda c: c.index)]


def test_session_name_is_bounded(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, user="u" * 300)
    assert err.value.body["param"] == "user"


def test_feedback_joins_the_logged_completion(client, server, log_dir):
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Speak"}],
                                           max_tokens=4, temperature=0, user="carol")
    logged(log_dir, reply.id)
    r = httpx.post(f"{server.url}/v1/feedback", headers=AUTH,
                   json={"id": reply.id, "rating": -1, "correction": "Speak, for I am bound to hear."})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text  # not carol's
    r = httpx.post(f"{server.url}/v1/feedback", headers=AUTH,
                   json={"id": reply.id, "rating": -1, "correction": "Speak, for I am bound to hear.", "user": "carol"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["completion_id"] == reply.id and body["session"] == "carol" and body["status"] == "logged"
    record = logged(log_dir, body["id"], "feedback")
    assert record["rating"] == -1 and record["correction"] == "Speak, for I am bound to hear."
    assert record["session"] == "carol" and record["prompt"]["messages"] == [{"role": "user", "content": "Speak"}]
    assert record["output"]["text"] == reply.choices[0].message.content
    again = httpx.post(f"{server.url}/v1/feedback", headers=AUTH, json={"id": reply.id, "rating": 1, "user": "carol"})
    assert again.status_code == 409, again.text
    assert httpx.post(f"{server.url}/v1/feedback", json={"id": reply.id, "rating": 1}).status_code == 401


@pytest.mark.parametrize("body,status,param", [
    ({"id": "chatcmpl-nope", "rating": 1}, 404, "id"),
    ({"id": "", "rating": 1}, 400, "id"),
    ({"id": "x" * 200, "rating": 1}, 400, "id"),
    ({"rating": 1}, 400, "id"),
    ({"id": "chatcmpl-nope"}, 400, "rating"),
    ({"id": "chatcmpl-nope", "rating": 2}, 400, "rating"),
    ({"id": "chatcmpl-nope", "rating": "1"}, 400, "rating"),
    ({"id": "chatcmpl-nope", "rating": True}, 400, "rating"),
    ({"id": "chatcmpl-nope", "rating": 1.0}, 400, "rating"),
    ({"id": "chatcmpl-nope", "rating": 1, "correction": 5}, 400, "correction"),
    ({"id": "chatcmpl-nope", "rating": 1, "correction": "  "}, 400, "correction"),
    ({"id": "chatcmpl-nope", "rating": 1, "correction": "x" * 9000}, 413, "correction"),
    ({"id": "chatcmpl-nope", "rating": 1, "comment": "nice"}, 400, "comment"),
    ({"id": "chatcmpl-nope", "rating": 1, "choice": -1}, 400, "choice"),
    ([1, 2], 400, None),
])
def test_feedback_refusals(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/feedback", headers=AUTH, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_feedback_on_a_choice_the_completion_lacks(client, server, log_dir):
    reply = client.completions.create(model="tiny-llama", prompt="To be", max_tokens=2, temperature=0)
    logged(log_dir, reply.id)
    r = httpx.post(f"{server.url}/v1/feedback", headers=AUTH, json={"id": reply.id, "rating": 1, "choice": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "choice"


def test_log_is_rotated_bounded_and_holds_no_secrets(client, server, log_dir):
    for i in range(30):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": f"line {i}"}],
                                       max_tokens=8, temperature=0, user="dora")
    deadline = time.monotonic() + 20
    while not any(r.get("prompts", [{}])[0].get("messages", [{}])[0].get("content") == "line 29"
                  for r in lines(log_dir, "witness")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    files = sorted(log_dir.glob("witness-*.jsonl"))
    assert 2 <= len(files) <= FILES, files  # rotated, and the oldest deleted
    assert int(files[-1].stem.split("-")[1]) > FILES  # more files were written than are kept
    assert all(f.stat().st_size <= FILE_BYTES + 4096 for f in files)
    everything = "".join(p.read_text() for p in log_dir.iterdir())
    for secret in (API_KEY, SECRET_VALUE, SECRET_HEADER, "Bearer", "authorization"):
        assert secret.lower() not in everything.lower(), secret


def test_feedback_flood_is_refused_and_the_server_goes_on(client, server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        statuses = [http.post("/v1/feedback", json={"id": f"cmpl-{i}", "rating": 1}).status_code for i in range(80)]
    assert set(statuses) <= {404, 429} and statuses.count(429) >= 10, statuses  # 10/s, bursts of 20
    assert httpx.get(f"{server.url}/health").status_code == 200
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "still?"}],
                                           max_tokens=2)
    assert reply.choices[0].message.content is not None
