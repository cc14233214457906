"""`ruvllm serve --tensor-parallel-size 2` end to end: a real uvicorn server whose engine spans two processes,
checked with the official openai client against the one-process LLM (greedy chat, streamed and not, and
concurrent completions), with nothing of the server's process tree off loopback and a clean SIGTERM exit."""
from __future__ import annotations

import openai
import pytest

from py_engine import LLM, SamplingParams
from tests.net_sockets import non_loopback_sockets, process_tree
from tests.server.server_harness import greedy_completions, no_traceback, running_server

MESSAGES = [{"role": "user", "content": "Speak of love."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("tiny-shakespeare", "--tensor-parallel-size", "2", "--max-concurrent", "8",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert srv.stop() == 0
        assert no_traceback(srv.log()), srv.log()[-3000:]


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny-shakespeare")


def test_chat_streamed_and_whole(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    expected = reference.generate(reference.chat_prompt(MESSAGES), SamplingParams(temperature=0, max_tokens=32),
                                  add_special_tokens=False).text
    whole = client.chat.completions.create(model="tiny-shakespeare", messages=MESSAGES, temperature=0, max_tokens=32)
    assert whole.choices[0].message.content == expected
    stream = client.chat.completions.create(model="tiny-shakespeare", messages=MESSAGES, temperature=0,
                                            max_tokens=32, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_concurrent_completions(server, reference):
    prompts = ["ROMEO:", "JULIET:", "First Citizen:", "KING HENRY:", "HAMLET:", "MENENIUS:"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert greedy_completions(server, prompts, 24) == [reference.generate(p, params).text for p in prompts]


def test_server_and_worker_stay_on_loopback(server):
    pids = process_tree(server.process.pid)
    assert len(pids) >= 2, "the rank 1 worker is a child of the server"
    assert non_loopback_sockets(pids) == []
