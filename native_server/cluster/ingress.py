"""The cluster's one HTTP endpoint: route each request to an engine replica and stream its answer back.

The ingress does what needs the whole cluster and leaves the rest to the
replicas, which run the unchanged OpenAI app (replica.py):
- it bounds the body (size, read time), checks Host and the API key, reads
  the JSON only to make the `RouteKey` (router.py picks the replica);
- it forwards the request and relays status, headers and body as they come,
  adding `x-ruvllm-replica` (which replica answered) and `x-ruvllm-route`
  (why: user, prefix, least-loaded, or fallback when the chosen one refused);
- a replica that dies before the client got any byte of its answer: the
  request is sent once more, to another replica; after that, or once bytes
  went out, the client gets an OpenAI-shaped error (503 JSON, or an error
  event ending the stream);
- /metrics sums every live replica's metrics (same names and labels) and adds
  the router's (ruvllm_cluster_*); /health is 200 while a replica lives;
  loading or unloading a LoRA adapter goes to every live replica.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from native_server.api.errors import error_body
from native_server.cluster.routing import RouteKey, current_router, route_key

logger = logging.getLogger("ruvllm.cluster")
HOP_HEADERS = {"host", "authorization", "connection", "keep-alive", "transfer-encoding", "upgrade", "te",
               "content-length"}
FAN_OUT = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
FAN_OUT_TIMEOUT = 60.0


class ReplicaLost(Exception):
    """The replica died or could not be reached."""


def _lost_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex
    from ray.serve import exceptions as sex

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError", "WorkerCrashedError")
    found = tuple(getattr(rex, n) for n in names if hasattr(rex, n))
    return found + tuple(getattr(sex, n) for n in ("DeploymentUnavailableError",) if hasattr(sex, n))


class Forwarder:
    """The ingress's logic over an engine DeploymentHandle (a class, so tests can drive it)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine.options(stream=True)  # one handle, so one request router (one affinity table)
        self.lost = _lost_errors()
        self.retries = 0
        self.failed = 0

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body) if body and request.method == "POST" else None
        except ValueError:
            parsed = None  # the replica answers with its own 400
        key = route_key(request.url.path, parsed)
        message = {"method": request.method, "path": request.url.path, "query": request.url.query.encode(),
                   "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS],
                   "body": body}
        for attempt in (0, 1):
            parts = self._stream(message, key)
            try:
                head, first, done = await self._start(parts)
            except ReplicaLost as exc:
                _cancel(parts)
                if attempt == 0:
                    self.retries += 1
                    logger.warning("replica lost before answering (%s): retrying once", exc)
                    continue
                self.failed += 1
                return JSONResponse(error_body(503, f"the replica serving this request failed twice ({exc}); "
                                                    "retry later"), status_code=503)
            headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
            headers.update({"x-ruvllm-replica": head["replica"], "x-ruvllm-route": head["route"]})
            if done:
                return Response(first, status_code=head["status"], headers=headers)
            return StreamingResponse(self._relay(first, parts, True), status_code=head["status"], headers=headers)
        raise AssertionError("unreachable")

    def _stream(self, message: dict, key: RouteKey) -> AsyncIterator[Any]:
        return self.engine.handle.remote(message, route=key).__aiter__()

    async def _start(self, parts: AsyncIterator[Any]) -> tuple[dict, bytes, bool]:
        """The head and the whole body, or for an event stream its first chunk (done: False). Until this
        returns, nothing has gone to the client, so a lost replica can be retried."""
        try:
            head = await parts.__anext__()
            if not _is_sse(head):
                return head, b"".join([chunk async for chunk in parts]), True
            try:
                return head, await parts.__anext__(), False
            except StopAsyncIteration:
                return head, b"", True
        except self.lost as exc:
            raise ReplicaLost(type(exc).__name__) from None
        except StopAsyncIteration:
            raise ReplicaLost("no answer") from None

    async def _relay(self, first: bytes, parts: Any, sse: bool) -> AsyncIterator[bytes]:
        yield first
        finished = False
        try:
            async for chunk in parts:
                yield chunk
            finished = True
        except self.lost as exc:
            finished = True
            self.failed += 1
            logger.warning("replica lost mid-stream (%s)", type(exc).__name__)
            error = error_body(503, f"the replica serving this stream failed ({type(exc).__name__}); the text so "
                                    "far is all there is")
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            if not finished:  # the client left: the replica's app sees a disconnect and aborts the request
                _cancel(parts)

    async def fan_out(self, request: Request, replicas: list[str]) -> Response:
        """The same request to every replica (adapters): the first failure's answer, else the last success."""
        body = await request.body()
        message = {"method": request.method, "path": request.url.path, "query": b"",
                   "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS],
                   "body": body}
        answers = await asyncio.gather(*(self._whole(message, r) for r in replicas))
        for status, headers, content in answers:
            if status >= 400:
                return Response(content, status_code=status, headers=headers)
        status, headers, content = answers[-1]
        return Response(content, status_code=status, headers=headers)

    async def _whole(self, message: dict, replica: str) -> tuple[int, dict, bytes]:
        head, chunks = None, []
        gen = self.engine.handle.remote(message, replica=replica)
        async for part in gen:
            if isinstance(part, dict):
                head = part
            else:
                chunks.append(part)
        headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
        return head["status"], headers, b"".join(chunks)

    async def metrics_of(self, replica: str | None) -> str:
        return "".join([part async for part in self.engine.metrics.remote(replica=replica)])

    async def metrics(self, replicas: list[str], router: Any) -> str:
        texts = await asyncio.wait_for(asyncio.gather(*(self.metrics_of(r) for r in replicas)), FAN_OUT_TIMEOUT)
        return sum_metrics(texts) + cluster_metrics(router, replicas, self.retries, self.failed)


