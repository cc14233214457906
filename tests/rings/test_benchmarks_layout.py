"""The benchmarks can be rerun from any clone: one shared helper module, no path of one machine, and
llama.cpp's tools from `make bench-anchors` (benchmarks/anchors.py), built so they run on this CPU."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.paths import REPO

BENCH = REPO / "benchmarks"
MACHINE_PATH = re.compile(r"""["'`(\s](/work/|/home/|/root/|/Users/|/tmp/lcp|/opt/)""")


def _scripts():
    return sorted(BENCH.glob("*.py"))


def test_no_script_names_a_path_of_one_machine():
    found = {p.name: m.group(1) for p in [*_scripts(), BENCH / "README.md"] for m in [MACHINE_PATH.search(p.read_text())] if m}
    assert found == {}


def test_only_common_edits_sys_path_and_nothing_imports_helpers_from_another_script():
    """common.py puts the clone's root on sys.path once; a script may still put *another checkout* there
    (an A/B against old code: decode_engines' ruvllm@REV, qtile_bench's and server_bench's --baseline,
    spec_decode's --before)."""
    helpers_from_scripts, edits = [], []
    for path in _scripts():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("decode_speed", "benchmarks.decode_speed"):
                helpers_from_scripts.append(path.name)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "insert"
                    and ast.unparse(node.func.value) == "sys.path"):
                edits.append((path.name, ast.unparse(node.args[1])))
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.path" and isinstance(
                    node.ctx, ast.Store):
                edits.append((path.name, "slice"))
    assert helpers_from_scripts == []
    assert sorted(edits) == [("common.py", "str(REPO)"), ("decode_engines.py", "str(source_tree(revision) if revision else REPO)"),
                             ("qtile_bench.py", "root"), ("spec_decode.py", "source")]


def test_every_script_imports_common_from_beside_it():
    """Run as `python benchmarks/NAME.py` (benchmarks/ first on sys.path), `import common` finds the helper and
    makes the clone importable, whatever the working directory."""
    code = "import runpy, sys; sys.path.insert(0, sys.argv[1]); import common; print(common.REPO)"
    done = subprocess.run([sys.executable, "-c", code, str(BENCH)], cwd="/", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(REPO), done.stderr


def test_amx_is_left_out_where_the_cpu_has_it_and_the_kernel_refuses_it():
    sys.path.insert(0, str(BENCH))
    try:
        import anchors
    finally:
        sys.path.remove(str(BENCH))
    amx = {"avx512f", "amx_tile", "amx_int8", "amx_bf16"}
    assert anchors.compiler_flags(amx, granted=False) == anchors.NO_AMX
    assert anchors.compiler_flags(amx, granted=True) == ()
    assert anchors.compiler_flags(amx, granted=True, force_off=True) == anchors.NO_AMX
    assert anchors.compiler_flags({"avx2", "fma"}, granted=False) == ()  # nothing to leave out
    args = anchors.cmake_args(REPO / "src", REPO / "build", anchors.NO_AMX)
    assert "-DGGML_NATIVE=ON" in args and f"-DCMAKE_C_FLAGS={' '.join(anchors.NO_AMX)}" in args
    assert isinstance(anchors.amx_granted(), bool)  # asks the kernel (arch_prctl); False off x86-64 Linux


def test_the_anchors_are_found_in_the_cache_or_the_error_says_how_to_build_them(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.delenv("RUVLLM_LLAMA_CPP_BIN", raising=False)
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.setattr(common, "ANCHORS", tmp_path)
    try:
        common.llama_cpp_bin()
    except SystemExit as exit:
        assert "make bench-anchors" in str(exit)
    else:
        raise AssertionError("no llama-bench in an empty cache, yet no error")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-bench").write_text("")
    assert common.llama_cpp_bin() == tmp_path / "bin"
