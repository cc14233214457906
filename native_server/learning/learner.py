"""The server's learning threads (`ruvllm serve --learning`): the instant loop and the background loop.

    POST /v1/feedback -> FeedbackDesk -> Learner.submit(record)       (a bounded queue: full is a 429)
    instant thread:    Sona.learn(record) -> publish(session, adapter) (the session's next requests use it)
    background thread: every N feedbacks or T seconds, Sona.consolidate() -> publish(None, adapter)
                       and every session again (their adapters hold the consolidated one too)

`publish(name_of_session_or_None, modules_or_None)` is the serving side
(`EngineSlots`): it swaps the adapter between two engine steps, so no
request is dropped and none sees half an adapter. Sessions the Sona drops
(least recently used past max_sessions, or folded into a consolidation)
have their adapters removed from the engine too. A failure in either thread
is logged with its traceback and counted (`errors`); the thread goes on with
the next record, and serving never notices. Nothing here touches the HTTP
request or its headers.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable

from .gated import PATTERN_PREFIX, PatternSlots

logger = logging.getLogger("ruvllm.learning")

QUEUE_SIZE = 256
DELETED_KEPT = 4096
THREAD_NICENESS = 10  # the learning threads yield the CPU to the engine thread (Linux: per-thread nice)
LATENCIES_KEPT = 4096

Publish = Callable[[str | None, Any], None]


CONSOLIDATED = "#sona"  # "#": no client can name these (context.LEARNED_PREFIX)
SESSION_PREFIX = "#sona/"
PUBLISH_TIMEOUT = 120.0


class EngineSlots:
    """`publish` into the serving engine: the consolidated adapter as "sona", a session's as "sona/<session>"
    (the consolidated one folded in), each swapped between two steps; `name_for` routes a request."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # native_server.engine.async_engine.AsyncEngine
        self.names: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, session: str | None, modules: Any) -> None:
        self.publish_named(CONSOLIDATED if session is None else SESSION_PREFIX + session, modules)

    def publish_named(self, name: str, modules: Any) -> None:
        """Load `modules` as adapter `name` (None: retire it), between two engine steps."""
        from py_engine.learning.lora import to_lora_adapter

        adapter = to_lora_adapter(modules, name) if modules else None
        loop = getattr(self.engine, "_loop", None)
        if loop is None or getattr(self.engine, "_thread", None) is None:  # before serving: no engine thread yet
            self.engine.engine.replace_lora(name, adapter)
        else:
            asyncio.run_coroutine_threadsafe(self.engine.replace_lora(name, adapter), loop).result(PUBLISH_TIMEOUT)
        with self._lock:
            (self.names.add if adapter is not None else self.names.discard)(name)

    def name_for(self, session: str | None) -> str | None:
        """The adapter a request of `session` runs with: its own, else the consolidated one, else None."""
        with self._lock:
            if session is not None and SESSION_PREFIX + session in self.names:
                return SESSION_PREFIX + session
            return CONSOLIDATED if CONSOLIDATED in self.names else None

    def sessions(self) -> set[str]:
        with self._lock:
            return {n[len(SESSION_PREFIX):] for n in self.names if n.startswith(SESSION_PREFIX)}


