"""The retrieval gate in the request path (`--learning` with SonaConfig.gate, the default).

    name, context = await gated_route(ctx, session, question)   # before the prompt is rendered

A chat request's last user message (a completion's prompt text) is embedded
and matched against its session's and the global patterns (py_engine's
learning/recall.py): no pattern near, the base model; else the pattern's
adapter, by name, and for a chat the pattern as a previous exchange put
before the last user message. A pattern's adapter is `#sona/p/<id>` (its
MicroLoRA, the consolidated adapter folded in), published to the engine by
the instant thread as soon as it is trained (so the next request uses it)
and again on demand after an eviction (a consolidation or rollback retires them
all: their fold changed); a promoted (global) pattern uses its own adapter
too with `global_micro`, else the consolidated `#sona`. At most `max_sessions` pattern adapters are loaded
(least recently used out). The embedding runs off the event loop and is
skipped when the session and the global scope hold no pattern.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any, Callable

PATTERN_PREFIX = "#sona/p/"


class PatternSlots:
    """Which pattern adapters the engine holds (LRU); `publish(name, modules)` loads or retires one."""

    def __init__(self, publish_named: Any, limit: int) -> None:
        self.publish_named, self.limit = publish_named, limit  # learner.EngineSlots.publish_named
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()

    def publish(self, pattern_id: str, modules: Any) -> None:
        """From a learning thread: load (or, with None, retire) the pattern's adapter between two steps."""
        name = PATTERN_PREFIX + pattern_id
        self.publish_named(name, modules)
        with self.lock:
            if modules is None:
                self.loaded.pop(name, None)
                return
            self.loaded[name] = None
            self.loaded.move_to_end(name)
            gone = list(self.loaded)[:max(0, len(self.loaded) - self.limit)]
        for old in gone:
            self.retire(old)

    def retire(self, name: str) -> None:
        with self.lock:
            self.loaded.pop(name, None)
        self.publish_named(name, None)

    def retire_all(self) -> None:
        with self.lock:
            names = list(self.loaded)
        for name in names:
            self.retire(name)

    def has(self, name: str) -> bool:
        with self.lock:
            if name in self.loaded:
                self.loaded.move_to_end(name)
                return True
            return False


async def gated_route(ctx: Any, session: str | None,
                      question: str | Callable[[], str]) -> tuple[str | None, list[dict[str, str]]]:
    """The adapter name and the context messages a request runs with (None, [] when learning is off,
    the gate is off (then the session's adapter, as before), or no pattern is near). `question` may be a
    function: it is worked out only when the gate will ask (a token prompt is decoded only then)."""
    learner = getattr(ctx, "learner", None)
    if learner is None:
        return None, []
    sona = learner.sona
    if sona.recall is None:
        return (ctx.slots.name_for(session) if ctx.slots is not None else None), []
    if not sona.recall.gate.worth_asking(session):
        return None, []
    if callable(question):
        question = question()
    if not question:
        return None, []
    route = await asyncio.to_thread(sona.route, session, question)
    if route.match is None:
        return None, []
    name = None
    if route.adapter is not None:
        if not route.own:
            name = ctx.slots.name_for(None)  # the consolidated adapter, published on consolidation
        else:
            name = PATTERN_PREFIX + route.match.pattern.id
            if not learner.patterns.has(name):  # evicted, or demoted by a rollback: load it again
                await asyncio.to_thread(learner.patterns.publish, route.match.pattern.id, route.adapter)
    learner.gate_routes += 1
    return name, route.context


def log_adapter(ctx: Any, trace: Any, name: str | None) -> None:
    """Record in the request's witness line what it ran with under the gate: None (the base: no pattern
    near), "p/<pattern id>" (a pattern's MicroLoRA) or the consolidated version's name ("sona-vN")."""
    learner = getattr(ctx, "learner", None)
    if trace is None or learner is None or learner.sona.recall is None:
        return  # no log, or no gate: start_trace's name (the session's or the consolidated version) stands
    if name is None or name.startswith(PATTERN_PREFIX):
        trace.adapter = None if name is None else "p/" + name[len(PATTERN_PREFIX):]
    else:
        trace.adapter = learner.adapter_name(None)


def completion_question(ctx: Any, prompt: Any) -> str:
    """What a completion request is keyed by: its (first) prompt's text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        ids = first if isinstance(first, list) else prompt
        if all(isinstance(t, int) for t in ids):
            return ctx.tokenizer.decode(ids[-2048:], skip_special_tokens=True)
    return ""


def chat_question(messages: list[Any]) -> str:
    """A chat's last user message, as text."""
    for m in reversed(messages):
        if getattr(m, "role", None) == "user":
            content = getattr(m, "content", None)
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(getattr(p, "text", None) or (p.get("text", "") if isinstance(p, dict) else "")
                                for p in content)
    return ""
