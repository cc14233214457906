"""Every code example of README.md, npm/README.md and docs/ runs as a reader would run it.

One test per page: its blocks run in order in a scratch folder that holds a
link to each top-level entry of the repository (so `py_engine/data/...`
resolves as in a clone) with .venv/bin first on PATH (as after `source
.venv/bin/activate`), and, for a page with JavaScript, the npm package packed
and installed there as an app would have it. How a block runs: examples.py.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from tests.docs.examples import Example, examples, pages
from tests.paths import REPO
from tests.server.server_harness import free_port

pytestmark = pytest.mark.slow

BLOCK_TIMEOUT = 600  # s: a block that exports SmolLM2 or builds the page takes a minute or two on 2 cores
SERVER_TIMEOUT = 600


def _scratch(root: Path) -> Path:
    """A folder that looks like the clone's root: links to its top-level entries; what blocks write stays here."""
    for entry in REPO.iterdir():
        if entry.name not in (".git", "node_modules") and not entry.name.startswith((".pytest", ".hypothesis")):
            (root / entry.name).symlink_to(entry)
    return root


def _env() -> dict[str, str]:
    venv = REPO / ".venv"
    return {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv), "PYTHONUNBUFFERED": "1", "ONNXRUNTIME_NODE_INSTALL": "skip"}


def _with_port(example: Example, ports: dict[int, int]) -> Example:
    """The example with each documented port of a server started earlier replaced by the free one it got."""
    code = example.code
    for documented, free in ports.items():
        code = code.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{free}").replace(f"--port {documented}",
                                                                                      f"--port {free}")
    return replace(example, code=code)


def _command(example: Example, folder: Path) -> list[str]:
    stem = f"example_{example.line}"
    if example.language == "python":
        (folder / f"{stem}.py").write_text(example.code)
        return [sys.executable, f"{stem}.py"]
    if example.language == "js":
        (folder / f"{stem}.mjs").write_text(example.code)
        return ["node", f"{stem}.mjs"]
    return ["bash", "-e", "-o", "pipefail", "-c", example.code]


class _Server:
    """A block that serves: started in its own process group, stopped with the page."""

    def __init__(self, example: Example, folder: Path, port: int) -> None:
        self.example, self.port = example, port
        self.log = folder / f"server_{example.line}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(_command(example, folder), cwd=folder, env=_env(), stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + SERVER_TIMEOUT
        while not self._up():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{example.where}: the server did not come up on port {self.port}:\n{self.tail()}")
            time.sleep(1)

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _run(example: Example, folder: Path) -> None:
    done = subprocess.run(_command(example, folder), cwd=folder, env=_env(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{example.where} exited {done.returncode}:\n{example.code}\n---\n{output[-4000:]}"
    if example.directive == "expect":
        assert re.search(example.argument, output), f"{example.where}: no /{example.argument}/ in:\n{output[-4000:]}"


def _blocks(page: Path) -> list[Example]:
    """The blocks a reader runs: not ```text, not marked skip."""
    return [e for e in examples(page) if e.language != "text" and e.directive != "skip"]


# pages of prose and ```text only (docs/cluster.md, grammars.md, server-apis.md today) have nothing to run:
# they are left out of the parametrization, not skipped (CI=true turns a skip into a failure)
@pytest.mark.parametrize("page", [p for p in pages() if _blocks(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_of_the_page_runs(page, tmp_path):
    blocks = _blocks(page)
    folder = _scratch(tmp_path)
    if any(e.language == "js" for e in blocks):
        from tests.web.npm_project import install_packed

        pack = tmp_path / ".npm-pack"
        pack.mkdir()
        install_packed(pack, folder)
    servers: list[_Server] = []
    ports: dict[int, int] = {}  # a documented port -> a free one (another server may hold the documented one)
    try:
        for example in blocks:
            if example.directive == "server":
                for server in servers:
                    server.stop()
                ports[int(example.argument)] = free_port()
                servers = [_Server(_with_port(example, ports), folder, ports[int(example.argument)])]
            else:
                _run(_with_port(example, ports), folder)
    finally:
        for server in servers:
            server.stop()
