"""`FairSlots`: a few slots of scarce work (grammar compiles) shared fairly among clients.

    async with slots.hold(client):   # waits its turn; QueueFullError past `max_waiting` for the client
        ...

A plain semaphore serves in arrival order: a client that sends ten slow grammars at once holds
every slot and everyone queues behind it. Here:
  - one client holds at most `per_client` slots at a time (default: all but one, so with two or
    more slots there is always one another client can get);
  - a freed slot goes to the waiting client that holds the fewest, the longest-waiting first, and
    within a client in arrival order;
  - a client may have at most `max_waiting` requests waiting; more get a 429 at once.
Who is a client is the caller's choice (the server: the request's `user`, else the peer address).
Runs on one event loop; a waiter that is cancelled leaves the queue (or passes its slot on).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Hashable


class QueueFullError(Exception):
    """The client already has `max_waiting` requests waiting."""


class FairSlots:
    def __init__(self, size: int, per_client: int | None = None, max_waiting: int = 8) -> None:
        self.size = size
        self.per_client = per_client if per_client is not None else max(1, size - 1)
        self.max_waiting = max_waiting
        self.running: dict[Hashable, int] = {}
        self.waiting: OrderedDict[Hashable, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def busy(self) -> int:
        return sum(self.running.values())

    @asynccontextmanager
    async def hold(self, client: Hashable) -> AsyncIterator[None]:
        await self.acquire(client)
        try:
            yield
        finally:
            self.release(client)

    async def acquire(self, client: Hashable) -> None:
        if self.busy < self.size and self.running.get(client, 0) < self.per_client and client not in self.waiting:
            self.running[client] = self.running.get(client, 0) + 1
            return
        queue = self.waiting.get(client)
        if queue is not None and len(queue) >= self.max_waiting:
            raise QueueFullError(f"{len(queue)} requests of this client are already waiting")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(client, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, then cancelled: pass the slot on
                self.release(client)
            else:
                self._forget(client, future)
            raise

    def release(self, client: Hashable) -> None:
        left = self.running.get(client, 0) - 1
        if left > 0:
            self.running[client] = left
        else:
            self.running.pop(client, None)
        self._grant()

    def _grant(self) -> None:
        while self.busy < self.size:
            eligible = [c for c in self.waiting if self.running.get(c, 0) < self.per_client]
            if not eligible:
                return
            client = min(eligible, key=lambda c: self.running.get(c, 0))  # min keeps the first of equals
            queue = self.waiting[client]
            future = queue.popleft()
            if not queue:
                del self.waiting[client]
            else:
                self.waiting.move_to_end(client)  # its next request waits behind the other clients' first
            if future.done():  # cancelled while waiting
                continue
            self.running[client] = self.running.get(client, 0) + 1
            future.set_result(None)

    def _forget(self, client: Hashable, future: asyncio.Future[None]) -> None:
        queue = self.waiting.get(client)
        if queue is None:
            return
        try:
            queue.remove(future)
        except ValueError:
            pass
        if not queue:
            del self.waiting[client]
