"""Which replica a request goes to: its user's, else the one holding its prompt's prefix, else the least loaded.

Pure Python (no Ray), so the policy is tested on its own; router.py puts it
under Ray Serve's request router.

- A request's `RouteKey`: OpenAI's `user` (the learning loop's session: its
  adapter lives on one replica), and a chain of hashes over its prompt in
  blocks of BLOCK_CHARS characters (h_i = H(h_i-1, block_i)); a chat's
  prompt is its messages in order, so turn 2 of a conversation starts with
  every block of turn 1's prompt. Only whole blocks count.
- `AffinityTable` remembers the replica each user and each hash last went
  to (least recently used entries go beyond a bound), and chooses:
    1. the user's replica while it is alive and has room;
    2. the replica holding the longest run of the prompt's leading blocks,
       when that run is at least MIN_MATCH of the prompt and that replica
       has at most IMBALANCE more requests in flight than the least loaded
       (SGLang's cache-aware rule: a long shared system prompt draws new
       conversations to its replica too, where it is cached, until the
       load gap says spread);
    3. the least loaded replica (ties: the fewest requests routed so far).
  The choice is recorded, so the next turn finds it.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

BLOCK_CHARS = 128
MAX_BLOCKS = 512  # blocks hashed per request (64k characters): a longer prompt routes by its first 64k
MIN_MATCH = 0.5
IMBALANCE = 8
MAX_ENTRIES = 200_000  # hashes remembered (~100 bytes each)
MAX_USERS = 100_000
MAX_USER_CHARS = 256


@dataclass(frozen=True)
class RouteKey:
    user: str | None = None
    prefix: tuple[bytes, ...] = ()  # the chained block hashes

    def to_dict(self) -> dict:
        return {"user": self.user, "prefix": [h.hex() for h in self.prefix]}


def prompt_text(path: str, body: Any) -> str:
    """The text a request's prompt starts with, in a form two turns of one conversation share."""
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str)
                parts.append(f"{m.get('role')}\x1f{text}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt))  # token ids: a shared id prefix is a shared text prefix
    return ""


def chain(text: str, block: int = BLOCK_CHARS) -> tuple[bytes, ...]:
    hashes, h = [], b""
    for start in range(0, min(len(text) // block, MAX_BLOCKS) * block, block):
        h = hashlib.blake2b(h + text[start:start + block].encode("utf-8", "surrogatepass"), digest_size=8).digest()
        hashes.append(h)
    return tuple(hashes)


def route_key(path: str, body: Any) -> RouteKey:
    user = body.get("user") if isinstance(body, dict) else None
    user = user[:MAX_USER_CHARS] if isinstance(user, str) and user else None
    return RouteKey(user, chain(prompt_text(path, body)))


@dataclass
class Choice:
    replica: str
    reason: str  # "user", "prefix", "least-loaded"
    matched: int = 0  # leading blocks found on the replica


@dataclass
class AffinityTable:
    min_match: float = MIN_MATCH
    imbalance: int = IMBALANCE
    hashes: OrderedDict = field(default_factory=OrderedDict)  # hash -> replica
    users: OrderedDict = field(default_factory=OrderedDict)  # user -> replica
    routed: dict = field(default_factory=dict)  # replica -> requests routed

    def choose(self, key: RouteKey, loads: dict[str, int], capacity: int | None = None) -> Choice | None:
        """A replica among loads' keys (live replicas -> requests in flight); None when there is none."""
        if not loads:
            return None
        room = [r for r in loads if capacity is None or loads[r] < capacity] or list(loads)
        least = min(room, key=lambda r: (loads[r], self.routed.get(r, 0), r))
        user = self.users.get(key.user) if key.user is not None else None
        if user in room:
            return Choice(user, "user")
        replica, matched = self._longest_match(key.prefix, room)
        if (replica is not None and matched >= self.min_match * len(key.prefix)
                and loads[replica] - loads[least] <= self.imbalance):
            return Choice(replica, "prefix", matched)
        return Choice(least, "least-loaded")

    def _longest_match(self, prefix: tuple[bytes, ...], room: Iterable[str]) -> tuple[str | None, int]:
        alive = set(room)
        best, best_n = None, 0
        for i, h in enumerate(prefix):  # the replica of block i's hash holds blocks 0..i if it held block i
            replica = self.hashes.get(h)
            if replica in alive:
                best, best_n = replica, i + 1
        return best, best_n

    def record(self, key: RouteKey, replica: str) -> None:
        self.routed[replica] = self.routed.get(replica, 0) + 1
        if key.user is not None:
            _put(self.users, key.user, replica, MAX_USERS)
        for h in key.prefix:
            _put(self.hashes, h, replica, MAX_ENTRIES)

    def forget(self, replica: str) -> None:
        """A replica is gone: its users and prefixes route afresh."""
        for table in (self.users, self.hashes):
            for k in [k for k, v in table.items() if v == replica]:
                del table[k]
        self.routed.pop(replica, None)


def _put(table: OrderedDict, key: Any, value: str, bound: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > bound:
        table.popitem(last=False)


_ROUTERS: list = []  # this process's request routers (router.py), newest last


def register_router(router: Any) -> None:
    _ROUTERS.append(router)


def current_router() -> Any:
    return _ROUTERS[-1] if _ROUTERS else None
