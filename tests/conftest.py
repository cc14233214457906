"""Fixtures every test group may use, and the CI rule on skips. Paths and ../shared fixtures: tests/paths.py.

tests/ is a package (one folder per room: tokenizer/, chat/, generation/,
models/, cpu/, quant/, export/, server/, web/, hub/, importers/, cli/,
rings/), so helpers are imported by their full name (`from tests.paths
import REPO`) and two groups may hold modules of the same name.

With CI=true a skip for a missing tool, package or cache fails the test
(tests/requires.py says which skips stay allowed), at collection
(`importorskip` at module level) as well as in setup and the test itself.
"""
from __future__ import annotations

import os

import pytest

from tests.requires import CI, INSTALL, allowed_in_ci

# The Triton kernels (py_engine/gpu) run under Triton's interpreter where there is no CUDA GPU. The
# variable is read when triton.jit decorates a kernel, so it is set here, before any test imports one.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _fail_in_ci(report) -> None:
    if not (CI and report.skipped and isinstance(report.longrepr, tuple)) or hasattr(report, "wasxfail"):
        return
    path, line, reason = report.longrepr
    if not allowed_in_ci(reason):
        report.outcome = "failed"
        report.longrepr = f"{path}:{line}: CI=true, and this test may not skip: {reason.removeprefix('Skipped: ')}\n{INSTALL}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_in_ci(outcome.get_result())


@pytest.fixture(scope="module")
def torch_one_thread():
    """Tiny models, token-at-a-time forwards: thread hand-offs cost more than the math (and CI's 2 cores are shared)."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def calls(monkeypatch):
    """How many decode steps ran as one rk_decode_step call (py_engine.cpu.stack.StackPlan)."""
    from py_engine.cpu.stack import StackPlan

    count = {"n": 0}
    run = StackPlan.__call__

    def counted(self, *args):
        count["n"] += 1
        return run(self, *args)
    monkeypatch.setattr(StackPlan, "__call__", counted)
    return count