def _cancel(parts: Any) -> None:
    cancel = getattr(parts, "cancel", None)
    if cancel is not None:
        cancel()


def _is_sse(head: dict) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])


def sum_metrics(texts: list[str]) -> str:
    """Prometheus texts of the same metrics summed sample by sample (HELP/TYPE lines kept once); the ratios
    are recomputed from the sums, and per-token sizes (the same on every replica) averaged."""
    order: list[str] = []
    values: dict[str, float] = defaultdict(float)
    for text in texts:
        for line in text.splitlines():
            if not line or line.startswith("#"):
                if line and line not in order:
                    order.append(line)
                continue
            name, _, value = line.rpartition(" ")
            if name not in values:
                order.append(name)
            values[name] += float(value)
    for name in [n for n in values if n.endswith("_per_token")]:
        values[name] /= max(len(texts), 1)
    for ratio, (num, den) in RATIOS.items():
        if ratio in values and den in values:
            values[ratio] = values[num] / values[den] if values[den] else 0.0
    return "".join(f"{k}\n" if k.startswith("#") else f"{k} {_number(values[k])}\n" for k in order)


RATIOS = {"ruvllm_kv_cache_usage_perc": ("ruvllm_kv_cache_blocks_used", "ruvllm_kv_cache_blocks_total"),
          "ruvllm_prefix_cache_hit_rate": ("ruvllm_prefix_cache_hits_total", "ruvllm_prefix_cache_queries_total")}


def _number(v: float) -> str:
    return str(int(v)) if v == int(v) and abs(v) < 2 ** 53 else repr(v)


def cluster_metrics(router: Any, replicas: list[str], retries: int, failed: int) -> str:
    lines = ["# HELP ruvllm_cluster_replicas Engine replicas alive", "# TYPE ruvllm_cluster_replicas gauge",
             f"ruvllm_cluster_replicas {len(replicas)}",
             "# HELP ruvllm_cluster_retries_total Requests sent again after their replica died before answering",
             "# TYPE ruvllm_cluster_retries_total counter", f"ruvllm_cluster_retries_total {retries}",
             "# HELP ruvllm_cluster_failed_total Requests that failed because their replica died",
             "# TYPE ruvllm_cluster_failed_total counter", f"ruvllm_cluster_failed_total {failed}",
             "# HELP ruvllm_cluster_routed_total Requests routed, by replica and reason",
             "# TYPE ruvllm_cluster_routed_total counter"]
    if router is not None:
        for (replica, reason), n in sorted(router.routes.items()):
            lines.append(f'ruvllm_cluster_routed_total{{replica="{replica}",reason="{reason}"}} {n}')
        lines += ["# HELP ruvllm_cluster_in_flight Requests in flight, by replica",
                  "# TYPE ruvllm_cluster_in_flight gauge"]
        lines += [f'ruvllm_cluster_in_flight{{replica="{r}"}} {router.in_flight[r]}' for r in replicas]
    return "\n".join(lines) + "\n"


_CURRENT: list[Forwarder] = []  # the ingress replica's (one a process)


def set_forwarder(forwarder: Forwarder) -> None:
    _CURRENT[:] = [forwarder]


def current_forwarder(request: Request) -> Forwarder:
    """The Forwarder of this process's ingress. Module-level, so the app and the deployment class, which Serve
    serializes apart, both reach this module's state rather than copies of a closure's."""
    return _CURRENT[0]


def make_app(forwarder_of: Any = current_forwarder) -> FastAPI:
    """The ingress's routes; forwarder_of(request) gives the Forwarder (the deployment's)."""
    app = FastAPI(title="ruvllm cluster", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health(request: Request) -> Response:
        replicas = await _replicas(forwarder_of(request))
        if not replicas:
            return JSONResponse(error_body(503, "no engine replica is running"), status_code=503)
        return JSONResponse({"status": "ok", "replicas": len(replicas)})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        forwarder = forwarder_of(request)
        replicas = await _replicas(forwarder)
        return PlainTextResponse(await forwarder.metrics(replicas, _router()), media_type=PROMETHEUS)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(request: Request, path: str) -> Response:
        forwarder = forwarder_of(request)
        if request.method == "POST" and request.url.path in FAN_OUT:
            return await forwarder.fan_out(request, await _replicas(forwarder))
        return await forwarder.forward(request)

    return app


def _router() -> Any:
    return current_router()


async def _replicas(forwarder: Forwarder) -> list[str]:
    """The live replicas' ids, from the handle's router (made on the handle's first request)."""
    router = _router()
    if router is None:  # no request has gone through the handle yet: one cheap one creates its router
        await forwarder.metrics_of(None)
        router = _router()
    return router.live() if router is not None else []
