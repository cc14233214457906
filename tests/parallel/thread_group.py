"""N ranks of a sharded model as threads of one process: an all-reduce over a barrier, no torch.distributed.

The arithmetic the processes run, without their start-up (seconds each): the
sharding and the hooks are tested here, the processes and the collective in
test_tp_processes.py.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class ThreadGroup:
    """One rank's group; ranks share `state` (the barrier and each rank's partial)."""

    def __init__(self, rank: int, world: int, state: dict) -> None:
        self.rank, self.world, self.state = rank, world, state
        self.device = torch.device("cpu")

    @classmethod
    def make(cls, world: int) -> list["ThreadGroup"]:
        state = {"parts": [None] * world, "barrier": threading.Barrier(world, timeout=120)}
        return [cls(r, world, state) for r in range(world)]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts, barrier = self.state["parts"], self.state["barrier"]
        parts[self.rank] = t.clone()
        barrier.wait()
        total = parts[0].clone()
        for p in parts[1:]:  # rank order: every rank sums alike
            total += p
        barrier.wait()
        return t.copy_(total)


def run_ranks(world: int, body: Callable[[int, ThreadGroup], Any]) -> list[Any]:
    """body(rank, group) on each rank's thread; their results, or the first error raised."""
    groups = ThreadGroup.make(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, groups[rank])
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)
            groups[rank].state["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
