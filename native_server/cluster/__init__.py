"""Many engines behind one OpenAI endpoint, on Ray Serve: `ruvllm serve MODEL --replicas N`.

    routing.py   the policy: the user's replica, else the prompt prefix's, else the least loaded (pure Python)
    router.py    that policy as the engine deployment's Ray Serve request router
    replica.py   a replica: a whole `ruvllm serve` (engine and OpenAI app) run in-process, no port of its own
    ingress.py   the endpoint: bounds, routing keys, relaying with one retry, summed /metrics, adapter fan-out
    app.py       build_app: the Serve application (also the import path of a Serve config file)
    launch.py    `serve --replicas`: Ray on this machine (127.0.0.1 only) or a running cluster, then Serve

Ray is optional (`pip install 'ruvllm[cluster]'`); only this package imports it.
"""
from __future__ import annotations

CLUSTER_EXTRA = "pip install 'ruvllm[cluster]'"


def require_ray() -> None:
    """Raise one ImportError naming the extra when Ray Serve is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"replicas run on Ray Serve, which is not installed: {CLUSTER_EXTRA} ({exc})") from None
