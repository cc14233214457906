"""`GrammarCompiler`: the server's structured-output grammars, compiled in worker processes it can kill.

    await ctx.grammars.compile(spec, tokenizer, eos_token_ids, client)   # GuidedError -> the caller's 400

In order, for each request's grammar:
  1. the cache (compile.cached_grammar): a grammar compiled before costs nothing and waits for nothing;
  2. a grammar that failed before on a size bound or as invalid (remembered by its key) fails at
     once, without compute: a client repeating a hostile schema only costs a lookup;
  3. the same grammar already compiling for another request: wait for that one;
  4. otherwise a slot (fair_queue.FairSlots: a client holds at most all but one, the others get the
     next free one) and a worker process (grammar_worker.py) that compiles it within its Budget and
     precomputes the masks nearest the start; the server installs the DFA and masks (a thread: the
     decode of a big DFA is not the event loop's) and the engine finds them on the request's params.
A worker that does not answer within the budget's seconds plus a grace is killed and replaced (the
budget stops a compile itself; the kill is for what the budget does not see), and so is one whose
memory grew past RECYCLE_BYTES; one that dies without a reply is replaced and the job tried once
more (it may have died while idle), and each compile runs under a CPU-time limit (SIGXCPU). Workers start when first needed, and a spare beside each one taken
while there are fewer than slots; a start-up (the vocabulary trie) is not a request's time.
"""
from __future__ import annotations

import asyncio
import logging
import marshal
import signal
from collections import OrderedDict
from typing import Any, Hashable

from native_server.api.fair_queue import FairSlots, QueueFullError
from native_server.api.grammar_worker import dfa_of, error_of, job_message
from native_server.api.workers import WorkerProcess
from py_engine.guided import (Budget, GrammarTimeoutError, GrammarTooLargeError, GuidedError, StructuredOutputsParams,
                              TokenGrammar, cached_grammar, install_grammar, vocab_trie)

logger = logging.getLogger("ruvllm.server")

COMPILE_SECONDS = 10.0
COMPILE_STATES = 50_000
COMPILE_NODES = 200_000
PRECOMPUTE_SECONDS = 2.0
WORKERS = 2
GRACE_SECONDS = 2.0  # past the budget, before a silent worker is killed
RECYCLE_BYTES = 512 << 20  # a worker whose RSS grew past this is replaced after its reply
FAILURES_KEPT = 256


class GrammarQueueFull(GuidedError):
    """Too many of this client's grammars are waiting for a compile slot (a 429)."""


class _WorkerDied(Exception):
    """A worker ended without a reply (not on its CPU limit)."""


