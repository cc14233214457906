"""One Ray Serve replica: a whole `ruvllm serve` (LLMEngine, AsyncEngine and the OpenAI app) in its own process.

The replica parses the same command-line options as `ruvllm serve` and
builds the same app (serve.build_server), but listens on nothing: the
ingress hands it each HTTP request as a dict, and `handle` runs it through
the app in-process (ASGI) and yields the response back: first its status
and headers, then its body as it is produced (a stream's events one by
one). So every endpoint behaves as on one server: chat, completions,
streaming, tools, structured outputs, adapters, errors, bounds. Serve
checks `check_health` (a dead engine fails it and Serve replaces the
replica) and calls `__del__` on shutdown (the engine drains).

Ray Serve 2.60 gives every replica an inter-deployment gRPC server bound to
[::] (every interface) although handles here never use it (they use Ray's
actor calls, RAY_SERVE_USE_GRPC_BY_DEFAULT unset). With loopback=True
(`ruvllm serve --replicas` when it starts Ray itself, and the tests) the
replica binds it to 127.0.0.1 instead, before Serve starts it.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator

logger = logging.getLogger("ruvllm.cluster")
BODY_CHUNK = 1 << 16


def loopback_grpc() -> None:
    """Serve binds its replica's gRPC server to "[::]:0" after the replica's constructor: rebind it to loopback."""
    from ray.serve._private import replica as serve_replica

    bind = serve_replica.add_port_to_grpc_server
    if getattr(bind, "ruvllm_loopback", False):
        return

    def loopback(server: Any, address: str) -> int:
        return bind(server, "127.0.0.1:0" if address == "[::]:0" else address)

    loopback.ruvllm_loopback = True
    serve_replica.add_port_to_grpc_server = loopback


class EngineReplica:
    """The engine deployment's class (app.py wraps it with serve.deployment)."""

    def __init__(self, serve_args: list[str], threads: int = 1, loopback: bool = False) -> None:
        if loopback:
            loopback_grpc()
        import torch

        from native_server.serve import build_server, parse_serve_args

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # a tensor-parallel replica's ranks share these (cpu_plan)
        args = parse_serve_args(serve_args)
        args.api_key, args.allowed_hosts = None, "*"  # the ingress checks both; it forwards neither header
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.app, self.ctx = build_server(args)
        self.ctx.engine.start()
        self.shutdown_timeout = args.shutdown_timeout
        self.replica_id = _own_id()

    async def handle(self, request: dict, route: Any = None, routed: tuple[str, str] | None = None,
                     replica: str | None = None, **_: Any) -> AsyncIterator[Any]:
        """request: method, path, query (bytes), headers [(name, value)], body (bytes). Yields a dict with status,
        headers, replica and route reason, then the body's bytes."""
        reason = routed[1] if routed is not None and routed[0] == self.replica_id else "fallback"
        async for part in call_app(self.app, request):
            if isinstance(part, dict):
                part = {**part, "replica": self.replica_id, "route": reason}
            yield part

    async def metrics(self, replica: str | None = None, **_: Any) -> AsyncIterator[str]:
        """The replica's own /metrics text, as one part (the ingress's handle streams; it sums the replicas')."""
        from native_server.learning.learner import learning_metrics

        yield self.ctx.metrics.render(self.ctx.engine.stats()) + learning_metrics(self.ctx.witness, self.ctx.learner)

    def check_health(self) -> None:
        dead = self.ctx.engine.dead_reason()
        if dead is not None:
            raise RuntimeError(dead)

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is None:
            return
        try:
            loop = asyncio.get_event_loop()
            if loop.is_running():
                ctx.drain(self.shutdown_timeout)
            else:
                loop.run_until_complete(ctx.drain(self.shutdown_timeout))
        except Exception:  # noqa: BLE001 - the process is going away
            logger.warning("replica shutdown: the engine did not drain cleanly")


def _own_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


async def call_app(app: Any, request: dict) -> AsyncIterator[Any]:
    """Run one HTTP request through an ASGI app: yields {"status", "headers"}, then body chunks (bytes).

    Closing the generator early (the client left) tells the app the client disconnected, as uvicorn would."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body, delivered = request.get("body", b""), False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request["method"],
             "scheme": "http", "path": request["path"], "raw_path": request["path"].encode(),
             "query_string": request.get("query", b""), "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.get("headers", [])],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                if task.exception() is not None:
                    raise task.exception()
                return  # the app returned without finishing a response
            message = getter.result()
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 10)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the app's own cleanup; nobody reads it
                task.cancel()
