"""What a test may skip for: locally anything it lacks, saying what to install; in CI only GPUs, hardware and ../shared.

A test of a surface the project ships (the page, the npm package, the JS
runtimes, the exports, the server...) that finds a tool, package or cache
missing skips with a reason naming what to install. In CI (CI=true; .ci/run
sets it) the suite must run every such surface, so tests/conftest.py turns
those skips into failures, with the reason. Only skips whose reason starts
with one of ALLOWED stay skips there: a GPU the machine lacks, a CPU without
the kernels' instruction set, and ../shared/fixtures where it is absent.
"""
from __future__ import annotations

import os
import platform
import shutil

CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
GPU = "GPU: "
HARDWARE = "hardware: "
SHARED = "shared fixture: "
ALLOWED = (GPU, HARDWARE, SHARED)
INSTALL = "make test installs everything the suite needs (pip install -e '.[test]', npm ci, apt-get install chromium)"


def allowed_in_ci(reason: str) -> bool:
    return reason.removeprefix("Skipped: ").startswith(ALLOWED)


def kernels_missing() -> str | None:
    """Why the CPU kernels (py_engine.kernels) do not load here, as a skip reason; None when they do."""
    from py_engine.kernels import cpu_kernels
    from py_engine.kernels.build import supported_cpu

    if cpu_kernels() is not None:
        return None
    if os.environ.get("RUVLLM_NO_KERNELS"):
        return "RUVLLM_NO_KERNELS is set: unset it to test the CPU kernels"
    if not supported_cpu():
        return f"{HARDWARE}the CPU kernels need AVX2 and FMA on x86-64 Linux ({platform.machine()} here)"
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")):
        return "no C compiler for the CPU kernels: apt-get install gcc"
    return "the CPU kernels failed to build or load: run py_engine.kernels.FLAGS over its SOURCES by hand to see why"


NODE = "apt-get install nodejs npm (Node 20 or later)"


def tool(name: str, install: str = NODE) -> str:
    """The path of a command the test runs, or a skip naming what installs it (a failure in CI)."""
    import pytest

    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is missing: {install}")
    return path
