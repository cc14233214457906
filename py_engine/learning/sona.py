"""`Sona`: the learning loops over one model, for `LLM` (offline) and the server (learner.py).

    sona = Sona.load("tiny-shakespeare", folder="runs/sona")     # or llm.learning(folder=...)
    sona.learn({"session": "alice", "prompt": {"token_ids": ids}, "rating": -1, "correction": "Paris."})
    sona.generate(prompt_ids, params, session="alice")           # the base + alice's MicroLoRA
    v = sona.consolidate()                                        # DIR/adapters/sona-v1, now current
    sona.rollback(0)                                              # back to the base

Instant loop (`learn`): a record with a session trains that session's
MicroLoRA for `micro_steps` steps on it, on top of the current consolidated
adapter; every trainable record also joins the replay buffer.
Background loop (`consolidate`): one LoRA trained from scratch on the whole
buffer with the EWC penalty, optionally with the session MicroLoRAs folded
in, saved as the next version.

With `config.gate` (the default) the instant loop is retrieval-gated
(recall.py): each record becomes a pattern with its own MicroLoRA, and a
request gets what the nearest pattern carries (`route`, `chat`), or the base
when none is near; consolidation trains on the patterns and keeps the gate.

Training runs on a float copy of the model (`load_model(dequantize=True)`,
never the CPU kernels or quantized layers, which have no gradients); what
the serving model applies is `adapter_for(session)`: {module: (A, B, scaling)}.
One lock serialises training; reading adapters never waits for it long.
"""
from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .config import SonaConfig
from .consolidate import consolidate_patterns
from .ewc import diagonal_fisher, load_fisher, save_fisher
from .lora import TrainableLora, applied, fold
from .objective import Example, example_from_feedback
from .recall import Recall, Route, clear_prefixes, with_context
from .store import AdapterStore
from .train import Anchors, TrainStats, freeze, train_lora

Modules = dict[str, tuple[Tensor, Tensor, float]]
MAX_REPLAY = 100_000


@dataclass(frozen=True)
class Update:
    """What one feedback did: the session it trained (None: only buffered) and how long it took."""

    session: str | None
    trained: bool
    seconds: float
    stats: TrainStats | None
    pattern: str | None = None  # the pattern it stored (with the gate)


@dataclass(frozen=True)
class Consolidation:
    version: int | None  # None without a folder (kept in memory only)
    examples: int
    seconds: float
    fisher_seconds: float
    stats: TrainStats
    folded_sessions: int


