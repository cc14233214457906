"""The server's grammar compiler (native_server/grammars.py) with real worker processes, and its fair queue.

The masks a worker computes are checked against the same grammar compiled in this process (the worker's
trie must order tokens as the server's does); a cached, a remembered and a joined grammar cost no compile;
a compile past its time is not remembered; a worker that stops answering is killed and replaced."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from native_server.api.fair_queue import FairSlots, QueueFullError
from native_server.api.grammars import GrammarCompiler
from py_engine.guided import GrammarTimeoutError, GrammarTooLargeError, StructuredOutputsParams, guide_for
from py_engine.guided.compile import token_grammar
from py_engine.sampling_params import SamplingParams
from py_engine.tokenizer import Tokenizer
from tests.server.hostile_requests import BUILTIN

EOS = (2,)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(BUILTIN)


def run(coro):
    return asyncio.run(coro)


def test_worker_masks_equal_the_in_process_ones_and_the_engine_finds_them(tokenizer):
    async def go():
        compiler = GrammarCompiler()
        try:
            spec = StructuredOutputsParams(json=PERSON)
            await compiler.compile(spec, tokenizer, EOS, "a")
            return spec, compiler.stats
        finally:
            await compiler.close()

    spec, stats = run(go())
    assert stats["compiled"] == 1
    served = guide_for(SamplingParams(structured_outputs=spec, max_tokens=8), tokenizer, EOS).grammar
    assert served is next(iter(spec.compiled.values()))
    local = token_grammar(StructuredOutputsParams(json=PERSON, whitespace_pattern="[ ]?"), tokenizer, (7,))
    assert served.dfa.rows == local.dfa.rows and served.dfa.accepting == local.dfa.accepting
    adopted = served.masks()
    assert len(adopted) > 3  # precomputed in the worker
    for state, mask in adopted.items():  # the same trie positions (EOS ids differ, so the cache is not used)
        assert mask.ranges == local.mask(state).ranges


def test_a_spare_worker_is_ready_for_a_second_client(tokenizer):
    async def go():
        compiler = GrammarCompiler()
        try:
            await compiler.compile(StructuredOutputsParams(choice=["spare"]), tokenizer, EOS, "a")
            deadline = time.monotonic() + 60
            while len(compiler._idle) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            return len(compiler._all)
        finally:
            await compiler.close()

    assert run(go()) == 2


def test_cached_remembered_and_joined_grammars_cost_no_compile(tokenizer):
    hostile = {"enum": [f"v{i:05d}" for i in range(8000)]}

    async def go():
        compiler = GrammarCompiler()
        try:
            await compiler.compile(StructuredOutputsParams(choice=["yes", "no"]), tokenizer, EOS, "a")
            await compiler.compile(StructuredOutputsParams(choice=["yes", "no"]), tokenizer, EOS, "b")
            for _ in range(2):
                with pytest.raises(GrammarTooLargeError, match="states"):
                    await compiler.compile(StructuredOutputsParams(json=hostile), tokenizer, EOS, "a")
            started = time.monotonic()
            with pytest.raises(GrammarTooLargeError):
                await compiler.compile(StructuredOutputsParams(json=hostile), tokenizer, EOS, "c")
            remembered = time.monotonic() - started
            same = [StructuredOutputsParams(regex="[a-z]{1,40}@x") for _ in range(3)]
            await asyncio.gather(*(compiler.compile(s, tokenizer, EOS, c) for s, c in zip(same, "abc")))
            assert all(s.compiled for s in same)
            return dict(compiler.stats), remembered
        finally:
            await compiler.close()

    stats, remembered = run(go())
    assert stats == {**stats, "compiled": 2, "cached": 1, "remembered_failures": 2, "joined": 2}, stats
    assert remembered < 0.1


def test_a_timed_out_compile_is_not_remembered(tokenizer):
    async def go():
        compiler = GrammarCompiler(seconds=0.3, max_states=10**7, max_nodes=10**7)
        try:
            for _ in range(2):
                with pytest.raises(GrammarTimeoutError, match="longer than 0.3 s"):
                    await compiler.compile(StructuredOutputsParams(regex="(a|b|c)*a(a|b|c){14}"), tokenizer, EOS, "a")
            return dict(compiler.stats)
        finally:
            await compiler.close()

    stats = run(go())
    assert stats["remembered_failures"] == 0 and stats["killed"] == 0  # the worker stopped itself, twice


def test_a_worker_that_stops_answering_is_killed_and_replaced(tokenizer):
    async def go():
        compiler = GrammarCompiler(workers=1, seconds=0.5)  # one slot: no spare worker to fall back on
        try:
            await compiler.compile(StructuredOutputsParams(choice=["killed-1"]), tokenizer, EOS, "a")
            (worker,) = compiler._idle
            os.kill(worker.process.pid, signal.SIGSTOP)  # alive, silent
            started = time.monotonic()
            with pytest.raises(GrammarTimeoutError):
                await compiler.compile(StructuredOutputsParams(choice=["killed-2"]), tokenizer, EOS, "a")
            waited = time.monotonic() - started
            await worker.process.wait()
            await compiler.compile(StructuredOutputsParams(choice=["killed-3"]), tokenizer, EOS, "a")
            return dict(compiler.stats), waited, worker.process.returncode
        finally:
            await compiler.close()

    stats, waited, code = run(go())
    assert stats["killed"] == 1 and stats["compiled"] == 2 and code == -signal.SIGKILL
    assert waited < 10


def test_a_worker_past_its_cpu_seconds_is_ended_by_the_kernel_and_replaced(tokenizer):
    """The budget's clock would allow 100 s; the CPU limit (1 s) ends the child first: what holds
    when a stage never looks at the clock or the server is gone."""
    async def go():
        compiler = GrammarCompiler(workers=1, seconds=100, cpu_seconds=1, max_states=10**7, max_nodes=10**7)
        try:
            await compiler.compile(StructuredOutputsParams(choice=["cpu-1"]), tokenizer, EOS, "a")
            (worker,) = compiler._idle
            started = time.monotonic()
            with pytest.raises(GrammarTimeoutError, match="more than 1 s of CPU"):
                await compiler.compile(StructuredOutputsParams(regex="(a|b|c)*a(a|b|c){16}"), tokenizer, EOS, "a")
            waited = time.monotonic() - started
            await compiler.compile(StructuredOutputsParams(choice=["cpu-2"]), tokenizer, EOS, "a")
            return dict(compiler.stats), waited, worker.process.returncode
        finally:
            await compiler.close()

    stats, waited, code = run(go())
    assert code == -signal.SIGXCPU and stats["killed"] == 1 and stats["compiled"] == 2
    assert stats["remembered_failures"] == 0
    assert waited < 30  # ~1-2 s of CPU; the machine may be shared


# --- the fair queue -------------------------------------------------------------------------------------
def test_one_client_never_holds_every_slot():
    async def go():
        slots = FairSlots(2)
        await slots.acquire("a")
        second = asyncio.ensure_future(slots.acquire("a"))
        await asyncio.sleep(0)
        assert not second.done()  # a free slot, but "a" holds all but one already
        await asyncio.wait_for(slots.acquire("b"), 1)  # another client gets it at once
        slots.release("a")
        await asyncio.wait_for(second, 1)
        assert slots.running == {"a": 1, "b": 1}

    run(go())


def test_a_freed_slot_goes_to_the_client_holding_fewest():
    async def go():
        slots = FairSlots(3, per_client=2)
        for client in ("a", "a", "b"):
            await slots.acquire(client)
        order: list[str] = []
        waiters = [asyncio.ensure_future(_take(slots, c, order)) for c in ("a", "b", "c")]
        await asyncio.sleep(0)
        slots.release("a")  # a holds 1, b 1, c none
        await asyncio.sleep(0)
        slots.release("b")  # a 1, b none, c 1: b before a, though a waited longer
        await asyncio.sleep(0)
        assert order == ["c", "b"] and slots.running == {"a": 1, "b": 1, "c": 1}
        for waiter in waiters:
            waiter.cancel()

    run(go())


async def _take(slots: FairSlots, client: str, order: list[str]) -> None:
    await slots.acquire(client)
    order.append(client)


def test_waiting_is_bounded_and_cancelled_waiters_leave():
    async def go():
        slots = FairSlots(1, max_waiting=2)
        await slots.acquire("a")
        waiting = [asyncio.ensure_future(slots.acquire("a")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await slots.acquire("a")
        waiting[0].cancel()
        await asyncio.sleep(0)
        slots.release("a")
        await asyncio.wait_for(waiting[1], 1)  # the cancelled one did not take the slot
        assert slots.running == {"a": 1} and not slots.waiting

    run(go())
