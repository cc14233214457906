"""A real `ruvllm serve` in a subprocess on a free 127.0.0.1 port, for the server's end-to-end tests.

`running_server(model_dir, *args)` starts `python -m ruvllm_cli serve`,
waits for /health, yields a `Server` (its URL, process and log), and stops it
with SIGTERM, asserting that it exits with status 0 within a bound. One torch
thread per server: the tests run on two shared cores. `http_process` is the
start / wait / stop under it, which benchmarks/server_bench.py and
llama_cpp_bench.py use for their servers too.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from tests.paths import REPO

API_KEY = "test-key-123"
STARTUP_TIMEOUT = 180.0
EXIT_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self, client: httpx.Client | None = None) -> dict[str, float]:
        """/metrics parsed into {"name{labels}": value}, enough for assertions."""
        text = (client or httpx).get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self, timeout: float = EXIT_TIMEOUT) -> int:
        """SIGTERM, then the exit status (the test fails if it takes longer than `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(f"server did not exit {timeout}s after SIGTERM; log:\n{self.log()[-3000:]}")


@contextlib.contextmanager
def http_process(command: list[str], url: str, ready_path: str, log_path: Path, what: str = "server",
                 env: dict[str, str] | None = None, startup_s: float = STARTUP_TIMEOUT,
                 stop_s: float = EXIT_TIMEOUT) -> Iterator[subprocess.Popen]:
    """Start an HTTP server (output to log_path), wait until GET url + ready_path answers 200, yield
    the process; at the end SIGTERM, then kill after stop_s. RuntimeError, with the log's tail, if it
    exits or is not ready within startup_s."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {process.returncode}" if process.poll() is not None else "is not ready"
                raise RuntimeError(f"{what} {state}; log {log_path}:\n{log_path.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}{ready_path}", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(stop_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@contextlib.contextmanager
def running_server(model: Path | str, *args: str, log_dir: Path, prelude: str | None = None,
                   threads: int = 1) -> Iterator[Server]:
    """`prelude`: Python run in the server process before the CLI (a test's fault injection); `threads`: its torch
    threads and so the CPU kernels' pool (OMP_NUM_THREADS; tests keep 1, a benchmark passes its own)."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env.pop("RUVLLM_API_KEY", None)
    launch = ["-m", "ruvllm_cli"] if prelude is None else [
        "-c", f"import sys\n{prelude}\nfrom ruvllm_cli.main import main\nsys.exit(main(sys.argv[1:]))"]
    command = [sys.executable, *launch, "serve", str(model), "--port", str(port),
               "--device", "cpu", "--log-level", "info", *args]
    url = f"http://127.0.0.1:{port}"
    with http_process(command, url, "/health", log_path, env=env) as process:
        yield Server(url, process, log_path)


def metric(metrics: dict[str, float], name: str) -> float:
    """One sample by name (labels included when the metric has them)."""
    return metrics[f"ruvllm_{name}"]


def histogram_count(metrics: dict[str, float], name: str) -> float:
    return metrics[f"ruvllm_{name}_count"]


def wait_until(server: Server, condition, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until condition(metrics) holds; the metrics then. Fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if condition(metrics):
            return metrics
        assert time.monotonic() < deadline, f"not reached within {timeout}s"
        time.sleep(0.05)


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def no_traceback(log: str) -> bool:
    return re.search(r"Traceback \(most recent call last\)", log) is None


def greedy_completions(server: "Server", prompts: list[str], max_tokens: int) -> list[str]:
    """The texts of concurrent greedy completions (ignore_eos) of prompts, through the official openai client."""
    import asyncio

    import openai

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        async with client:
            outs = await asyncio.gather(*(client.completions.create(
                model=None, prompt=p, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))
        return [o.choices[0].text for o in outs]
    return asyncio.run(run())