class GrammarCompiler:
    def __init__(self, workers: int = WORKERS, seconds: float = COMPILE_SECONDS, max_states: int = COMPILE_STATES,
                 max_nodes: int = COMPILE_NODES, precompute: float = PRECOMPUTE_SECONDS,
                 cpu_seconds: float | None = None) -> None:
        self.seconds, self.max_states, self.max_nodes, self.precompute = seconds, max_states, max_nodes, precompute
        # a worker's CPU time per compile before the kernel ends it: never before the budget's own stop
        self.cpu_seconds = cpu_seconds if cpu_seconds is not None else seconds + GRACE_SECONDS
        self.slots = FairSlots(workers)
        self._idle: list[WorkerProcess] = []
        self._all: set[WorkerProcess] = set()
        self._inflight: dict[tuple, asyncio.Task[TokenGrammar]] = {}
        self._failures: OrderedDict[str, tuple[type[GuidedError], str, str | None]] = OrderedDict()
        self._vocab: dict[int, bytes] = {}  # id(trie) -> the INIT message of its workers
        self._starting, self._closed = 0, False
        self._spares: set[asyncio.Task[None]] = set()
        self._reaping: set[asyncio.Task[None]] = set()  # dropped workers being waited for (their pipes closed)
        self.stats = {"compiled": 0, "cached": 0, "remembered_failures": 0, "joined": 0, "killed": 0, "recycled": 0}

    async def compile(self, spec: StructuredOutputsParams, tokenizer: Any, eos: tuple[int, ...],
                      client: Hashable) -> None:
        """Make spec's token grammar ready for the engine (on spec.compiled); GuidedError when it cannot be."""
        if getattr(tokenizer, "_guided_trie", None) is None:  # once per server: ~1 s for a 150k vocabulary
            await asyncio.to_thread(vocab_trie, tokenizer)
        await asyncio.to_thread(getattr, spec, "digest")  # megabytes of choices to dump and hash: off the loop
        if cached_grammar(spec, tokenizer, eos) is not None:
            self.stats["cached"] += 1
            return
        failed = self._failures.get(spec.digest)
        if failed is not None:
            self.stats["remembered_failures"] += 1
            kind, message, param = failed
            raise kind(message, param)
        key = (spec.digest, eos)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._compile(spec, tokenizer, eos, client))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._inflight.pop(key, None) and (t.cancelled() or t.exception()))
        else:
            self.stats["joined"] += 1
        grammar = await asyncio.shield(task)  # a client that leaves does not stop the others' compile
        install_grammar(spec, grammar, eos)

    async def _compile(self, spec: StructuredOutputsParams, tokenizer: Any, eos: tuple[int, ...],
                       client: Hashable) -> TokenGrammar:
        trie = vocab_trie(tokenizer)
        budget = Budget(max_states=self.max_states, max_nodes=self.max_nodes, seconds=self.seconds)
        job = job_message(spec, eos, budget, self.precompute, self.cpu_seconds)
        try:
            async with self.slots.hold(client):
                reply = await self._call(job, trie)
        except QueueFullError as exc:
            raise GrammarQueueFull(f"too many structured-output requests of this client are waiting to compile "
                                   f"({exc}); retry later") from None
        if "error" in reply:
            error = error_of(reply)
            if not isinstance(error, GrammarTimeoutError):  # a size bound or a bad grammar: the same next time
                self._remember(spec.digest, error)
            raise error
        self.stats["compiled"] += 1
        return await asyncio.to_thread(_grammar_of, reply, trie, eos)

    async def _call(self, job: bytes, trie: Any) -> dict[str, Any]:
        """The job's reply from a worker. A worker that dies without a reply (not on its CPU limit) is
        retried once on a fresh one: an idle worker killed from outside looks alive until the loop
        reaps it, and that must not cost a good grammar its 400 (and a place among the remembered
        failures); a grammar that kills two workers is refused."""
        try:
            return await self._call_once(job, trie)
        except _WorkerDied:
            pass
        try:
            return await self._call_once(job, trie)
        except _WorkerDied as died:
            raise GrammarTooLargeError(f"the grammar compiler failed twice ({died}); simplify the schema or "
                                       "regex") from None

    async def _call_once(self, job: bytes, trie: Any) -> dict[str, Any]:
        worker = await self._worker(trie)
        try:
            reply = marshal.loads(await asyncio.wait_for(worker.call(job), self.seconds + GRACE_SECONDS))
        except asyncio.TimeoutError:
            self._drop(worker, "killed")
            raise GrammarTimeoutError(f"compiling the grammar took longer than {self.seconds:g} s; simplify the "
                                      "schema or regex") from None
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as exc:
            self._drop(worker, "killed")
            if await _ended_by(worker, signal.SIGXCPU):  # its CPU limit (workers.limit_cpu): a time bound
                raise GrammarTimeoutError(f"compiling the grammar used more than {self.cpu_seconds:g} s of CPU; "
                                          "simplify the schema or regex") from None
            raise _WorkerDied(type(exc).__name__) from None
        except BaseException:  # cancelled: its reply would be out of step
            self._drop(worker, "killed")
            raise
        if reply.get("rss", 0) > RECYCLE_BYTES:
            self._drop(worker, "recycled")
        else:
            self._idle.append(worker)
        return reply

    async def _worker(self, trie: Any) -> WorkerProcess:
        """An idle worker, else a new one; either way a spare starts in the background while there are
        fewer than slots (a second client's first compile then finds a worker ready, not a start-up)."""
        while self._idle:
            worker = self._idle.pop()
            if worker.alive:
                self._start_spare(trie)
                return worker
            self._all.discard(worker)
        worker = await self._start(trie)
        self._start_spare(trie)
        return worker

    async def _start(self, trie: Any) -> WorkerProcess:
        init = self._vocab.get(id(trie))
        if init is None:
            init = self._vocab[id(trie)] = marshal.dumps(trie.tokens)
        self._starting += 1
        try:
            worker = await WorkerProcess.start("native_server.api.grammar_worker", init)
        except (OSError, EOFError) as exc:
            raise GrammarTooLargeError(f"the grammar compiler could not start ({exc})") from None
        finally:
            self._starting -= 1
        self._all.add(worker)
        return worker

    def _start_spare(self, trie: Any) -> None:
        if len(self._all) + self._starting >= self.slots.size or self._closed:
            return

        async def spare() -> None:
            try:
                worker = await self._start(trie)
            except GrammarTooLargeError:
                return  # the next request starts one itself (and reports why it cannot)
            if self._closed:
                await worker.reap()
            else:
                self._idle.append(worker)

        self._spares.add(task := asyncio.ensure_future(spare()))
        task.add_done_callback(self._spares.discard)

    def _drop(self, worker: WorkerProcess, why: str) -> None:
        worker.kill()
        self._all.discard(worker)
        self.stats[why] += 1
        self._reaping.add(task := asyncio.ensure_future(worker.reap()))
        task.add_done_callback(self._reaping.discard)

    def _remember(self, key: str, error: GuidedError) -> None:
        self._failures[key] = (type(error), str(error), error.param)
        while len(self._failures) > FAILURES_KEPT:
            self._failures.popitem(last=False)

    async def close(self) -> None:
        """Stop every worker (and reap it)."""
        self._closed = True
        for task in list(self._spares):
            task.cancel()
        await asyncio.gather(*self._spares, return_exceptions=True)
        workers, self._all, self._idle = list(self._all), set(), []
        for worker in workers:
            await worker.reap()
        await asyncio.gather(*self._reaping, return_exceptions=True)


async def _ended_by(worker: WorkerProcess, sig: int) -> bool:
    """Whether the worker (dead, or just sent our SIGKILL) was ended by `sig`: a SIGKILL sent to a child
    that already died (a zombie not yet reaped) leaves its exit status as it was."""
    try:
        code = await asyncio.wait_for(worker.process.wait(), 1.0)
    except asyncio.TimeoutError:
        return False
    return code == -sig


def _grammar_of(reply: dict[str, Any], trie: Any, eos: tuple[int, ...]) -> TokenGrammar:
    grammar = TokenGrammar(dfa_of(reply), trie, eos)
    grammar.adopt(reply["masks"])
    return grammar
