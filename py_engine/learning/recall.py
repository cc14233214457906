"""Retrieval-gated learning: corrections as patterns, and what a request gets from the nearest one.

    recall = Recall(model, tokenizer, config, folder="DIR/patterns", chat=chat_config)
    pattern, stats = recall.teach(record, example)          # embed, train its MicroLoRA, store
    route = recall.route(session, question, consolidated)   # Route(match, adapter, context)
    recall.forget("fb-...")                                 # DELETE /v1/feedback/{id}

A `Route` is what one request runs with: nothing (no pattern near: the
base), or the nearest pattern's MicroLoRA (with the consolidated adapter
under it, when there is one), and/or the pattern as a previous exchange of
the chat (`context`: [user question, assistant answer], put before the
request's last user message). A pattern a consolidation promoted (global)
brings the consolidated adapter (trained on it) and, with `global_micro`, its
own MicroLoRA over it, in every session. The MicroLoRAs are kept as DIR/patterns/loras/<id>.safetensors
(and in memory, up to `LORAS_KEPT`), so a rollback can use them again.
"""
from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from .bank import BankConfig, Gate, Match, Pattern, PatternBank
from .config import SonaConfig
from .instant import InstantTrainer
from .lora import fold
from .objective import Example
from .train import TrainStats

Modules = dict[str, tuple[Tensor, Tensor, float]]
LORAS_KEPT = 512
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Route:
    match: Match | None = None
    adapter: Modules | None = None
    context: list[dict[str, str]] = field(default_factory=list)
    own: bool = False  # the adapter holds the pattern's own MicroLoRA (else: the consolidated alone)

    @property
    def name(self) -> str | None:
        """The adapter's name when served: "p/<pattern id>" (its MicroLoRA), "sona" (the consolidated), None."""
        if self.adapter is None or self.match is None:
            return None
        return f"p/{self.match.pattern.id}" if self.own else "sona"


def question_of(record: dict[str, Any], tokenizer: Any) -> str:
    """The text a feedback record's pattern is keyed by: the last user message of a chat, else the
    prompt's text, else its tokens decoded."""
    prompt = record.get("prompt") or {}
    for message in reversed(prompt.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):  # content parts: their text
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            if isinstance(content, str) and content.strip():
                return content
    if isinstance(prompt.get("text"), str) and prompt["text"].strip():
        return prompt["text"]
    return tokenizer.decode(list(prompt.get("token_ids") or []), skip_special_tokens=True)


