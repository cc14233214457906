"""uvicorn, with the shutdown `ruvllm serve` promises: drain on the first SIGTERM/SIGINT, exit status 0.

uvicorn alone, on SIGTERM, waits for open connections (a stream may run for
minutes) and, once down, re-raises the signal so the process dies of it
(status 143). Here the first signal also starts the engine's drain
(`ServerContext.drain`): running requests get `shutdown_timeout` seconds,
the rest are aborted, so every stream ends and uvicorn's wait is short; and
the signal is not re-raised. A second SIGINT still exits at once.

Until the drain is over the listening socket stays open: a connection made
after the signal gets a 503 (the app refuses new work while draining)
rather than a refused connection, so a load balancer retries elsewhere.

If the engine loop dies (`fail`, the AsyncEngine's on_fatal), the server
exits the same way but with status 1, so a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from native_server.api.context import ServerContext

logger = logging.getLogger("ruvllm.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.ctx, self.shutdown_timeout = ctx, shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: set flags, hand the drain to the event loop (call_soon_threadsafe is safe here).
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if self.loop is not None and not self.ctx.draining:
            logger.info("%s: draining (up to %gs), then exiting", signal.Signals(sig).name, self.shutdown_timeout)
            self.loop.call_soon_threadsafe(self.ctx.drain, self.shutdown_timeout)

    def fail(self, error: BaseException) -> None:
        """The engine loop died (called on the event loop): exit with status 1."""
        logger.critical("the engine failed (%r): exiting with status 1", error)
        self.exit_code = 1
        self.should_exit = True
        self.ctx.drain(0.0)

    async def serve(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def shutdown(self, sockets: list | None = None) -> None:
        # Keep accepting (and answering 503) while running requests finish; then uvicorn's own shutdown.
        if self.ctx.draining:
            await asyncio.shield(self.ctx.drain(self.shutdown_timeout))
        await super().shutdown(sockets)
