"""llama.cpp's own GBNF engine as the reference that grammar-constrained outputs are checked against.

    checker = llama_grammar_checker()          # skips (fails in CI) without the sources or a compiler
    checker(grammar_text, [text, ...])         # -> ["complete" | "prefix" | "invalid N" | "bad-grammar", ...]

The checker is llama.cpp's grammar parser and its code-point matcher (src/llama-grammar.cpp, the
code llama-server's `grammar` field runs), compiled from the llama.cpp that the llama-cpp-python
sdist vendors, with a driver of ours: it walks each text's code points through the grammar's
stacks and says whether the text is a complete sentence, a prefix of one (output cut by
max_tokens), or where it first left the grammar. The grammar code is built without the rest of
libllama: the vocabulary methods it links to are never reached without a vocabulary, and abort.

`make test-setup` fetches the sdist (`python -m tests.guided.llama_grammar --fetch`) into
.cache/llama.cpp/src, where benchmarks/anchors.py keeps it too; the binary is cached beside it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tests.paths import REPO

SDIST = "llama_cpp_python-0.3.36"
CACHE = REPO / ".cache" / "llama.cpp"
SOURCES = ("src/llama-grammar.cpp", "src/unicode.cpp", "src/unicode-data.cpp")
DRIVER = r'''
// ruvllm's test driver over llama.cpp's grammar engine: one verdict line per input file.
#include "llama-grammar.h"
#include "llama-impl.h"
#include "llama-vocab.h"
#include "unicode.h"
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

// Reached only through a vocabulary (token grammars), which this driver never gives.
void llama_log_internal(ggml_log_level, const char * format, ...) {
    va_list args; va_start(args, format); vfprintf(stderr, format, args); va_end(args);
}
void ggml_abort(const char *, int, const char *, ...) { abort(); }
bool llama_vocab::is_eog(llama_token) const { abort(); }
const std::string & llama_vocab::token_to_piece(llama_token) const { abort(); }
int32_t llama_vocab::tokenize(const char *, int32_t, llama_token *, int32_t, bool, bool) const { abort(); }

static std::string slurp(const char * path) { std::stringstream s; s << std::ifstream(path).rdbuf(); return s.str(); }

int main(int argc, char ** argv) {
    std::string text = slurp(argv[1]);
    for (int k = 2; k < argc; k++) {
        llama_grammar * g = llama_grammar_init_impl(nullptr, text.c_str(), "root", false, nullptr, 0, nullptr, 0);
        if (!g) { printf("bad-grammar\n"); continue; }
        auto & stacks = llama_grammar_get_stacks(g);
        size_t pos = 0; bool bad = false;
        for (uint32_t cpt : unicode_cpts_from_utf8(slurp(argv[k]))) {
            llama_grammar_accept(g, cpt);
            if (stacks.empty()) { printf("invalid %zu\n", pos); bad = true; break; }
            ++pos;
        }
        if (!bad) {
            bool done = false;
            for (const auto & s : stacks) done = done || s.empty();
            printf(done ? "complete\n" : "prefix\n");
        }
        llama_grammar_free_impl(g);
    }
    return 0;
}
'''


def source_dir() -> Path | None:
    """llama.cpp's tree inside the unpacked sdist ($LLAMA_CPP_SRC wins), or None."""
    given = os.environ.get("LLAMA_CPP_SRC")
    root = Path(given) if given else CACHE / "src" / SDIST / "vendor" / "llama.cpp"
    return root if (root / SOURCES[0]).is_file() else None


def fetch() -> Path:
    """pip download the sdist once and unpack it under .cache/llama.cpp/src."""
    src = CACHE / "src"
    tarball = src / f"{SDIST}.tar.gz"
    if source_dir() is None:
        src.mkdir(parents=True, exist_ok=True)
        if not tarball.is_file():
            version = SDIST.rsplit("-", 1)[1]
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--disable-pip-version-check", "-q", "-d", str(src), f"llama-cpp-python=={version}"],
                           check=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(src, filter="data")
    found = source_dir()
    assert found is not None, f"no llama.cpp sources in {tarball}"
    return found


def build(root: Path) -> Path:
    """The driver linked with llama.cpp's grammar sources (cached by a hash of all of them)."""
    digest = hashlib.sha256(DRIVER.encode() + b"".join((root / s).read_bytes() for s in SOURCES)).hexdigest()[:16]
    exe = CACHE / f"gbnf-check-{digest}"
    if exe.is_file():
        return exe
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler: apt-get install g++")
    with tempfile.TemporaryDirectory() as tmp:
        driver = Path(tmp) / "driver.cpp"
        driver.write_text(DRIVER)
        out = Path(tmp) / "gbnf-check"
        subprocess.run([compiler, "-std=c++17", "-O1", "-w", f"-I{root}/include", f"-I{root}/src",
                        f"-I{root}/ggml/include", str(driver), *(str(root / s) for s in SOURCES), "-o", str(out)],
                       check=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        shutil.move(out, exe)
    return exe


def llama_grammar_checker():
    """check(grammar, texts) -> verdicts; the test skips (fails in CI) without sources or compiler."""
    import pytest

    root = source_dir()
    if root is None:
        pytest.skip(f"llama.cpp's sources ({SDIST} sdist) are missing: make test-setup fetches them "
                    "(python -m tests.guided.llama_grammar --fetch)")
    try:
        exe = build(root)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"llama.cpp's grammar engine did not build: {exc}")

    def check(grammar: str, texts: list[str]) -> list[str]:
        with tempfile.TemporaryDirectory() as tmp:
            paths = [Path(tmp) / "grammar.gbnf"] + [Path(tmp) / f"{i}.txt" for i in range(len(texts))]
            paths[0].write_text(grammar, encoding="utf-8")
            for path, text in zip(paths[1:], texts):
                path.write_text(text, encoding="utf-8", newline="")
            done = subprocess.run([str(exe), *map(str, paths)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()
    return check


if __name__ == "__main__":
    if sys.argv[1:] == ["--fetch"]:
        print(fetch())
    else:
        sys.exit("usage: python -m tests.guided.llama_grammar --fetch")
