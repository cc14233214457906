"""What the request handlers share: the engine, the served model's names and files, the metrics.

Built once per app from a started-or-not `AsyncEngine`; the chat template is
read here once (`load_chat_config`) rather than per request, and rendered by
the context's `TemplateRenderer` (worker processes). Also the one place
engine exceptions become API errors.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from native_server.api.errors import APIError
from native_server.api.grammars import GrammarCompiler
from native_server.api.logprobs import TokenTexts
from native_server.api.metrics import ServerMetrics
from native_server.engine.outputs import (AdapterNotFoundError, EngineError, EngineShutdownError, PromptTooLongError, QueueFullError,
                                   RequestFailedError)
from native_server.api.templates import DEFAULT_TIMEOUT as DEFAULT_TEMPLATE_TIMEOUT, TemplateRenderer
from py_engine.chat import ChatConfig, ChatTemplateError, load_chat_config

LEARNED_PREFIX = "#sona"  # the learning loops' adapters (learner.py): never listed, never named by clients
SHUTTING_DOWN = "the server is shutting down; retry on another replica or later"


@dataclass
class ServerContext:
    engine: Any  # native_server.engine.async_engine.AsyncEngine
    model_name: str  # the id /v1/models lists and responses carry
    accepted_names: tuple[str, ...]  # what `model` may say: the name first, then aliases and the path
    model_path: Path
    chat_config: ChatConfig | None  # None: the model has no chat template, /v1/chat/completions is a 400
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: new requests get a 503 while running ones finish
    templates: TemplateRenderer = field(default_factory=TemplateRenderer)  # renders in killable workers
    grammars: GrammarCompiler = field(default_factory=GrammarCompiler)  # compiles in killable workers, fairly
    allow_client_chat_template: bool = False  # run templates sent in requests (a documented risk)
    witness: Any = None  # native_server.learning.witness.WitnessLog with --witness-log
    feedback: Any = None  # native_server.learning.feedback.FeedbackDesk, with the witness log
    learner: Any = None  # native_server.learning.learner.Learner (the instant and background loops) with --learning
    slots: Any = None  # native_server.learning.learner.EngineSlots: which adapter a session's requests run with
    lora_dir: Path | None = None  # with --enable-runtime-lora: the only folder adapters may be loaded from
    max_lora_rank: int = 64
    responses: Any = None  # native_server.api.responses_store.ResponseStore, made on the first /v1/responses

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.engine.tokenizer)
        self._shutdown: asyncio.Future[None] | None = None

    def drain(self, timeout: float) -> asyncio.Future[None]:
        """Refuse new requests and shut the engine down, once, from the event loop.

        The engine lets running requests finish for up to `timeout` seconds and
        aborts the rest, so every stream ends (with its text or an error event)
        and the HTTP server can close its connections.
        """
        self.draining = True
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self.engine.shutdown(timeout))
        return self._shutdown

    @classmethod
    def for_engine(cls, engine: Any, model_path: Path, model_name: str, aliases: tuple[str, ...] = (), *,
                   allow_client_chat_template: bool = False, template_timeout: float = DEFAULT_TEMPLATE_TIMEOUT
                   ) -> ServerContext:
        try:
            chat_config: ChatConfig | None = load_chat_config(model_path)
        except (ChatTemplateError, OSError):
            chat_config = None
        names = tuple(dict.fromkeys((model_name, *aliases, str(model_path))))
        # A prompt renders to a few characters a token; past 64 a token it could only be refused as too long.
        max_chars = min(16 << 20, max(1 << 20, 64 * int(engine.max_model_len)))
        return cls(engine, model_name, names, model_path, chat_config,
                   templates=TemplateRenderer(template_timeout, max_chars),
                   allow_client_chat_template=allow_client_chat_template)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model_config.vocab_size)

    def adapter_for(self, requested: str | None) -> str | None:
        """The LoRA adapter `model` names, None for the served model (or omitted); 404 for anything else."""
        if requested is None or requested in self.accepted_names:
            return None
        names = self.public_lora_names()
        if requested in names:
            return requested
        adapters = f" or one of its LoRA adapters ({', '.join(names)})" if names else ""
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{self.model_name}`"
                            f"{adapters} (see GET /v1/models)", "model", "model_not_found")

    def public_lora_names(self) -> list[str]:
        """The adapters clients may name: not the learning loops' own (a session's adapter is its own)."""
        return [n for n in getattr(self.engine, "lora_names", lambda: [])() if not n.startswith(LEARNED_PREFIX)]

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, SHUTTING_DOWN)

    def check_chat(self) -> ChatConfig:
        if self.chat_config is None:
            raise APIError(400, f"the model `{self.model_name}` has no chat template; use /v1/completions",
                           "messages")
        return self.chat_config


def engine_error(exc: BaseException) -> APIError | None:
    """The API error for an exception the engine raises on purpose; None for anything else (a bug)."""
    if not isinstance(exc, EngineError):
        return None
    if isinstance(exc, QueueFullError):
        return APIError(exc.status_code, f"the server is busy: {exc}; retry later", code="queue_full")
    if isinstance(exc, AdapterNotFoundError):
        return APIError(404, f"{exc} (see GET /v1/models)", "model", "model_not_found")
    if isinstance(exc, PromptTooLongError):
        return APIError(exc.status_code, str(exc), "prompt", "context_length_exceeded")
    if isinstance(exc, EngineShutdownError):
        return APIError(exc.status_code, SHUTTING_DOWN, code="shutting_down")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"internal error while generating this request ({exc}); see the server log. "
                             "The server goes on serving other requests.", code="request_failed")
    return APIError(exc.status_code, f"the engine failed: {exc}")
