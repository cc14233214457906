"""uvicorn, with the shutdown `ruvllm serve` promises: drain on the first SIGTERM/SIGINT, exit status 0.

uvicorn alone, on SIGTERM, waits for open connections (a stream may run for
minutes) and, once down, re-raises the signal so the process dies of it
(status 143). Here the first signal also starts the engine's drain
(`ServerContext.drain`): running requests get `shutdown_timeout` seconds,
the rest are aborted, so every stream ends and uvicorn's wait is short; and
the signal is not re-raised. A second SIGINT still exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from native_server.context import ServerContext

logger = logging.getLogger("ruvllm.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.ctx, self.shutdown_timeout = ctx, shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: set flags, hand the drain to the event loop (call_soon_threadsafe is safe here).
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if self.loop is not None and not self.ctx.draining:
            logger.info("%s: draining (up to %gs), then exiting", signal.Signals(sig).name, self.shutdown_timeout)
            self.loop.call_soon_threadsafe(self.ctx.drain, self.shutdown_timeout)

    async def serve(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)