class Learner:
    def __init__(self, sona: Any, publish: Publish, *, queue_size: int = QUEUE_SIZE) -> None:
        self.sona, self.publish = sona, publish
        self.published: set[str] = set()  # sessions whose adapter was published (the instant thread's)
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(queue_size)
        self._due = threading.Event()
        self._closed = threading.Event()
        self.instant_seconds: deque[float] = deque(maxlen=LATENCIES_KEPT)  # train + publish, per feedback
        self.consolidation_seconds: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.updates = self.consolidations = self.errors = self.gate_routes = self.forgotten = 0
        self.patterns = PatternSlots(getattr(publish, "publish_named", lambda name, modules: None),
                                     sona.config.max_sessions)
        self.deleted: OrderedDict[str, None] = OrderedDict()  # DELETEd feedback ids, so a queued one is not learned
        self.last_error: str | None = None
        self._threads = [threading.Thread(target=self._guard, args=(self._instant_loop,), name="sona-instant",
                                          daemon=True),
                         threading.Thread(target=self._guard, args=(self._background_loop,), name="sona-background",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    # --- the feedback side (event loop) -----------------------------------------------------------
    def submit(self, record: dict[str, Any]) -> bool:
        """Queue a feedback record for the instant loop; False when the queue is full (the caller's 429)."""
        if self._closed.is_set():
            return False
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            return False
        return True

    def adapter_name(self, session: str | None) -> str | None:
        """What a request of `session` runs with, for the witness log."""
        try:
            return self.sona.version_name(session)
        except Exception:  # the log line must not fail a request
            return None

    def consolidate_soon(self) -> None:
        self._due.set()

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def close(self, timeout: float = 10.0) -> None:
        self._closed.set()
        self._due.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        for thread in self._threads:
            thread.join(timeout)

    # --- the threads ------------------------------------------------------------------------------
    def _guard(self, loop: Callable[[], None]) -> None:
        """A loop's last line of defence: even an error that escapes it is logged, never raised further."""
        _lower_priority(THREAD_NICENESS)
        try:
            loop()
        except BaseException as error:  # noqa: BLE001 (a dying thread must say why)
            self._failed("thread ended", error)

    def _failed(self, what: str, error: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(error).__name__}: {error}"
        logger.error("learning: %s (%s); serving goes on without this update", what, self.last_error,
                     exc_info=error)

    def republish(self) -> None:
        """The consolidated adapter and every session's again (after a consolidation or a rollback); the
        pattern adapters, which hold the old consolidated one, are retired (loaded again when asked for)."""
        self.patterns.retire_all()
        self.publish(None, self.sona.adapter_for(None))
        for session in list(self.sona.sessions):
            self.publish(session, self.sona.adapter_for(session))
        self._drop_gone_sessions()

    def _drop_gone_sessions(self) -> None:
        for session in list(self.published - set(self.sona.sessions)):
            self.publish(session, None)
            self.published.discard(session)

    def owner(self, pattern_id: str) -> tuple[bool, str | None]:
        """Whether the bank holds this pattern, and its session (None: given without a `user`)."""
        pattern = self.sona.recall.bank.get(pattern_id) if self.sona.recall is not None else None
        return (False, None) if pattern is None else (True, pattern.session or None)

    def forget(self, pattern_id: str) -> bool:
        """DELETE /v1/feedback/{id}: the pattern is gone from the bank and its adapter from the engine."""
        self.deleted[pattern_id] = None
        while len(self.deleted) > DELETED_KEPT:
            self.deleted.popitem(last=False)
        found = self.sona.forget(pattern_id)
        self.patterns.retire(f"{PATTERN_PREFIX}{pattern_id}")
        self.forgotten += found
        return found

    def rollback(self, version: int | None) -> None:
        """Serve consolidated `version` again (None or 0: no consolidated adapter); from the event loop's
        thread pool. Session MicroLoRAs stay."""
        self.sona.rollback(version)
        self.republish()

    def status(self) -> dict[str, Any]:
        def ms(values: deque[float]) -> dict[str, float] | None:
            if not values:
                return None
            ordered = sorted(values)
            return {"p50": round(1000 * ordered[len(ordered) // 2], 3),
                    "p99": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)}
        return {"object": "learning", "version": self.sona.version, "versions": self.sona.store.versions()
                if self.sona.store is not None else [], "sessions": len(self.sona.sessions),
                "updates": self.updates, "consolidations": self.consolidations, "errors": self.errors,
                "last_error": self.last_error, "queued": self._queue.qsize(), "alive": self.alive,
                "instant_update_ms": ms(self.instant_seconds), "consolidation_ms": ms(self.consolidation_seconds),
                **self._gate_status()}

    def _gate_status(self) -> dict[str, Any]:
        recall, c = self.sona.recall, self.sona.config
        if recall is None:
            return {"gate": None}
        return {"gate": {"threshold": c.gate_threshold, "keywords": c.gate_keywords, "apply": c.apply,
                         "embedder": c.embedder, "opened": recall.gate.opened, "closed": recall.gate.closed,
                         "routed_requests": self.gate_routes},
                "patterns": {**recall.bank.stats(), "forgotten": self.forgotten,
                             "adapters_loaded": len(self.patterns.loaded)}}

    def _instant_loop(self) -> None:
        while (record := self._queue.get()) is not None:
            start = time.perf_counter()
            try:
                if record.get("id") in self.deleted:  # deleted while queued
                    continue
                update = self.sona.learn(record)
                if record.get("id") in self.deleted:  # deleted while it trained: forget it again
                    self.forget(record["id"])
                    continue
                if update.pattern is not None:  # the gate: the pattern's own adapter, for its next request
                    self.patterns.publish(update.pattern, self.sona.pattern_adapter(update.pattern))
                    self.updates += 1
                    self.instant_seconds.append(time.perf_counter() - start)
                elif update.trained and update.session is not None:
                    self.publish(update.session, self.sona.adapter_for(update.session))
                    self.published.add(update.session)
                    self.updates += 1
                    self.instant_seconds.append(time.perf_counter() - start)
                    self._drop_gone_sessions()
                if self.sona.due():
                    self._due.set()
            except Exception as error:
                self._failed(f"the instant update of session {record.get('session')!r} failed", error)

    def _background_loop(self) -> None:
        interval = self.sona.config.consolidate_interval_s or None
        while not self._closed.is_set():
            fired = self._due.wait(interval)
            self._due.clear()
            if self._closed.is_set():
                return
            if not fired and not self.sona.replay:
                continue  # the timer, with nothing to learn from
            try:
                result = self.sona.consolidate()
                self.republish()
                self.consolidations += 1
                self.consolidation_seconds.append(result.seconds)
                logger.info("learning: consolidated %d feedback(s) into sona-v%s in %.2f s (loss %.3f -> %.3f)",
                            result.examples, result.version, result.seconds, result.stats.first_loss,
                            result.stats.last_loss)
            except Exception as error:
                self._failed("consolidation failed", error)


def _lower_priority(niceness: int) -> None:
    """Nice this thread (not the process: on Linux a thread is a task of its own); where that is not
    possible, train at the same priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except (AttributeError, OSError):
        pass


def learning_metrics(witness: Any, learner: Learner | None) -> str:
    """Prometheus lines for the witness log and the learning loops ("" when neither runs)."""
    samples = []
    if witness is not None:
        samples += [("witness_records_written_total", "counter", "Lines the witness log wrote.", witness.written),
                    ("witness_records_dropped_total", "counter", "Lines dropped: the writer's queue was full.",
                     witness.dropped)]
    if learner is not None:
        samples += [("learning_updates_total", "counter", "Instant-loop updates published.", learner.updates),
                    ("learning_consolidations_total", "counter", "Consolidations published.", learner.consolidations),
                    ("learning_errors_total", "counter", "Failures in the learning threads (logged).", learner.errors),
                    ("learning_adapter_version", "gauge", "The consolidated version served (0: none).",
                     learner.sona.version or 0)]
        recall = learner.sona.recall if learner is not None else None
        if recall is not None:
            stats = recall.bank.stats()
            samples += [("learning_patterns", "gauge", "Patterns in the bank (session and global).", stats["patterns"]),
                        ("learning_patterns_global", "gauge", "Patterns a consolidation made global.", stats["global"]),
                        ("learning_gate_opened_total", "counter", "Requests whose question found a pattern.",
                         recall.gate.opened),
                        ("learning_gate_closed_total", "counter", "Requests with patterns to find that found none.",
                         recall.gate.closed),
                        ("learning_patterns_forgotten_total", "counter", "Patterns deleted (DELETE /v1/feedback).",
                         learner.forgotten)]
    return "".join(f"# HELP ruvllm_{n} {h}\n# TYPE ruvllm_{n} {k}\nruvllm_{n} {v}\n" for n, k, h, v in samples)