class Sona:
    def __init__(self, model: nn.Module, tokenizer: Any, eos_id: int | None, config: SonaConfig | None = None,
                 folder: str | Path | None = None, *, text_for_fisher: str | None = None,
                 base_name: str | None = None, chat: Any = None, embedder: Any = None) -> None:
        self.model = freeze(model)
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.config = config or SonaConfig()
        self.max_len = int(model.config.max_position_embeddings)
        self.base_name, self.text_for_fisher = base_name, text_for_fisher
        self.folder = Path(folder) if folder is not None else None
        self.store = AdapterStore(self.folder / "adapters") if self.folder is not None else None
        self.sessions: OrderedDict[str, TrainableLora] = OrderedDict()
        self.replay: list[dict[str, Any]] = []
        self.since_consolidation = 0
        self.consolidated: Modules | None = None
        self.version: int | None = None
        self.fisher: dict[str, Tensor] | None = None
        self.lock = threading.RLock()
        self.llm: Any = None  # an LLM generating with the adapters (for_llm)
        self._consolidating = threading.Lock()
        self._background: nn.Module | None = None
        self._keep_ids: list[int] | None = None
        if self.store is not None and (current := self.store.current()) is not None:
            self.consolidated, self.version = self.store.load(current), current
        self.recall = Recall(self.model, tokenizer, self.config, self.folder / "patterns" if self.folder else None,
                             chat, embedder) if self.config.gate else None

    @classmethod
    def load(cls, model: str | Path, config: SonaConfig | None = None, folder: str | Path | None = None,
             cache_dir: str | None = None, embedder: Any = None) -> "Sona":
        """A float copy of `model` (any name LLM takes) to train on."""
        from py_engine.chat import ChatTemplateError, load_chat_config
        from py_engine.config import GenerationConfig
        from py_engine.generate import eos_token_ids
        from py_engine.hub import resolve_model
        from py_engine.models import load_model
        from py_engine.tokenizer import Tokenizer

        path = resolve_model(str(model), cache_dir)
        net, mconfig = load_model(path, dtype="float32", dequantize=True)
        tokenizer = Tokenizer.from_pretrained(path)
        eos = eos_token_ids(GenerationConfig.from_model_dir(path), mconfig, tokenizer)
        validation = path / "validation.txt"
        text = validation.read_text(encoding="utf-8", errors="replace")[:1 << 20] if validation.is_file() else None
        try:
            chat = load_chat_config(path)
        except (ChatTemplateError, OSError, ValueError):
            chat = None  # no chat template: patterns apply their MicroLoRA, never as context
        return cls(net, tokenizer, eos[0] if eos else None, config, folder, text_for_fisher=text,
                   base_name=str(model), chat=chat, embedder=embedder)

    # --- the instant loop ------------------------------------------------------------------------------
    def example(self, record: dict[str, Any]) -> Example | None:
        return example_from_feedback(record, self.tokenizer, self.eos_id, self.config.max_target_tokens,
                                     self.max_len)

    def micro(self, session: str) -> TrainableLora:
        """The session's MicroLoRA (made on first use; the least recently used is dropped past max_sessions)."""
        lora = self.sessions.get(session)
        if lora is None:
            c = self.config
            lora = TrainableLora.for_model(self.model, c.target_modules, c.micro_layers, c.micro_rank, c.micro_alpha,
                                           seed=c.seed)
            self.sessions[session] = lora
            while len(self.sessions) > c.max_sessions:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(session)
        return lora

    def version_name(self, session: str | None) -> str | None:
        """What a request of `session` runs with, in words: "sona-v3", "session", "sona-v3+session", None."""
        with self.lock:
            parts = ([f"sona-v{self.version}" if self.version else "sona"] if self.consolidated else []) + \
                    (["session"] if session is not None and session in self.sessions else [])
        return "+".join(parts) or None

    def learn(self, record: dict[str, Any]) -> Update:
        """One feedback record (the witness log's shape): buffer it, and train its session's MicroLoRA."""
        start = time.perf_counter()
        example = self.example(record)
        if example is None:
            return Update(record.get("session"), False, time.perf_counter() - start, None)
        session = record.get("session")
        with self.lock:
            self.replay.append(record)
            del self.replay[:-MAX_REPLAY]
            self.since_consolidation += 1
            stats = None
            if self.recall is not None:
                with applied(self.model, self.consolidated):
                    pattern, stats = self.recall.teach(record, example, self.consolidated)
                return Update(session, True, time.perf_counter() - start, stats, pattern.id)
            if session is not None and self.config.micro_steps > 0:
                lora = self.micro(session)
                with applied(self.model, self.consolidated):
                    anchors = self._anchors(example)
                    stats = train_lora(self.model, lora, [example], steps=self.config.micro_steps,
                                       lr=self.config.micro_lr, anchors=anchors)
        return Update(session, stats is not None, time.perf_counter() - start, stats)

    def _anchors(self, example: Example) -> Anchors | None:
        """The latest other prompts in the buffer (any session's) with the distribution the base plus the
        consolidated adapter gives them: what a session's MicroLoRA must leave alone."""
        c = self.config
        if c.micro_anchors == 0 or c.micro_anchor_weight == 0:
            return None
        prompts: list[list[int]] = []
        for record in reversed(self.replay):
            ids = list((record.get("prompt") or {}).get("token_ids") or [])[-self.max_len:]
            if ids and ids != list(example.prompt_ids) and ids not in prompts:
                prompts.append(ids)
            if len(prompts) == c.micro_anchors:
                break
        return Anchors.of(self.model, prompts, c.micro_anchor_weight) if prompts else None

    def route(self, session: str | None, question: str) -> Route:
        """What a request of `session` asking `question` runs with (the gate); without the gate, the
        session's adapter on every request."""
        if self.recall is None:
            return Route(None, self.adapter_for(session), [])
        with self.lock:
            consolidated = self.consolidated
        return self.recall.route(session, question, consolidated)

    def pattern_adapter(self, pattern_id: str) -> Modules | None:
        """What a request that finds this (session) pattern runs with: its MicroLoRA over the consolidated."""
        pattern = self.recall.bank.get(pattern_id) if self.recall is not None else None
        if pattern is None:
            return None
        with self.lock:
            parts = [(1.0, m) for m in (self.consolidated, self.recall.lora_of(pattern)) if m]
        return None if not parts else parts[0][1] if len(parts) == 1 else fold(parts)

    def forget(self, pattern_id: str) -> bool:
        """Delete a pattern (a feedback's id): no request finds it again, no consolidation trains on it."""
        with self.lock:
            self.replay = [r for r in self.replay if r.get("id") != pattern_id]
            return self.recall is not None and self.recall.forget(pattern_id) is not None

    def due(self) -> bool:
        every = self.config.consolidate_every
        return every > 0 and self.since_consolidation >= every

    def adapter_for(self, session: str | None) -> Modules | None:
        """What a request of `session` runs with: the consolidated adapter and the session's MicroLoRA
        summed exactly (fold), either alone, or None (the base model)."""
        with self.lock:
            micro = self.sessions.get(session) if session is not None else None
            parts = ([(1.0, self.consolidated)] if self.consolidated else []) + \
                    ([(1.0, micro.adapter())] if micro is not None else [])
        if not parts:
            return None
        return parts[0][1] if len(parts) == 1 else fold(parts)

    # --- the background loop ---------------------------------------------------------------------------
    def fisher_ids(self) -> list[int]:
        """The base's own text: the model folder's validation text, else text it samples itself."""
        n = self.config.fisher_tokens
        if self.text_for_fisher:
            return self.tokenizer.encode(self.text_for_fisher[: 16 * n], add_special_tokens=False)[:n]
        return self._sampled_text(n)

    def keep_ids(self, model: nn.Module) -> list[int]:
        """What a gated consolidation keeps the base's predictions on: `keep_tokens` the base samples
        itself (on `model`, the background copy; made once), never the validation text."""
        from py_engine.backends.torch import TorchBackend
        from py_engine.generate import complete
        from py_engine.sampling_params import SamplingParams

        n = self.config.keep_tokens
        if self._keep_ids is None or len(self._keep_ids) < n:
            ids: list[int] = []
            start = self.tokenizer.encode("", add_special_tokens=True) or [self.eos_id or 0]
            backend = TorchBackend(model, model.config, self.max_len)
            while len(ids) < n:  # KV-cached sampling, 128 tokens from the start at a time
                params = SamplingParams(temperature=1.0, max_tokens=min(128, n - len(ids)), ignore_eos=True,
                                        seed=self.config.seed + len(ids))
                ids += list(complete(backend, self.tokenizer, start, params).token_ids) or [self.eos_id or 0]
            self._keep_ids = ids[:n]
        return self._keep_ids

    @torch.no_grad()
    def _sampled_text(self, n: int) -> list[int]:
        model = self.model
        gen, ids = torch.Generator().manual_seed(self.config.seed), []
        start = self.tokenizer.encode("", add_special_tokens=True) or [self.eos_id or 0]
        while len(ids) < n:
            seq = list(start)
            for _ in range(min(128, n - len(ids))):
                x = torch.tensor([seq[-self.max_len:]])
                logits = model(x, torch.arange(x.shape[1])[None], last_only=True)[0, -1]
                seq.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
            ids += seq[len(start):]
        return ids[:n]

    def fisher_for(self, names: Sequence[str], model: nn.Module | None = None) -> tuple[dict[str, Tensor], float]:
        """The base's diagonal Fisher for `names` (computed once, kept in DIR/fisher.safetensors)."""
        start = time.perf_counter()
        path = self.folder / "fisher.safetensors" if self.folder is not None else None
        if self.fisher is None and path is not None and path.is_file():
            self.fisher = load_fisher(path)
        if self.fisher is None or not set(names) <= set(self.fisher):
            self.fisher = diagonal_fisher(model or self.model, names, self.fisher_ids(), self.config.fisher_window)
            if path is not None:
                save_fisher(path, self.fisher)
        return self.fisher, time.perf_counter() - start

    def background_model(self) -> nn.Module:
        """The consolidation's own copy of the model: it trains while the instant loop trains on the other."""
        with self.lock:
            if self._background is None:
                self._background = freeze(copy.deepcopy(self.model))
            return self._background

    def consolidate(self, ewc_lambda: float | None = None) -> Consolidation:
        """Train one LoRA on every buffered feedback (EWC against the base), save it as the next version.

        Runs beside the instant loop (its own model copy; the lock is held only to take the buffer and
        to publish the result), one consolidation at a time."""
        c = self.config
        lam = c.ewc_lambda if ewc_lambda is None else ewc_lambda
        with self._consolidating:
            start = time.perf_counter()
            with self.lock:
                records = list(self.replay)
                self.since_consolidation = 0
                micro = {name: lora.adapter() for name, lora in self.sessions.items()} if c.fold_sessions > 0 else {}
                taught = self.recall.examples(self.max_len) if self.recall is not None else None
            model = self.background_model()
            if taught is not None:
                examples, pattern_ids = taught
            else:
                examples, pattern_ids = [e for r in records if (e := self.example(r)) is not None], []
            if taught is not None and examples and self.recall.trainer.fast:  # the patterns, the base kept
                lora, stats = consolidate_patterns(model, c, examples, self.keep_ids(model))
                fisher_s, lam = 0.0, 0.0
            else:
                lora = TrainableLora.for_model(model, c.target_modules, c.layers, c.rank, seed=c.seed)
                fisher, fisher_s = self.fisher_for(lora.names, model) if lam > 0 else (None, 0.0)
                stats = train_lora(model, lora, examples, epochs=c.epochs, batch_size=c.batch_size, lr=c.lr,
                                   fisher=fisher, ewc_lambda=lam, seed=c.seed)
            modules = lora.adapter()
            if micro:
                modules = fold([(1.0, modules)] + [(c.fold_sessions, m) for m in micro.values()])
            seconds = time.perf_counter() - start
            info = {"examples": len(examples), "ewc_lambda": lam, "rank": c.rank, "epochs": c.epochs,
                    "steps": stats.steps,
                    "first_loss": stats.first_loss, "last_loss": stats.last_loss, "seconds": seconds,
                    "folded_sessions": len(micro)}
            with self.lock:
                version = self.store.save(modules, info, self.base_name) if self.store is not None else None
                self.consolidated, self.version = modules, version
                if self.recall is not None:
                    self.recall.bank.promote(pattern_ids, version or 0)
                    clear_prefixes(self.recall)
                for name in micro:  # their updates now reach every session through the consolidated adapter
                    self.sessions.pop(name, None)
        return Consolidation(version, len(examples), seconds, fisher_s, stats, len(micro))

    def rollback(self, version: int | None) -> None:
        """Serve `version` of the consolidated adapter again (None or 0: the base model)."""
        if self.store is None:
            raise ValueError("rollback needs a folder of versions (Sona(..., folder=DIR))")
        with self.lock:
            self.store.rollback(version)
            self.consolidated = self.store.load(version) if version else None
            self.version = version or None
            if self.recall is not None:
                self.recall.bank.rollback(version)
                clear_prefixes(self.recall)

    # --- offline generation ----------------------------------------------------------------------------
    @classmethod
    def for_llm(cls, llm: Any, config: SonaConfig | None = None, folder: str | Path | None = None) -> "Sona":
        """The loops for an `LLM`: training on a float copy of its model, generating through the LLM itself,
        each session's adapter loaded into its LoraManager (`llm.generate(..., lora=sona.publish(session))`)."""
        sona = cls.load(llm.path, config, folder)
        sona.llm = llm
        return sona

    def publish(self, session: str | None) -> str | None:
        """Load what `session` runs with into the attached LLM's LoraManager ("sona/<session>", "sona");
        its name, or None (the base)."""
        return self._publish_modules("sona" if session is None else f"sona/{session}", self.adapter_for(session))

    def _publish_modules(self, name: str, modules: Modules | None) -> str | None:
        from py_engine.adapters import LoraManager

        from .lora import to_lora_adapter

        manager = getattr(self.llm.model, "lora", None) or LoraManager(self.llm.model)
        if name in manager.slots:
            manager.remove(name)
        if modules is None:
            return None
        manager.add(name, to_lora_adapter(modules, name, self.base_name))
        return name

    def chat(self, messages: list[dict[str, Any]], params: Any = None, session: str | None = None) -> Any:
        """A chat completion as the server gives it: the last user message routed through the gate, the
        nearest pattern's context put before it, its adapter applied."""
        question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
        route = self.route(session, question if isinstance(question, str) else "")
        text = self._render(with_context(messages, route.context))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._complete(ids, params, route.adapter)

    def _render(self, messages: list[dict[str, Any]]) -> str:
        from py_engine.chat import render_chat

        if self.recall is None or self.recall.chat is None:
            raise ValueError("Sona.chat needs the model's chat template")
        return render_chat(messages, self.recall.chat, add_generation_prompt=True)

    def generate(self, prompt_ids: Sequence[int], params: Any = None, session: str | None = None,
                 question: str | None = None) -> Any:
        """A completion with what `session` runs with: with the gate, the adapter of the pattern nearest
        `question` (default: the prompt decoded), else the session's adapter; through the attached LLM
        (for_llm), else on the training copy with the adapter's deltas hooked in."""
        if self.recall is not None:
            if question is None:
                question = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
            return self._complete(prompt_ids, params, self.route(session, question).adapter)
        if self.llm is not None:
            return self.llm.generate(list(prompt_ids), params, add_special_tokens=False, lora=self.publish(session))
        return self._complete(prompt_ids, params, self.adapter_for(session))

    def _complete(self, prompt_ids: Sequence[int], params: Any, modules: Modules | None) -> Any:
        from py_engine.backends.torch import TorchBackend
        from py_engine.generate import complete
        from py_engine.sampling_params import SamplingParams

        if self.llm is not None:
            return self.llm.generate(list(prompt_ids), params, add_special_tokens=False,
                                     lora=self._publish_modules("sona/route", modules))
        eos = [self.eos_id] if self.eos_id is not None else []
        with applied(self.model, modules):
            backend = TorchBackend(self.model, self.model.config, self.max_len)
            return complete(backend, self.tokenizer, list(prompt_ids), params or SamplingParams(temperature=0), eos)
