"""The pattern store (the seeds' ReasoningBank): each correction or accepted answer, keyed by its question.

    bank = PatternBank(BankConfig(), folder="DIR/patterns")   # DIR: the witness log's folder
    bank.add(Pattern(id="fb-1", session="alice", question="Who rules Zorbia?", answer="Queen Mab.",
                     embedding=vector, ...))
    bank.search("alice", query_vector, k=1)       # [Match(pattern, similarity)], best first
    bank.promote(["fb-1"], version=3)             # now global: every session's requests find it
    bank.rollback(2)                              # what version 3 promoted is session-only again
    bank.remove("fb-1")                           # DELETE /v1/feedback/fb-1

Scopes: a pattern is its session's ("" for requests without a session) until a
consolidation promotes it; then it is global. A request searches its
session's index and the global one. Each scope is a `VectorIndex`.

Bounds: at most `max_patterns` in all and `max_per_session` per scope (the
oldest goes first); questions and answers are cut to `MAX_TEXT_CHARS`.

On disk (when a folder is given): `bank.jsonl`, one event a line (add,
remove, promote, rollback), replayed at start and rewritten whole (write,
then rename) once it holds twice the live patterns: so a crash loses at most
the line being written. What a pattern carries besides (its MicroLoRA) is
named in `lora` and kept by the owner beside this file (`on_drop` is called
for every pattern the bank lets go, so the owner can delete it).
Stdlib only (ring 0): the page can keep a bank too.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .index import EXACT_BELOW, VectorIndex

GLOBAL = None  # the scope key of promoted patterns
MAX_TEXT_CHARS = 4096
EVENTS_FILE = "bank.jsonl"


@dataclass(frozen=True)
class BankConfig:
    max_patterns: int = 4096
    max_per_session: int = 256
    exact_below: int = EXACT_BELOW  # a scope with fewer vectors is searched exactly
    index_backend: str = "auto"  # auto (faiss when installed, else exact), exact, faiss

    def __post_init__(self) -> None:
        for name in ("max_patterns", "max_per_session", "exact_below"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 24:
                raise ValueError(f"{name}: an integer in [1, 16777216], got {value!r}")


@dataclass(frozen=True)
class Pattern:
    id: str  # the feedback's id
    session: str  # the scope it was taught in ("": no session)
    question: str  # the text whose embedding keys it (the last user message, or the prompt)
    answer: str  # what the model should say instead (the correction, or the accepted output)
    embedding: tuple[float, ...]
    prompt_ids: tuple[int, ...] = ()
    target_ids: tuple[int, ...] = ()
    created: float = field(default_factory=time.time)
    global_since: int | None = None  # the consolidation version that promoted it (None: its session's only)
    lora: str | None = None  # the name of its MicroLoRA beside the bank (None: none)
    keywords: tuple[str, ...] = ()  # the names and rare words of its question (gate.keywords)
    key: int = -1  # its index key, given by the bank

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["embedding"] = [round(x, 7) for x in self.embedding]
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Pattern":
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}
        for name in ("embedding", "prompt_ids", "target_ids", "keywords"):
            raw[name] = tuple(raw.get(name) or ())
        return cls(**raw)


@dataclass(frozen=True)
class Match:
    pattern: Pattern
    similarity: float


class PatternBank:
    def __init__(self, config: BankConfig | None = None, folder: str | Path | None = None,
                 on_drop: Callable[[Pattern], None] | None = None) -> None:
        self.config = config or BankConfig()
        self.folder = Path(folder) if folder is not None else None
        self.on_drop = on_drop
        self.patterns: dict[str, Pattern] = {}  # by id, oldest first (insertion order)
        self.by_key: dict[int, str] = {}
        self.indexes: dict[str | None, VectorIndex] = {}
        self.next_key = 0
        self.dim: int | None = None
        self.lock = threading.RLock()
        self._events = 0
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._replay()

    # --- reading ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.patterns)

    def get(self, pattern_id: str) -> Pattern | None:
        return self.patterns.get(pattern_id)

    def scope(self, session: str | None) -> list[Pattern]:
        """A session's own patterns (not yet promoted), oldest first."""
        return [p for p in self.patterns.values() if p.session == (session or "") and p.global_since is None]

    def global_patterns(self) -> list[Pattern]:
        return [p for p in self.patterns.values() if p.global_since is not None]

    def sessions(self) -> set[str]:
        return {p.session for p in self.patterns.values() if p.global_since is None}

    def search(self, session: str | None, query: Sequence[float], k: int = 1,
               threshold: float = -1.0) -> list[Match]:
        """The `k` patterns nearest `query` among the session's and the global ones, at least `threshold`
        similar, best first."""
        with self.lock:
            hits: list[tuple[int, float]] = []
            for scope in (session or "", GLOBAL):
                index = self.indexes.get(scope)
                if index is not None:
                    hits += index.search(query, k)
            hits.sort(key=lambda h: -h[1])
            return [Match(self.patterns[self.by_key[key]], s) for key, s in hits[:k] if s >= threshold]

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"patterns": len(self.patterns), "global": sum(p.global_since is not None
                                                                  for p in self.patterns.values()),
                    "sessions": len(self.sessions()),
                    "index": {("global" if s is None else "sessions"): i.kind for s, i in self.indexes.items()}}

    # --- writing ----------------------------------------------------------------------------------------
    def add(self, pattern: Pattern) -> Pattern:
        """Store `pattern` (replacing one with its id); the oldest of its scope, then of all, go past the bounds."""
        if not pattern.embedding:
            raise ValueError("a pattern needs an embedding")
        with self.lock:
            if self.dim is None:
                self.dim = len(pattern.embedding)
            elif len(pattern.embedding) != self.dim:
                raise ValueError(f"embedding: {self.dim} numbers expected (the bank's), got {len(pattern.embedding)}")
            pattern = replace(pattern, question=pattern.question[-MAX_TEXT_CHARS:],
                              answer=pattern.answer[:MAX_TEXT_CHARS], key=self.next_key)
            if pattern.id in self.patterns:
                old = self.patterns[pattern.id]
                self._drop(pattern.id, log=True, notify=old.lora != pattern.lora)
            self._insert(pattern)
            self._log({"op": "add", "pattern": pattern.to_json()})
            scope = [p for p in self.patterns.values() if p.session == pattern.session and p.global_since is None]
            for old in scope[:max(0, len(scope) - self.config.max_per_session)]:
                self._drop(old.id, log=True)
            for old in list(self.patterns.values())[:max(0, len(self.patterns) - self.config.max_patterns)]:
                self._drop(old.id, log=True)
            return pattern

    def remove(self, pattern_id: str) -> Pattern | None:
        with self.lock:
            return self._drop(pattern_id, log=True) if pattern_id in self.patterns else None

    def promote(self, ids: Sequence[str], version: int) -> int:
        """Make these patterns global (a consolidation trained on them); how many were session patterns."""
        with self.lock:
            moved = [i for i in ids if i in self.patterns and self.patterns[i].global_since is None]
            for i in moved:
                self._move(i, version)
            if moved:
                self._log({"op": "promote", "ids": moved, "version": version})
            return len(moved)

    def rollback(self, version: int | None) -> int:
        """Patterns promoted after `version` (None or 0: all) are their sessions' only again; how many."""
        with self.lock:
            n = self._rollback(version or 0)
            self._log({"op": "rollback", "version": version or 0})
            return n

    def clear(self) -> None:
        with self.lock:
            for pattern_id in list(self.patterns):
                self._drop(pattern_id, log=False)
            self._compact()

    # --- internals --------------------------------------------------------------------------------------
    def _index(self, scope: str | None) -> VectorIndex:
        index = self.indexes.get(scope)
        if index is None:
            index = self.indexes[scope] = VectorIndex(self.dim or 1, self.config.exact_below,
                                                      self.config.index_backend)
        return index

    def _insert(self, pattern: Pattern) -> None:
        self.patterns[pattern.id] = pattern
        self.by_key[pattern.key] = pattern.id
        self.next_key = max(self.next_key, pattern.key + 1)
        self._index(GLOBAL if pattern.global_since is not None else pattern.session).add(pattern.key,
                                                                                        pattern.embedding)

    def _unindex(self, pattern: Pattern) -> None:
        scope = GLOBAL if pattern.global_since is not None else pattern.session
        index = self.indexes.get(scope)
        if index is not None:
            index.remove(pattern.key)
            if not len(index):
                del self.indexes[scope]

    def _drop(self, pattern_id: str, log: bool, notify: bool = True) -> Pattern:
        pattern = self.patterns.pop(pattern_id)
        self.by_key.pop(pattern.key, None)
        self._unindex(pattern)
        if log:
            self._log({"op": "remove", "id": pattern_id})
        if notify and self.on_drop is not None:
            self.on_drop(pattern)
        return pattern

    def _move(self, pattern_id: str, version: int | None) -> None:
        pattern = self.patterns[pattern_id]
        self._unindex(pattern)
        pattern = self.patterns[pattern_id] = replace(pattern, global_since=version)
        self._index(GLOBAL if version is not None else pattern.session).add(pattern.key, pattern.embedding)

    def _rollback(self, version: int) -> int:
        later = [p.id for p in self.patterns.values() if p.global_since is not None and p.global_since > version]
        for i in later:
            self._move(i, None)
        return len(later)

    def _log(self, event: dict[str, Any]) -> None:
        if self.folder is None:
            return
        with open(self.folder / EVENTS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._events += 1
        if self._events > 2 * len(self.patterns) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the event file as one add per live pattern (write, then rename)."""
        if self.folder is None:
            return
        tmp = self.folder / f".{EVENTS_FILE}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for pattern in self.patterns.values():
                f.write(json.dumps({"op": "add", "pattern": pattern.to_json()}, separators=(",", ":")) + "\n")
        os.replace(tmp, self.folder / EVENTS_FILE)
        self._events = len(self.patterns)

    def _replay(self) -> None:
        path = self.folder / EVENTS_FILE
        if not path.is_file():
            return
        for event in _read_events(path):
            op = event.get("op")
            if op == "add":
                pattern = Pattern.from_json(event["pattern"])
                if self.dim is None:
                    self.dim = len(pattern.embedding)
                if pattern.id in self.patterns:
                    self._drop(pattern.id, log=False, notify=False)
                if len(pattern.embedding) == self.dim:
                    self._insert(pattern)
            elif op == "remove" and event.get("id") in self.patterns:
                self._drop(event["id"], log=False, notify=False)
            elif op == "promote":
                for i in event.get("ids", []):
                    if i in self.patterns:
                        self._move(i, int(event["version"]))
            elif op == "rollback":
                self._rollback(int(event.get("version") or 0))
        self._compact()


def _read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The file's events; a line cut short by a crash (the last) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                yield event
