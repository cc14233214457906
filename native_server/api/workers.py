"""Worker processes the server can kill: start-up handshake, framing, one call at a time.

Work a request can make unbounded in CPU or memory (a chat template, a grammar) runs in
`python -m MODULE` children (stdlib and py_engine's pure-Python layer: no torch), each under an
address-space limit. In-process it could not be stopped (a thread cannot be cancelled), it would
hold the GIL against the engine's thread and the event loop, and its memory would stay with the
server. A child past its deadline is killed and replaced; its memory goes with it.

Protocol on the child's stdin/stdout, every message an 8-byte big-endian length and that many
bytes: the parent may send one INIT message first; the child writes one byte, READY, once it has
imported and initialised what it needs (start-up never counts against a call's deadline); then
one request, one reply, in order. What the bytes mean is the caller's (JSON for templates,
marshal for grammars).
"""
from __future__ import annotations

import asyncio
import gc
import math
import os
import struct
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable

HEADER = struct.Struct(">Q")
READY = b"R"
START_TIMEOUT = 60.0  # a child's interpreter and imports; a loaded machine takes seconds
_ROOT = Path(__file__).resolve().parents[2]  # where native_server and py_engine are importable from


class WorkerProcess:
    """One child process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, module: str, init: bytes | None = None) -> WorkerProcess:
        """`python -m module`, sent `init` if given; EOFError if it does not say READY in START_TIMEOUT."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(_ROOT), os.environ.get("PYTHONPATH"))))}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        worker = cls(process)
        try:
            assert process.stdin is not None and process.stdout is not None
            if init is not None:
                process.stdin.write(HEADER.pack(len(init)) + init)
                await process.stdin.drain()
            if await asyncio.wait_for(process.stdout.readexactly(len(READY)), START_TIMEOUT) != READY:
                raise EOFError(f"the {module} worker did not start")
        except asyncio.TimeoutError:
            await worker.reap()
            raise EOFError(f"the {module} worker did not start within {START_TIMEOUT:g} s") from None
        except BaseException:  # cancelled too: reaped, so its pipes close on this loop, not at a later GC
            await worker.reap()
            raise
        return worker

    async def call(self, request: bytes) -> bytes:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(HEADER.pack(len(request)) + request)
        await self.process.stdin.drain()
        (size,) = HEADER.unpack(await self.process.stdout.readexactly(HEADER.size))
        return await self.process.stdout.readexactly(size)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def reap(self) -> None:
        self.kill()
        await self.process.wait()


# --- the child's side -----------------------------------------------------------------------------------
def read_message(stdin: BinaryIO) -> bytes | None:
    """The next message, or None when the parent closed the pipe (or died)."""
    header = stdin.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return stdin.read(size)


def write_message(stdout: BinaryIO, data: bytes) -> None:
    stdout.write(HEADER.pack(len(data)) + data)
    stdout.flush()


def serve(handle: Callable[[bytes], bytes], stdin: BinaryIO, stdout: BinaryIO,
          init: Callable[[bytes], Any] | None = None) -> None:
    """The child's loop: [read INIT, init(it)], READY, then handle(request) -> reply until the pipe closes."""
    if init is not None:
        message = read_message(stdin)
        if message is None:
            return
        init(message)
    stdout.write(READY)
    stdout.flush()
    while (request := read_message(stdin)) is not None:
        write_message(stdout, handle(request))


def limit_memory(nbytes: int) -> None:
    """Cap this process's address space (POSIX); a MemoryError then stays in the child."""
    try:
        import resource
    except ImportError:  # not on POSIX: the deadline still holds
        return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    except (ValueError, OSError):  # e.g. a lower hard limit already
        pass


def limit_cpu(seconds: float) -> None:
    """Let this process use at most `seconds` more CPU time from now (POSIX): past it the kernel's
    SIGXCPU ends it, even when nobody is left to kill it (a parent that died mid-compile) or the work
    is in a stage that never looks at a clock. Called per call: the limit counts the process's whole
    life, so each call moves it to what is used so far plus its own share. Core dumps are off (a
    killed child must leave nothing on disk). The hard limit stays, so the next call can raise it."""
    try:
        import resource
    except ImportError:  # not on POSIX: the parent's deadline still holds
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    except (ValueError, OSError):
        pass


def release_memory() -> None:
    """Free what a large request left: its garbage (an error's traceback holds the request's frames,
    and with them its body's copies, in a cycle the collector finds late), then glibc's free heap
    pages, which glibc keeps after megabytes of short-lived buffers (its mmap threshold grows with the
    first large free). ~10-50 ms; the trim is a no-op off glibc."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
