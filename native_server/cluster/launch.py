"""`ruvllm serve MODEL --replicas N`: Ray Serve with N engine replicas behind one OpenAI endpoint.

Without --ray-address, Ray starts here (with $RAY_NUM_CPUS CPUs if set, else
all of them) and stays on loopback: its node IP is
127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray from swapping in the
machine's address), no dashboard, no usage reporting, the HTTP proxy on
--host (127.0.0.1 by default), and each replica's gRPC server on 127.0.0.1
(replica.py). With --ray-address the cluster is the operator's (`ray start
--head` / `ray start --address`, docs/cluster.md) and replicas go where Ray
places them. SIGTERM or Ctrl-C shuts Serve down (running requests get
--shutdown-timeout to finish) and stops a Ray this command started.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from native_server.cluster import require_ray

logger = logging.getLogger("ruvllm.cluster")
APP_NAME = "ruvllm"
# serve options the ingress or the launcher takes; a replica is started with the others
CLUSTER_FLAGS = {"--replicas", "--ray-address", "--cpus-per-replica", "--gpus-per-replica", "--routing", "--host",
                 "--port", "--api-key", "--allowed-hosts"}


def loopback_ray_env() -> dict[str, str]:
    """Environment for a Ray that stays on 127.0.0.1, reports nothing, and tolerates a loaded machine."""
    # Serve's proxy must answer its readiness check in 5 s (3 misses and it is killed, and serve.start fails):
    # on a busy small machine (the tests' 2 shared cores) a minute is allowed
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DISABLE_IMPORT_WARNING": "1", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
            "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def start_local_ray(num_cpus: int | None = None, num_gpus: int | None = None) -> str:
    """Start Ray here on loopback; returns its GCS address (ray.init(address=...) joins it)."""
    os.environ.update(loopback_ray_env())  # before ray starts its processes: they inherit it
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # read when ray was imported, if it was before this
    context = ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus,
                       num_gpus=num_gpus, log_to_driver=True, configure_logging=False)
    return context.address_info["gcs_address"]


def replica_argv(argv: list[str]) -> list[str]:
    """`ruvllm [--verbose] serve ...` as typed, less the command and the options the cluster takes."""
    out, skip = [], False
    args = argv[argv.index("serve") + 1:] if "serve" in argv else list(argv)
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in CLUSTER_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def serve_replicas(args: argparse.Namespace) -> int:
    require_ray()
    import ray
    from ray import serve

    from native_server.cluster.app import build_app

    local = args.ray_address is None
    if local:
        address = start_local_ray(int(os.environ["RAY_NUM_CPUS"]) if os.environ.get("RAY_NUM_CPUS") else None)
        print(f"ray cluster: {address} (ray status --address {address})", file=sys.stderr, flush=True)
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=args.ray_address)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app({"serve_args": replica_argv(getattr(args, "argv", [])), "replicas": args.replicas,
                         "cpus_per_replica": args.cpus_per_replica, "gpus_per_replica": args.gpus_per_replica,
                         "api_key": args.api_key, "allowed_hosts": args.allowed_hosts, "loopback": local,
                         "routing": args.routing})
        serve.run(app, name=APP_NAME, route_prefix="/")
        logger.info("%d replicas of %s behind http://%s:%d", args.replicas, args.model, args.host, args.port)
        _wait_for_signal()
        serve.delete(APP_NAME)
        return 0
    finally:
        if local:
            serve.shutdown()
            ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
