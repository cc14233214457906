"""POST /v1/feedback: a rating (and maybe a better answer) for a logged completion.

    {"id": "chatcmpl-...", "rating": 1 | -1, "correction": "preferred assistant text", "choice": 0,
     "user": "the completion's user"}

The id must name a completion in the witness log (404 otherwise); the
feedback is joined to it (its prompt, its output, its session: the request's
OpenAI `user` field), written to the log's feedback stream, and handed to the
learner when the server learns (`--learning`). The rater's `user` must be the
completion's (both absent for a completion made without one): feedback trains
that session's adapter, so one session must not steer another's with an id it
saw. `user` is what the client says, not a credential (the API key is the
server's only one): the check keeps sessions apart, it does not authenticate
them. Refusals, each OpenAI-shaped:

    400  a bad shape: unknown fields, wrong types, rating not 1 or -1, empty correction, bad choice
    403  `user` is not the completion's
    404  the id is unknown (never logged, or rotated out of the log)
    409  the completion was rated already (one feedback per choice: training twice on one is a flood)
    413  the correction is longer than `max_correction_chars`
    429  too many feedbacks: over the server's rate, the session's rate, or the learner's queue is full

Rates are token buckets (`rate` per second, `burst` at once), one for the
server and one per session, so one client flooding cannot starve the rest.
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict

from native_server.api.errors import APIError
from native_server.api.protocol import Int, Str
from native_server.learning.witness_record import MAX_SESSION_CHARS

MAX_ID_CHARS = 128
DEFAULT_MAX_CORRECTION_CHARS = 8192
MAX_TRACKED = 100_000  # sessions with a bucket, rated choices remembered


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # our own endpoint: a misspelt field is a mistake worth a 400

    id: Str
    rating: Int
    correction: Optional[Str] = None
    choice: Int = 0
    user: Optional[Str] = None  # must be the completion's `user` (its session)


class FeedbackResponse(BaseModel):
    object: str = "feedback"
    id: str  # this feedback's own id
    completion_id: str
    session: str | None
    rating: int
    status: str  # "logged" | "queued" (for the learner)


class TokenBucket:
    """`rate` tokens a second up to `burst`; `take()` is False when empty."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.stamp = burst, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class FeedbackLimits:
    max_correction_chars: int = DEFAULT_MAX_CORRECTION_CHARS
    rate: float = 20.0  # the whole server, per second
    burst: float = 40.0
    session_rate: float = 2.0  # one session, per second
    session_burst: float = 10.0


