"""`ruvllm serve --learning` end to end on the built-in model (a real server, the official openai client):
a session's corrections change that session's greedy answers and no other session's; a consolidation
is hot-swapped under running streams without dropping one; rollback serves the base again; a crash in
a learning thread is logged and serving goes on."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.paths import BUILTIN
from tests.server.server_harness import running_server

QUESTION = [{"role": "user", "content": "Who rules Zorbia?"}]
CORRECTION = "Queen Mab rules Zorbia."
CONFIG = {"gate": False, "micro_layers": 2, "micro_steps": 5, "micro_lr": 0.05, "consolidate_every": 0, "epochs": 1, "fisher_tokens": 256}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("witness")


@pytest.fixture(scope="module")
def server(tmp_path_factory, log_dir):
    config = tmp_path_factory.mktemp("cfg") / "sona.json"
    config.write_text(json.dumps(CONFIG))
    with running_server(BUILTIN, "--witness-log", str(log_dir), "--learning", "--learning-config", str(config),
                        "--max-concurrent", "16", log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, user=None, max_tokens=16):
    reply = client.chat.completions.create(model="tiny-shakespeare", messages=QUESTION, max_tokens=max_tokens,
                                           temperature=0, **({"user": user} if user else {}))
    return reply.id, reply.choices[0].message.content


def status(server):
    return httpx.get(f"{server.url}/v1/learning", timeout=30).json()


def wait_status(server, key, value, timeout=90.0):
    deadline = time.monotonic() + timeout
    while (state := status(server))[key] != value:
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    return state


def test_a_session_learns_and_no_other_session_changes(server, client):
    _, base = ask(client)
    assert ask(client, "alice")[1] == base and ask(client, "bob")[1] == base
    rid, _ = ask(client, "alice")  # bob saw alice's id: his correction must not train her adapter
    r = httpx.post(f"{server.url}/v1/feedback", json={"id": rid, "rating": -1, "correction": "Bob was here.",
                                                       "user": "bob"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "user", r.text
    for k in range(1, 4):
        rid, _ = ask(client, "alice")
        r = httpx.post(f"{server.url}/v1/feedback", json={"id": rid, "rating": -1, "correction": CORRECTION,
                                                           "user": "alice"})
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        wait_status(server, "updates", k)
    assert ask(client, "alice")[1].startswith("Queen Mab rules")
    assert ask(client, "bob")[1] == base
    assert ask(client)[1] == base
    state = status(server)
    assert state["sessions"] == 1 and state["errors"] == 0 and state["instant_update_ms"]["p50"] > 0
    metrics = server.metrics()
    assert metrics["ruvllm_learning_updates_total"] == 3 and metrics["ruvllm_learning_errors_total"] == 0
    assert metrics["ruvllm_witness_records_written_total"] >= 8


def test_consolidation_is_hot_swapped_under_running_streams(server, client, log_dir):
    results, errors = [], []

    def stream(i):
        try:
            chunks = list(client.chat.completions.create(
                model="tiny-shakespeare", messages=[{"role": "user", "content": f"Speak {i}"}], max_tokens=64,
                temperature=0.8, seed=i, stream=True, user=f"s{i % 3}", extra_body={"ignore_eos": True}))
            results.append(next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices))
        except Exception as exc:  # noqa: BLE001 (any failure fails the test below)
            errors.append(exc)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    r = httpx.post(f"{server.url}/v1/learning/consolidate")
    assert r.status_code == 202
    state = wait_status(server, "consolidations", 1)
    for t in threads:
        t.join(120)
    assert errors == [] and results == ["length"] * 8
    assert state["version"] == 1 and state["versions"] == [1] and state["errors"] == 0
    assert (log_dir / "adapters" / "sona-v1" / "adapter_config.json").is_file()
    rid, _ = ask(client, "carol")
    deadline = time.monotonic() + 20
    while not (lines := [json.loads(x) for p in log_dir.glob("witness-*.jsonl") for x in p.read_text().splitlines()
                         if rid in x]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert lines[0]["adapter"] == "sona-v1"


def test_rollback_serves_the_base_again(server, client):
    _, before = ask(client, "dave")
    r = httpx.post(f"{server.url}/v1/learning/rollback", json={"version": 0})
    assert r.status_code == 200 and r.json()["version"] is None
    _, base = ask(client, "erin")
    assert httpx.post(f"{server.url}/v1/learning/rollback", json={"version": 9}).status_code == 400
    assert httpx.post(f"{server.url}/v1/learning/rollback", json={"version": "1"}).status_code == 400
    assert httpx.post(f"{server.url}/v1/learning/rollback", json={"version": 1}).json()["version"] == 1
    assert ask(client, "dave")[1] == before
    assert base is not None


def test_a_crash_in_a_learning_thread_is_logged_and_serving_goes_on(tmp_path):
    prelude = ("import py_engine.learning.sona as s\n"
               "def boom(self, record):\n    raise RuntimeError('injected learning fault')\n"
               "s.Sona.learn = boom\n")
    with running_server(BUILTIN, "--witness-log", str(tmp_path / "w"), "--learning", log_dir=tmp_path,
                        prelude=prelude) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        rid, _ = ask(c, "alice", 4)
        assert httpx.post(f"{srv.url}/v1/feedback", json={"id": rid, "rating": 1, "user": "alice"}).status_code == 200
        state = wait_status(srv, "errors", 1)
        assert "injected learning fault" in state["last_error"] and state["alive"]
        assert ask(c, "alice", 4)[1] is not None and httpx.get(f"{srv.url}/health").status_code == 200
        assert "learning: the instant update of session 'alice' failed" in srv.log()


def test_learning_needs_a_witness_log(capsys):
    from ruvllm_cli.main import main

    assert main(["serve", "--learning"]) == 1
    assert "--learning needs --witness-log DIR" in capsys.readouterr().err
