"""One `ruvllm serve tiny-shakespeare --replicas 2` for the module: a local Ray cluster (2 CPUs, 127.0.0.1 only)
started by the command itself, with two replicas of the built-in model. The tests read the cluster through its
HTTP endpoint alone (never joining Ray: another helper's Ray may run on the machine) and kill a replica's
process as a crash would.

Ray's start-up is the slow part (~15 s, ~25 s more to deploy), so every cluster test shares it."""
from __future__ import annotations

import os
import sys
import time

import pytest

from tests.server.server_harness import http_process


def quiet_port() -> int:
    """A free port outside the ephemeral range (and Ray's worker ports, 10002-19999): Ray's processes bind
    ephemeral ports while it starts, and took a free_port() once before Serve's proxy could."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        pytest.skip("Ray Serve is not installed: pip install 'ray[serve]' (the project's cluster extra)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _ray()

    port = quiet_port()
    log = tmp_path_factory.mktemp("cluster") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RAY_NUM_CPUS": "2"}
    command = [sys.executable, "-m", "ruvllm_cli", "serve", "tiny-shakespeare", "--replicas", "2",
               "--max-concurrent", "4", "--port", str(port), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with http_process(command, url, "/health", log, what="ruvllm serve --replicas", env=env, startup_s=300,
                      stop_s=60) as process:
        wait_for_replicas(url, 2)  # /health answers once one replica lives
        yield url, process, log


def running_replicas(url: str) -> int:
    """Live engine replicas as the ingress's router sees them (Serve tells it when one starts or dies)."""
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("ruvllm_cluster_replicas "):
            return int(float(line.split()[1]))
    raise AssertionError("no ruvllm_cluster_replicas in /metrics")


def wait_for_replicas(url: str, n: int, timeout: float = 180.0) -> float:
    start = time.monotonic()
    while running_replicas(url) != n:
        assert time.monotonic() - start < timeout, f"not {n} running replicas after {timeout}s"
        time.sleep(0.5)
    return time.monotonic() - start


def engine_replica_pids(serve_pid: int) -> list[int]:
    """The engine replicas' processes (Ray actors under the serve command's process tree)."""
    from pathlib import Path

    from tests.net_sockets import process_tree

    out = []
    for pid in process_tree(serve_pid):
        try:
            if "ServeReplica:ruvllm:ruvllm-engine" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                out.append(pid)
        except OSError:
            continue
    return out
