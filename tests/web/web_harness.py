"""The demo page's test rig: web/dist served as `ruvllm serve` serves it, and a headless Chromium.

`static_server(dist)` runs the server's own static-file app (native_server.api.app.DemoFiles behind
its IsolationHeaders middleware: COOP/COEP, application/wasm, text/javascript) on 127.0.0.1
without loading a model. `browser(profile)` is Playwright driving Debian's Chromium
(/usr/bin/chromium; Playwright never downloads a browser here); every request the page makes
is recorded so tests can check none leaves 127.0.0.1.
"""
from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-default-apps", "--no-first-run"]
WEBGPU_ARGS = ["--enable-unsafe-webgpu", "--enable-features=Vulkan", "--use-angle=swiftshader"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def static_server(dist: Path) -> Iterator[str]:
    """Serve dist at http://127.0.0.1:PORT/ until the block ends; yields the base URL."""
    import uvicorn
    from starlette.applications import Starlette

    from native_server.api.app import DemoFiles
    from native_server.api.middleware import IsolationHeaders

    app = Starlette()
    app.mount("/", DemoFiles(directory=dist, html=True), name="web")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(IsolationHeaders(app), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the static server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def browser(profile: Path, webgpu: bool = False, extra_args: tuple[str, ...] = ()) -> Iterator[tuple[object, list[str]]]:
    """A persistent Chromium context (profile keeps the Cache API across pages); yields it and the request log.
    webgpu: navigator.gpu offers an adapter (SwiftShader, a software GPU, on 127.0.0.1 pages); extra_args: more
    Chromium switches."""
    from playwright.sync_api import sync_playwright

    requests: list[str] = []
    args = [a for a in CHROMIUM_ARGS if not (webgpu and a == "--disable-gpu")] + (WEBGPU_ARGS if webgpu else [])
    args += list(extra_args)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                        args=args)
        context.on("request", lambda r: requests.append(r.url))
        try:
            yield context, requests
        finally:
            context.close()


def require_page() -> None:
    """Skip (locally; CI=true fails) when the page cannot be built or shown here."""
    import pytest

    from tests.paths import REPO

    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is missing: apt-get install -y chromium (make test does, as root)")
    if not (REPO / "npm" / "node_modules" / "pyodide").is_dir():
        pytest.skip("npm/node_modules lacks pyodide: run `npm ci --prefix npm` (make test does)")


def tiny_page(root: Path, builtin: bool) -> Path:
    """The page (web/dist) over two tiny random models, qwen2 and llama, exported fp32 for the web;
    with the built-in model too when `builtin`."""
    from export.exporter import export_model
    from export.options import ExportOptions
    from tests.tiny_models import build_tiny_model
    from web.build import build_dist

    models = {}
    for family in ("qwen2", "llama"):
        hf = build_tiny_model(root / family, family)
        export_model(hf, root / f"{family}-onnx", ExportOptions(precision="fp32", target="web"))
        models[family] = root / f"{family}-onnx"
    return build_dist(root / "dist", models, builtin=builtin)
