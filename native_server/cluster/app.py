"""The Serve application: an ingress deployment in front of N engine replicas.

    from native_server.cluster.app import build_app
    serve.run(build_app({"serve_args": ["tiny-shakespeare"], "replicas": 2}))

`build_app(args)` is also what a Serve config file names (docs/cluster.md):
`import_path: native_server.cluster.app:build_app` with `args:` these keys:
- serve_args: `ruvllm serve` options each replica is started with (the model first), e.g.
  ["smollm2-135m-instruct", "--max-concurrent", "32"]; or model: a model alone
- replicas (default 1), cpus_per_replica (default 1, also the replica's torch threads),
  gpus_per_replica (default 0)
- api_key, allowed_hosts (comma-separated, besides loopback names), max_body_bytes: the ingress's checks
- routing: "affinity" (the user's replica, else the prompt prefix's, else the least loaded; router.py), or
  "random" / "round-robin" / "least-loaded" alone (A/B measurements: benchmarks/cluster_bench.py)
- loopback: bind each replica's (and the ingress's) Serve gRPC server to 127.0.0.1 (replica.py;
  `serve --replicas` sets it when it starts Ray itself)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from native_server.api.middleware import LOOPBACK_HOSTS, AllowedHosts, APIKey
from native_server.api.request_body import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, RequestBody
from native_server.cluster import require_ray
from native_server.cluster.ingress import Forwarder, make_app, set_forwarder
from native_server.cluster.replica import EngineReplica, loopback_grpc

ENGINE, INGRESS = "ruvllm-engine", "ruvllm-ingress"
ROUTING = ("affinity", "random", "round-robin", "least-loaded")
MAX_ONGOING = 1024  # per replica: its engine queues past its batch (max_queue); Serve's default of 5 would starve it


@dataclass(frozen=True)
class ClusterOptions:
    serve_args: list = field(default_factory=lambda: ["tiny-shakespeare"])
    replicas: int = 1
    cpus_per_replica: int = 1
    gpus_per_replica: float = 0.0
    api_key: str | None = None
    allowed_hosts: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    loopback: bool = False
    routing: str = "affinity"

    @classmethod
    def from_dict(cls, args: dict) -> "ClusterOptions":
        args = dict(args or {})
        if "model" in args:
            args["serve_args"] = [str(args.pop("model")), *args.get("serve_args", [])]
        unknown = set(args) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown cluster options {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        options = cls(**args)
        if not isinstance(options.serve_args, list) or not all(isinstance(a, str) for a in options.serve_args):
            raise ValueError("serve_args: a list of `ruvllm serve` arguments, the model first")
        if not 1 <= options.replicas <= 1024 or not 1 <= options.cpus_per_replica <= 1024:
            raise ValueError("replicas and cpus_per_replica: integers in [1, 1024]")
        if options.routing not in ROUTING:
            raise ValueError(f"routing: one of {', '.join(ROUTING)}, got {options.routing!r}")
        return options


def build_app(args: dict) -> Any:
    """The bound application (serve.run / a config file's import_path)."""
    require_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    options = ClusterOptions.from_dict(args)
    from native_server.cluster.router import AffinityRouter

    router = RequestRouterConfig(request_router_class=AffinityRouter,
                                 request_router_kwargs={"capacity": MAX_ONGOING, "policy": options.routing})
    engine = serve.deployment(EngineReplica, name=ENGINE, num_replicas=options.replicas,
                              max_ongoing_requests=MAX_ONGOING, request_router_config=router,
                              health_check_period_s=2, health_check_timeout_s=60, graceful_shutdown_timeout_s=30,
                              ray_actor_options={"num_cpus": options.cpus_per_replica,
                                                 "num_gpus": options.gpus_per_replica})
    ingress = serve.deployment(_ingress_class(options), name=INGRESS, num_replicas=1,
                               max_ongoing_requests=4 * MAX_ONGOING, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(options.serve_args, options.cpus_per_replica, options.loopback), options.loopback)


def _ingress_class(options: ClusterOptions) -> type:
    from ray import serve

    app = make_app()
    extra = tuple(h.strip() for h in (options.allowed_hosts or "").split(",") if h.strip())
    app.add_middleware(RequestBody, max_bytes=options.max_body_bytes, timeout=DEFAULT_BODY_TIMEOUT)
    app.add_middleware(APIKey, api_key=options.api_key)
    app.add_middleware(AllowedHosts, hosts=("*",) if "*" in extra else (*LOOPBACK_HOSTS, *extra))

    @serve.ingress(app)
    class Ingress:
        def __init__(self, engine: Any, loopback: bool = False) -> None:
            if loopback:
                loopback_grpc()
            set_forwarder(Forwarder(engine))

    return Ingress
