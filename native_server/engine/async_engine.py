"""`AsyncEngine`: the engine loop in a thread of its own, requests as async iterators.

A forward pass holds the GIL only in between torch ops, but it takes
milliseconds to seconds: run on the event loop it would stall every client.
So the loop thread owns the `LLMEngine` outright; the event loop talks to it
through an inbox (add / abort) and gets each step's outputs back with
`call_soon_threadsafe`, one asyncio.Queue per request. Nothing else is
shared, so no lock is ever held across a forward pass.

Errors a request can never get past are raised on the event loop before it
is queued (PromptTooLongError, QueueFullError, ValueError), at the first
`__anext__()` of `generate()`. Leaving the iterator early (a client
disconnect cancels the task) aborts the request and frees its blocks.

A request the engine fails after accepting it (its sampling or text side
raised) ends with a RequestFailedError; the loop goes on. Only an error of
the loop itself (the forward pass, the scheduler) is fatal: every stream
fails, new requests are refused, `dead_reason()` says why, and `on_fatal`
(the server's exit) is called once, so a supervisor can restart the process.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from native_server.engine.llm_engine import LLMEngine
from native_server.engine.outputs import (EngineDeadError, EngineShutdownError, EngineStats, QueueFullError,
                                   RequestFailedError, RequestOutput)
from py_engine.sampling_params import SamplingParams

logger = logging.getLogger("ruvllm.server")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal  # called on the event loop once the loop thread has died
        self.tokenizer, self.model_config = engine.tokenizer, engine.model_config
        self.max_model_len, self.model_name = engine.max_model_len, engine.model_name
        self.max_num_batched_tokens = engine.max_num_batched_tokens
        self.eos_token_ids = engine.eos_token_ids
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pending_adds = 0  # adds in the inbox, for the queue limit
        self._pending_lock = threading.Lock()
        self._closing = False  # no new requests
        self._stop = False  # the loop thread exits
        self._error: BaseException | None = None

    def start(self) -> None:
        """Start the loop thread (idempotent); called on the event loop, which the thread reports to."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: the first generate() tells
            pass
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ruvllm-engine", daemon=True)
            self._thread.start()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs until the last one (finished=True); lora: a loaded adapter's name."""
        self._check_open()
        self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.engine.check_request(prompt_token_ids, params, lora)
        if len(self.engine.scheduler.waiting) + self._pending_adds >= self.engine.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.engine.max_queue} requests)")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(("add", request_id, list(prompt_token_ids), params, *(() if lora is None else (lora,))))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stop:  # the client left: free its blocks now
                self._send(("abort", request_id))

    async def load_lora(self, name: str, adapter: Any) -> None:
        """Load a LoRA adapter (a LoraAdapter read off the loop) on the engine's thread, between steps."""
        await self._call("load_lora", name, adapter)

    async def unload_lora(self, name: str) -> None:
        """Refuse new requests for the adapter; it leaves the model once its running requests finish."""
        await self._call("unload_lora", name)

    async def replace_lora(self, name: str, adapter: Any) -> None:
        """Swap the adapter loaded as `name` (None: retire it), on the engine's thread between steps."""
        await self._call("replace_lora", name, adapter)

    def lora_names(self) -> list[str]:
        return self.engine.lora_names()  # a copy of a dict's keys: safe under the GIL

    async def _call(self, method: str, *args: Any) -> Any:
        """engine.method(*args) on the engine's thread; its result or exception here."""
        self._check_open()
        self._loop = asyncio.get_running_loop()
        future = self._loop.create_future()
        self._send(("call", method, args, future))
        return await future

    async def abort(self, request_id: str) -> None:
        """End a request; its stream gets a last output with finish_reason "abort"."""
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        # Reads ints and copies small lists the loop thread writes: safe under the GIL, and never blocks.
        return self.engine.stats()

    def dead_reason(self) -> str | None:
        """Why this engine can no longer serve (its loop failed or its thread is gone), else None."""
        if self._error is not None:
            return f"the engine stopped after an error: {self._error!r}"
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            return "the engine loop thread is not running"
        return None

    async def shutdown(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` seconds, abort the rest, stop."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._error is None:
            await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self._send(("abort", request_id))
        self._send(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, max(deadline - time.monotonic(), 0.0) + 5.0)
        for stream in self._streams.values():  # anything the thread did not get to
            stream.put_nowait(EngineShutdownError("the server is shutting down"))

    # --- event loop side --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error!r}")
        if self._closing:
            raise EngineShutdownError("the server is shutting down")
        if self._thread is None:
            raise RuntimeError("AsyncEngine.start() was not called")

    def _send(self, message: tuple) -> None:
        if message[0] == "add":
            with self._pending_lock:
                self._pending_adds += 1
        self._inbox.put(message)
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out if out.error is None else RequestFailedError(out.error))

    def _fail(self, request_id: str | None, error: BaseException) -> None:
        targets = list(self._streams.values()) if request_id is None else [self._streams.get(request_id)]
        for stream in targets:
            if stream is not None:
                stream.put_nowait(error)

    # --- loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if self._stop:
                    break
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._post(self._deliver, outputs)
        except BaseException as error:  # a bug or out of memory: fail every stream, refuse new requests
            logger.exception("engine loop failed")
            self._error = error
            self._post(self._fail, None, EngineDeadError(f"the engine stopped after an error: {error!r}"))
            if self.on_fatal is not None:
                self._post(self.on_fatal, error)
        finally:
            self.engine.close()  # its tensor-parallel workers, if any

    def _drain_inbox(self) -> None:
        outputs = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            kind = message[0]
            if kind == "add":
                with self._pending_lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(*message[1:])
                except Exception as error:  # e.g. the queue filled up meanwhile
                    self._post(self._fail, message[1], error)
            elif kind == "abort":
                out = self.engine.abort(message[1])
                if out is not None:
                    outputs.append(out)
            elif kind == "call":
                _, method, args, future = message
                try:
                    result, error = getattr(self.engine, method)(*args), None
                except Exception as exc:  # e.g. an adapter that does not fit: the caller's 400
                    result, error = None, exc
                self._post(_settle, future, result, error)
            elif kind == "stop":
                self._stop = True
        if outputs:
            self._post(self._deliver, outputs)

    def _post(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run callback(*args) on the event loop (which is known once a request has come in)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)