@dataclass
class FeedbackDesk:
    """Checks, joins and routes feedback; `learner.submit(record) -> bool` (False: queue full) when learning."""

    witness: Any  # native_server.learning.witness.WitnessLog
    limits: FeedbackLimits = field(default_factory=FeedbackLimits)
    learner: Any = None

    def __post_init__(self) -> None:
        self.server_bucket = TokenBucket(self.limits.rate, self.limits.burst)
        self.session_buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.rated: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.accepted: OrderedDict[str, str | None] = OrderedDict()  # feedback id -> its session (DELETE)

    def check_shape(self, body: FeedbackRequest) -> None:
        if not body.id or len(body.id) > MAX_ID_CHARS:
            raise APIError(400, f"id: must be a completion id of 1 to {MAX_ID_CHARS} characters", "id")
        if body.rating not in (1, -1):
            raise APIError(400, f"rating: must be 1 (good) or -1 (bad), got {body.rating}", "rating")
        if body.correction is not None:
            if len(body.correction) > self.limits.max_correction_chars:
                raise APIError(413, f"correction: {len(body.correction)} characters is more than the "
                                    f"{self.limits.max_correction_chars} allowed", "correction")
            if not body.correction.strip():
                raise APIError(400, "correction: must not be empty (leave it out to only rate)", "correction")
        if body.user is not None and not 0 < len(body.user) <= MAX_SESSION_CHARS:
            raise APIError(400, f"user: must be 1 to {MAX_SESSION_CHARS} characters (the completion's `user`)", "user")
        if not 0 <= body.choice < 128:
            raise APIError(400, f"choice: must be a choice index in [0, 128), got {body.choice}", "choice")

    def _session_bucket(self, session: str) -> TokenBucket:
        bucket = self.session_buckets.get(session)
        if bucket is None:
            bucket = self.session_buckets[session] = TokenBucket(self.limits.session_rate, self.limits.session_burst)
            while len(self.session_buckets) > MAX_TRACKED:
                self.session_buckets.popitem(last=False)
        self.session_buckets.move_to_end(session)
        return bucket

    def accept(self, body: FeedbackRequest) -> FeedbackResponse:
        """Check, join, log and route one feedback (on the event loop: no blocking work but one line read)."""
        self.check_shape(body)
        if not self.server_bucket.take():
            raise APIError(429, "too many feedback requests to this server; retry later", code="rate_limited")
        completion = self.witness.lookup(body.id)
        if completion is None or completion.get("type", "completion") != "completion":
            raise APIError(404, f"id: no logged completion `{body.id[:MAX_ID_CHARS]}` (unknown, or rotated out "
                                "of the witness log)", "id", "not_found")
        outputs = completion.get("outputs") or []
        if body.choice >= len(outputs):
            raise APIError(400, f"choice: the completion has {len(outputs)} choice(s)", "choice")
        session = completion.get("session")
        if body.user != session:
            raise APIError(403, "user: the completion was made for another session; feedback must come with the "
                                "`user` the completion was requested with" if session is not None else
                                "user: the completion was made without a `user`; send feedback without one", "user",
                           "permission_denied")
        if session is not None and not self._session_bucket(session).take():
            raise APIError(429, "too many feedback requests for this session; retry later", code="rate_limited")
        key = (body.id, body.choice)
        if key in self.rated:
            raise APIError(409, f"id: choice {body.choice} of `{body.id}` was rated already", "id", "conflict")
        record = self._record(body, completion, outputs[body.choice])
        status = "logged"
        if self.learner is not None and (body.rating == 1 or body.correction is not None):
            if not self.learner.submit(record):
                raise APIError(429, "the learner's queue is full; retry later", code="rate_limited")
            status = "queued"
        self.rated[key] = None
        while len(self.rated) > MAX_TRACKED:
            self.rated.popitem(last=False)
        self.witness.record_feedback(record)
        self.accepted[record["id"]] = session
        while len(self.accepted) > MAX_TRACKED:
            self.accepted.popitem(last=False)
        return FeedbackResponse(id=record["id"], completion_id=body.id, session=session, rating=body.rating,
                                status=status)

    def owner(self, feedback_id: str, learner: Any) -> str | None:
        """DELETE /v1/feedback/{id}: the session a feedback was given in (None: without a `user`); 400 for a
        malformed id, 404 for one this server never took and its learner holds no pattern of."""
        if not feedback_id or len(feedback_id) > MAX_ID_CHARS:
            raise APIError(400, f"id: a feedback id of 1 to {MAX_ID_CHARS} characters", "id")
        if feedback_id in self.accepted:
            return self.accepted[feedback_id]
        found, session = learner.owner(feedback_id) if learner is not None else (False, None)
        if not found:
            raise APIError(404, f"id: no feedback `{feedback_id}` (unknown, deleted, or taken before a restart and "
                                "not learned from)", "id", "not_found")
        return session

    def forget(self, feedback_id: str, user: str | None, learner: Any) -> bool:
        """Check the caller's `user` is the feedback's session (403 otherwise, as for rating), then a deletion
        line in the log (no later replay trains on it); True when the learner held its pattern."""
        session = self.owner(feedback_id, learner)
        if user != session:
            raise APIError(403, "user: the feedback was given in another session; delete it with the `user` it was "
                                "given with" if session is not None else
                                "user: the feedback was given without a `user`; delete it without one", "user",
                           "permission_denied")
        learned = learner.forget(feedback_id) if learner is not None else False
        self.accepted.pop(feedback_id, None)
        self.witness.record_deletion(feedback_id)
        return learned

    @staticmethod
    def _record(body: FeedbackRequest, completion: dict[str, Any], output: dict[str, Any]) -> dict[str, Any]:
        prompts = completion.get("prompts") or [{}]
        n = max(1, len(completion.get("outputs") or []) // len(prompts))  # choice p * n + j: sample j of prompt p
        prompt = prompts[min(len(prompts) - 1, body.choice // n)]
        return {"id": f"fb-{uuid.uuid4().hex}", "created": round(time.time(), 3), "completion_id": body.id,
                "choice": body.choice, "session": completion.get("session"), "model": completion.get("model"),
                "adapter": completion.get("adapter"), "endpoint": completion.get("endpoint"),
                "rating": body.rating, "correction": body.correction, "prompt": prompt,
                "output": {"text": output.get("text", ""), "token_ids": output.get("token_ids", [])}}
