"""The responses /v1/responses keeps (`store: true`), for `previous_response_id` and GET / DELETE.

    store = ResponseStore(max_items=1024, max_chars=32_000_000)
    store.put(response_id, response, conversation)   # the response object and the chat messages behind it
    store.get(response_id) -> (response, conversation) | None
    store.delete(response_id) -> bool

In memory and bounded twice: by count and by the size of what is kept (JSON characters); the
least recently used go first, so a client that stores many long conversations pushes out old
ones, never the server's memory. One entry larger than the whole budget is not kept at all.
Not shared between server processes and lost on restart, as the issue asks of a local server.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

MAX_ITEMS = 1024
MAX_CHARS = 32_000_000  # about 32-64 MB of Python objects


class ResponseStore:
    def __init__(self, max_items: int = MAX_ITEMS, max_chars: int = MAX_CHARS) -> None:
        self.max_items, self.max_chars = max_items, max_chars
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_chars:
            return False
        with self._lock:
            self._drop(response_id)
            self._items[response_id] = (response, conversation, size)
            self._chars += size
            while len(self._items) > self.max_items or self._chars > self.max_chars:
                self._drop(next(iter(self._items)))
        return True

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            self._items.move_to_end(response_id)
            return found[0], found[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, response_id: str) -> bool:
        found = self._items.pop(response_id, None)
        if found is not None:
            self._chars -= found[2]
        return found is not None
