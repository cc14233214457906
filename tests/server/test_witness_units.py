"""The witness log's files and the feedback desk without a server: rotation, bounds, the id index
rebuilt after a restart, a torn last line, per-session rate limits."""
from __future__ import annotations

import json

import pytest

from native_server.api.errors import APIError
from native_server.learning.feedback import FeedbackDesk, FeedbackLimits, FeedbackRequest, TokenBucket
from native_server.learning.witness import WitnessLog, log_size, read_lines


def completion(i: int, session: str | None = "s", pad: int = 200) -> dict:
    return {"id": f"cmpl-{i}", "session": session, "prompts": [{"text": "p" * pad, "token_ids": [1, 2]}],
            "outputs": [{"index": 0, "text": f"out {i}", "token_ids": [3, 4], "finish_reason": "stop"}]}


def test_rotation_keeps_the_newest_files_within_bounds(tmp_path):
    log = WitnessLog(tmp_path, max_file_bytes=2048, max_files=3)
    for i in range(100):
        log.record_completion(completion(i))
    log.close()
    files = sorted(tmp_path.glob("witness-*.jsonl"))
    assert len(files) == 3 and log_size(tmp_path) <= 3 * 2048
    ids = [r["id"] for _, _, r in read_lines(tmp_path, "witness")]
    assert ids == [f"cmpl-{i}" for i in range(100 - len(ids), 100)]  # the newest, in order
    assert log.lookup("cmpl-0") is None and log.lookup("cmpl-99")["outputs"][0]["text"] == "out 99"


def test_index_is_rebuilt_after_a_restart_and_a_torn_line_is_skipped(tmp_path):
    log = WitnessLog(tmp_path)
    for i in range(5):
        log.record_completion(completion(i))
    log.close()
    with open(next(tmp_path.glob("witness-*.jsonl")), "ab") as f:
        f.write(b'{"type": "completion", "id": "cmpl-torn", "outp')  # a crash mid-write
    again = WitnessLog(tmp_path)
    assert again.lookup("cmpl-3")["outputs"][0]["text"] == "out 3"
    assert again.lookup("cmpl-torn") is None
    again.record_completion(completion(7))
    assert again.lookup("cmpl-7")["id"] == "cmpl-7"  # known at once, before the writer thread gets to it
    again.close()


def test_bad_bounds_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        WitnessLog(tmp_path, max_file_bytes=10)


def test_token_bucket():
    now = [0.0]
    bucket = TokenBucket(rate=2, burst=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    now[0] = 0.5  # one token back
    assert [bucket.take() for _ in range(2)] == [True, False]


def test_one_session_flooding_does_not_starve_another(tmp_path):
    log = WitnessLog(tmp_path)
    for i in range(30):
        log.record_completion(completion(i, "flood" if i < 20 else "calm"))
    desk = FeedbackDesk(log, FeedbackLimits(rate=1000, burst=1000, session_rate=0.001, session_burst=5))
    codes = []
    for i in range(20):
        try:
            codes.append(desk.accept(FeedbackRequest(id=f"cmpl-{i}", rating=1, user="flood")).status)
        except APIError as exc:
            codes.append(exc.status)
    assert codes == ["logged"] * 5 + [429] * 15
    assert desk.accept(FeedbackRequest(id="cmpl-25", rating=-1, user="calm")).session == "calm"
    log.close()
    fb = [json.loads(line) for p in tmp_path.glob("feedback-*.jsonl") for line in p.read_text().splitlines()]
    assert len(fb) == 6 and {r["session"] for r in fb} == {"flood", "calm"}


class FullLearner:
    def submit(self, record) -> bool:
        return False


def test_a_full_learner_queue_is_a_429_and_the_feedback_can_be_sent_again(tmp_path):
    log = WitnessLog(tmp_path)
    log.record_completion(completion(1))
    desk = FeedbackDesk(log, learner=FullLearner())
    with pytest.raises(APIError) as err:
        desk.accept(FeedbackRequest(id="cmpl-1", rating=1, user="s"))
    assert err.value.status == 429
    assert desk.accept(FeedbackRequest(id="cmpl-1", rating=-1, user="s")).status == "logged"  # not trained: no queue
    log.close()


def test_only_the_completions_session_may_rate_it(tmp_path):
    """Feedback trains the session's adapter: an id seen by another session must not steer it."""
    log = WitnessLog(tmp_path)
    log.record_completion(completion(1, "alice"))
    log.record_completion(completion(2, None))
    desk = FeedbackDesk(log)
    for body in (dict(id="cmpl-1", rating=1), dict(id="cmpl-1", rating=1, user="mallory"),
                 dict(id="cmpl-2", rating=1, user="alice")):
        with pytest.raises(APIError) as err:
            desk.accept(FeedbackRequest(**body))
        assert (err.value.status, err.value.param) == (403, "user"), body
        assert "alice" not in str(err.value)
    with pytest.raises(APIError) as err:
        desk.accept(FeedbackRequest(id="cmpl-1", rating=1, user="a" * 257))
    assert (err.value.status, err.value.param) == (400, "user")
    assert desk.accept(FeedbackRequest(id="cmpl-1", rating=1, user="alice")).session == "alice"
    assert desk.accept(FeedbackRequest(id="cmpl-2", rating=1)).session is None
    log.close()
