"""Chat templates rendered in worker processes the server can kill: bounded in time, memory and output.

A chat template is a program (Jinja). The sandbox keeps it from reaching out,
but not from looping: in-process, a render cannot be stopped, and six
requests with `{% for ... %}` loops once blocked every completion for 27 s.
So renders run in `python -m native_server.api.templates` workers (stdlib +
jinja2 only, no torch), each with an address-space limit, a few at a time;
a render past its deadline has its worker killed and replaced, and the
request gets a 400. The event loop only awaits pipes: no thread of the
default pool is ever held by a template. The process and its framing are
workers.py's; each request and reply is one JSON message.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import asdict
from typing import Any

from native_server.api.workers import WorkerProcess, limit_memory, serve
from py_engine.chat import ChatConfig, ChatTemplateError, RenderLimits, render_chat

logger = logging.getLogger("ruvllm.server")

DEFAULT_TIMEOUT = 10.0
DEFAULT_WORKERS = 2
WORKER_MEMORY_BYTES = 512 << 20  # address space of a worker (~30 MiB idle): a template gets no more


class TemplateRenderer:
    """Render chat templates in up to `workers` processes; each render within `timeout` seconds
    (waiting for a free worker included) and `max_chars` characters of output."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, max_chars: int = RenderLimits().max_chars,
                 workers: int = DEFAULT_WORKERS) -> None:
        self.timeout, self.max_chars, self.size = timeout, max_chars, workers
        self._idle: asyncio.Queue[WorkerProcess | None] | None = None
        self._all: set[WorkerProcess] = set()

    async def render(self, messages: list[dict[str, Any]], config: ChatConfig, **options: Any) -> str:
        """render_chat(messages, config, **options) in a worker; ChatTemplateError when it fails or overruns."""
        request = {"messages": messages, "config": asdict(config), "options": options, "max_chars": self.max_chars}
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.size):
                self._idle.put_nowait(None)  # a slot: its worker starts when first needed
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            slot = await asyncio.wait_for(self._idle.get(), self.timeout)
        except asyncio.TimeoutError:
            raise ChatTemplateError(f"no template worker was free within {self.timeout:g} s") from None
        worker = slot
        try:
            if worker is None:  # a new worker's start-up is not the template's time
                started = loop.time()
                worker = await WorkerProcess.start("native_server.api.templates")
                self._all.add(worker)
                deadline += loop.time() - started
            data = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
            reply = json.loads(await asyncio.wait_for(worker.call(data), max(deadline - loop.time(), 0.01)))
        except asyncio.TimeoutError:
            worker = self._discard(worker)
            raise ChatTemplateError(f"the chat template took longer than {self.timeout:g} s to render") from None
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as exc:  # incl. a failed start
            worker = self._discard(worker)
            raise ChatTemplateError(f"the template worker failed ({type(exc).__name__}); its memory limit is "
                                    f"{WORKER_MEMORY_BYTES >> 20} MiB") from None
        except BaseException:  # cancelled (the client left): the worker's reply would be out of step
            worker = self._discard(worker)
            raise
        finally:
            self._idle.put_nowait(worker)
        if "error" in reply:
            raise ChatTemplateError(reply["error"])
        return reply["text"]

    def _discard(self, worker: WorkerProcess | None) -> None:  # noqa: returns the slot's new (empty) worker
        if worker is not None:
            worker.kill()
            self._all.discard(worker)
        return None  # the slot starts a fresh worker next time

    async def close(self) -> None:
        """Stop every worker (and reap it)."""
        workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()
        for worker in workers:
            await worker.reap()


# --- the worker process ---------------------------------------------------------------------------------
def _reply(data: bytes) -> bytes:
    return json.dumps(_handle(data), ensure_ascii=False).encode("utf-8", "surrogatepass")


def _handle(data: bytes) -> dict[str, Any]:
    try:
        request = json.loads(data)
        config = ChatConfig(**request["config"])
        limits = RenderLimits(max_chars=request["max_chars"])
        return {"text": render_chat(request["messages"], config, render_limits=limits, **request["options"])}
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    except TypeError as exc:  # a chat_template_kwargs key clashing with a parameter
        return {"error": f"bad template arguments: {exc}"}
    except MemoryError:
        return {"error": f"the chat template ran out of memory (the limit is {WORKER_MEMORY_BYTES >> 20} MiB)"}
    except RecursionError:
        return {"error": "the chat template recursed too deeply"}


if __name__ == "__main__":
    limit_memory(WORKER_MEMORY_BYTES)
    serve(_reply, sys.stdin.buffer, sys.stdout.buffer)
