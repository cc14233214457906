"""A scratch Node project with the npm package installed from its packed tarball, as an app would have it.

Offline: pyodide and onnxruntime-web come from npm's cache (`npm ci --prefix npm`
fills it) and the jinja2/markupsafe wheels from .cache/wheels (`python -m
web.wheels` fills it); without them the caller's test skips, saying why.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.paths import REPO
from tests.requires import tool

NPM_DIR = REPO / "npm"


def run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """A command with onnxruntime-node's post-install (a CUDA provider download) turned off."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"})


def install_packed(root: Path, project: Path) -> Path:
    """`npm pack` the package into root, then install the tarball into project (an ES-module package)."""
    tool("node"), tool("npm")
    from web.wheels import build_wheels

    try:
        build_wheels(NPM_DIR / "wheels")
    except (subprocess.CalledProcessError, RuntimeError) as error:
        pytest.skip(f"the jinja2/markupsafe wheels are not cached and PyPI is unreachable ({error}): "
                    "run `python -m web.wheels --out npm/wheels` once online (make test does)")
    packed = run(["npm", "pack", "--json", "--pack-destination", str(root)], NPM_DIR)
    assert packed.returncode == 0, packed.stderr
    tarball = root / json.loads(packed.stdout)[0]["filename"]
    project.mkdir(parents=True, exist_ok=True)
    if not (project / "package.json").exists():
        (project / "package.json").write_text(json.dumps({"name": "scratch", "private": True, "type": "module"}))
    # From npm's cache where it has the packages (make test fills it), else from the registry.
    install = run(["npm", "install", "--prefer-offline", "--no-audit", "--no-fund", str(tarball)], project)
    if install.returncode != 0 and ("ENOTCACHED" in install.stderr or "ENOTFOUND" in install.stderr
                                    or "EAI_AGAIN" in install.stderr):
        pytest.skip("npm's cache lacks pyodide/onnxruntime-web and the npm registry is unreachable: "
                    "run `make test-setup` once online (npm ci --prefix npm, then it fills npm's cache)")
    assert install.returncode == 0, install.stderr
    return project