def with_context(messages: list[dict[str, Any]], context: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The conversation with the context exchange put before its last user message."""
    if not context:
        return list(messages)
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages))
    return list(messages[:last]) + list(context) + list(messages[last:])


class Recall:
    def __init__(self, model: nn.Module, tokenizer: Any, config: SonaConfig, folder: str | Path | None = None,
                 chat: Any = None, embedder: Any = None) -> None:
        self.model, self.tokenizer, self.config, self.chat = model, tokenizer, config, chat
        self.folder = Path(folder) if folder is not None else None
        self.loras: OrderedDict[str, Modules] = OrderedDict()
        self.bank = PatternBank(BankConfig(max_patterns=config.max_patterns,
                                           max_per_session=config.max_patterns_per_session),
                                self.folder, on_drop=self._dropped)
        if embedder is None:
            from .bank.embed import HiddenStates, MiniLM

            embedder = MiniLM.load() if config.embedder == "minilm" else HiddenStates(model, tokenizer,
                                                                                    config.embed_layer)
        self.gate = Gate(self.bank, embedder, config.gate_threshold, use_keywords=config.gate_keywords)
        self.trainer = InstantTrainer(model, config)

    # --- teaching -------------------------------------------------------------------------------------
    def teach(self, record: dict[str, Any], example: Example,
              under: Modules | None = None) -> tuple[Pattern, TrainStats | None]:
        """Store the record as a pattern with its MicroLoRA (trained here when `apply` uses one) over `under`
        (the consolidated adapter, hooked into the model by the caller)."""
        question = question_of(record, self.tokenizer)
        embedding = self.gate.embed(question)
        stats, modules = None, None
        if self.config.apply != "context" and self.config.micro_steps > 0:
            lora, stats = self.trainer.train(example, under)
            modules = lora.adapter()
        pattern_id = str(record.get("id") or f"fb-{uuid.uuid4().hex}")
        answer = record.get("correction") or (record.get("output") or {}).get("text") or \
            self.tokenizer.decode(list(example.target_ids), skip_special_tokens=True)
        name = f"{_SAFE.sub('_', pattern_id)[:120]}.safetensors" if modules is not None else None
        if modules is not None:
            self._save(name, modules)
        pattern = self.bank.add(Pattern(id=pattern_id, session=record.get("session") or "", question=question,
                                        answer=answer, embedding=tuple(embedding),
                                        prompt_ids=tuple(example.prompt_ids), target_ids=tuple(example.target_ids),
                                        keywords=self.gate.keywords(question), lora=name))
        return pattern, stats

    def forget(self, pattern_id: str) -> Pattern | None:
        return self.bank.remove(pattern_id)

    # --- applying -------------------------------------------------------------------------------------
    def route(self, session: str | None, question: str, consolidated: Modules | None) -> Route:
        match = self.gate.match(session, question)
        if match is None:
            return Route()
        pattern, apply = match.pattern, self.config.apply
        context = [{"role": "user", "content": pattern.question}, {"role": "assistant", "content": pattern.answer}] \
            if apply in ("both", "context") and self.chat is not None else []
        adapter, own = None, None
        if apply in ("both", "lora"):
            if pattern.global_since is None or self.config.global_micro:
                own = self.lora_of(pattern)
            parts = [(1.0, m) for m in (consolidated, own) if m]
            adapter = None if not parts else parts[0][1] if len(parts) == 1 else fold(parts)
        elif apply == "context" and consolidated and pattern.global_since is not None:
            adapter = consolidated
        return Route(match, adapter, context, own is not None)

    def lora_of(self, pattern: Pattern) -> Modules | None:
        if pattern.lora is None:
            return None
        modules = self.loras.get(pattern.lora)
        if modules is None and self.folder is not None and (self.folder / "loras" / pattern.lora).is_file():
            modules = self._load(pattern.lora)
        if modules is not None:
            self.loras[pattern.lora] = modules
            self.loras.move_to_end(pattern.lora)
            while len(self.loras) > LORAS_KEPT:
                self.loras.popitem(last=False)
        return modules

    # --- consolidation --------------------------------------------------------------------------------
    def examples(self, max_len: int) -> tuple[list[Example], list[str]]:
        """Every pattern as the consolidation trains on it: as a request that finds it runs (with its
        context when `apply` adds one); and the pattern ids."""
        out, ids = [], []
        for pattern in list(self.bank.patterns.values()):
            prompt = list(pattern.prompt_ids)
            if self.config.apply in ("both", "context") and self.chat is not None:
                prompt = self.render(with_context([{"role": "user", "content": pattern.question}],
                                                  [{"role": "user", "content": pattern.question},
                                                   {"role": "assistant", "content": pattern.answer}]))
            prompt = prompt[-max(1, max_len - len(pattern.target_ids)):]
            if prompt and pattern.target_ids:
                out.append(Example(tuple(prompt), tuple(pattern.target_ids)))
                ids.append(pattern.id)
        return out, ids

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        from py_engine.chat import render_chat

        text = render_chat(messages, self.chat, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # --- files ----------------------------------------------------------------------------------------
    def _save(self, name: str, modules: Modules) -> None:
        self.loras[name] = modules
        if self.folder is None:
            return
        from safetensors.torch import save_file

        folder = self.folder / "loras"
        folder.mkdir(parents=True, exist_ok=True)
        tensors, meta = {}, {}
        for module, (A, B, scaling) in modules.items():
            tensors[f"{module}.A"], tensors[f"{module}.B"] = A.contiguous(), B.contiguous()
            meta[module] = repr(float(scaling))
        tmp = folder / f".{name}.partial"
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(folder / name)

    def _load(self, name: str) -> Modules:
        from safetensors import safe_open

        with safe_open(str(self.folder / "loras" / name), "pt") as f:
            meta = f.metadata() or {}
            return {m: (f.get_tensor(f"{m}.A"), f.get_tensor(f"{m}.B"), float(s)) for m, s in meta.items()
                    if m != "format"}

    def _dropped(self, pattern: Pattern) -> None:
        if pattern.lora is not None:
            self.loras.pop(pattern.lora, None)
            if self.folder is not None:
                (self.folder / "loras" / pattern.lora).unlink(missing_ok=True)


def clear_prefixes(recall: Recall | None) -> None:
    """The consolidated adapter changed: the kept prefix keys and values were computed under the old one."""
    if recall is not None:
        recall.trainer.prefixes.clear()
