"""One request's witness line: what the handlers know up front, what `Generation` adds as it runs.

A `Trace` is made by the handler (id, model, adapter, session, the prompt's
ids and text, the sampling parameters) and handed to `Generation`, which adds
each choice's output and the timings, then `finish()`es it once the request
ends, however it ends (done, client gone, shutdown): the line says which.
Nothing here sees the HTTP request, so no header can reach the log.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from py_engine.sampling_params import SamplingParams

MAX_SESSION_CHARS = 256  # the OpenAI `user` field names a session; a longer one is a 400


def params_dict(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters as JSON values (logit_bias keys as strings, a grammar as its source)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name == "logit_bias":
            value = {str(k): v for k, v in value.items()}
        elif f.name == "structured_outputs" and value is not None:
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


@dataclass
class Trace:
    """A witness line in the making; `log` is the `WitnessLog` it goes to."""

    log: Any  # native_server.learning.witness.WitnessLog
    id: str
    endpoint: str  # "chat.completions" | "completions"
    model: str
    session: str | None
    prompts: list[dict[str, Any]]  # per prompt: {"token_ids", "text"} (+ "messages" for chat)
    params: dict[str, Any]
    adapter: str | None = None
    created: float = field(default_factory=time.time)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: bool = False

    def add(self, choice: int, text: str, token_ids: list[int], finish_reason: str | None) -> None:
        if self.first_token is None and token_ids:
            self.first_token = time.monotonic()
        c = self.choices.setdefault(choice, {"index": choice, "text": [], "token_ids": [], "finish_reason": None})
        c["text"].append(text)
        c["token_ids"] += token_ids
        c["finish_reason"] = finish_reason or c["finish_reason"]

    def finish(self, status: str) -> None:
        """Write the line once; `status` is "ok", "aborted" (client gone, shutdown) or "error"."""
        if self.done:
            return
        self.done = True
        end = time.monotonic()
        outputs = [{**c, "text": "".join(c["text"])} for _, c in sorted(self.choices.items())]
        if status == "ok" and any(c["finish_reason"] in (None, "abort") for c in outputs):
            status = "aborted"  # the engine's shutdown ended a choice
        n_out = sum(len(c["token_ids"]) for c in outputs)
        total = end - self.arrival
        self.log.record_completion({
            "id": self.id, "created": round(self.created, 3), "endpoint": self.endpoint, "model": self.model,
            "adapter": self.adapter, "session": self.session, "status": status, "prompts": self.prompts,
            "outputs": outputs, "sampling": self.params,
            "timings": {"total_s": round(total, 4),
                        "ttft_s": round(self.first_token - self.arrival, 4) if self.first_token else None,
                        "output_tokens": n_out,
                        "tokens_per_s": round(n_out / total, 2) if total > 0 and n_out else None}})


def start_trace(ctx: Any, request_id: str, endpoint: str, request: Any, prompts: list[dict[str, Any]],
                params: SamplingParams) -> Trace | None:
    """The trace of a request when the server keeps a witness log (None otherwise); the session is the
    request's `user` (at most MAX_SESSION_CHARS: a 400 beyond)."""
    if ctx.witness is None:
        return None
    session = session_of(request)
    learner = getattr(ctx, "learner", None)
    adapter = learner.adapter_name(session) if learner is not None else None
    return Trace(ctx.witness, request_id, endpoint, ctx.model_name, session, prompts, params_dict(params),
                 adapter=adapter)


def session_of(request: Any) -> str | None:
    """The request's session: its OpenAI `user` field (no `user`, no session)."""
    from native_server.api.errors import APIError

    user = getattr(request, "user", None)
    if user is not None and not 0 < len(user) <= MAX_SESSION_CHARS:
        raise APIError(400, f"user: a session name of 1 to {MAX_SESSION_CHARS} characters, got {len(user)}", "user")
    return user
