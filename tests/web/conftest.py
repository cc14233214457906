"""Fixtures shared by the web legs of the golden matrix (tests/web/test_npm.py, tests/web/test_web_page.py)."""
from __future__ import annotations

import pytest

from tests.web.smollm2_golden import SmolLM2Web, build_smollm2_web


@pytest.fixture(scope="session")
def smollm2_web(tmp_path_factory) -> SmolLM2Web:
    """SmolLM2's int4 web export and CPython's greedy replies, once per session (skips without the GGUF)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("gguf")
    from tests.importers.smollm2_file import smollm2_path

    smollm2_path()
    return build_smollm2_web(tmp_path_factory.mktemp("smollm2-web"))


@pytest.fixture(scope="session")
def kquant_web(tmp_path_factory) -> SmolLM2Web:
    """A Q4_K_M-style GGUF's int4 web export and CPython's greedy tokens (tests/web/kquant_web.py)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("gguf")
    from tests.web.kquant_web import build_kquant_web

    return build_kquant_web(tmp_path_factory.mktemp("kquant-web"))
