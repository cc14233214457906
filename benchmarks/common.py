"""What the benchmark scripts share: where things are, the machine a run was on, and llama.cpp's tools.

Every script runs as `python benchmarks/NAME.py` from a clone; Python then puts
benchmarks/ first on sys.path, so `from common import ...` finds this module, and
importing it puts the clone's root there too (py_engine, native_server and the
test harnesses import from any checkout, installed or not). This is the only
module that touches sys.path.

llama.cpp's tools (llama-bench, llama-server, llama-quantize, llama-perplexity)
are the peers' own binaries: `make bench-anchors` (benchmarks/anchors.py) builds
them into .cache/llama.cpp/bin, and `llama_cpp_bin()` finds them there unless a
flag or $RUVLLM_LLAMA_CPP_BIN says otherwise. No path of one machine is assumed.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
CACHE = HERE / ".cache"  # models the benchmarks build (gitignored)
ANCHORS = REPO / ".cache" / "llama.cpp"  # make bench-anchors: bin/ and the unpacked llama-cpp-python sdist
LLAMA_TOOLS = ("llama-bench", "llama-server", "llama-quantize", "llama-perplexity")

if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


def llama_cpp_bin(given: Path | str | None = None) -> Path:
    """The folder of llama.cpp's tools: `given`, else $RUVLLM_LLAMA_CPP_BIN (or the older $LLAMA_CPP_BIN),
    else what `make bench-anchors` built. Exits with the command that builds them when llama-bench is absent."""
    candidates = [given, os.environ.get("RUVLLM_LLAMA_CPP_BIN"), os.environ.get("LLAMA_CPP_BIN"), ANCHORS / "bin"]
    folder = Path(next(c for c in candidates if c))
    if not (folder / "llama-bench").is_file():
        raise SystemExit(f"llama.cpp's tools are not in {folder}: run `make bench-anchors` (builds them into "
                         f"{ANCHORS / 'bin'}), or point --llama-cpp-bin / $RUVLLM_LLAMA_CPP_BIN at a build")
    return folder


def llama_tool(name: str, given: Path | str | None = None) -> Path:
    """One of LLAMA_TOOLS in llama_cpp_bin(given)."""
    tool = llama_cpp_bin(given) / name
    if not tool.is_file():
        raise SystemExit(f"{tool} is missing: rerun `make bench-anchors`")
    return tool


def llama_cpp_sources() -> Path:
    """The unpacked llama-cpp-python sdist `make bench-anchors` fetched (llama.cpp's sources and its
    convert_hf_to_gguf.py under vendor/llama.cpp)."""
    found = sorted((ANCHORS / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit(f"no llama-cpp-python sources under {ANCHORS / 'src'}: run `make bench-anchors`")
    return found[-1].parent.parent


def machine() -> dict:
    """What a result was measured on: versions, the CPU and its SIMD flags, the kernels' variant, the load
    average now (scripts record it again at the end), the commit."""
    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                  "loadavg_start": os.getloadavg()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = set(next(line for line in lines if line.startswith("flags")).split())
        info["isa"] = sorted(flags & {"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                                      "amx_int8", "amx_bf16"})
    except (OSError, StopIteration):
        pass
    from py_engine.kernels import kernels_report

    info["cpu_kernels"] = kernels_report()  # the variant ruvllm runs and the CPU's SIMD flags
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    info["commit"] = commit.stdout.strip()
    return info
