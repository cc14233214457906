"""`make bench-anchors`: llama.cpp's own tools, built here, for the benchmarks to compare against.

    python benchmarks/anchors.py [--jobs N] [--no-amx] [--force]

Fetches the llama-cpp-python sdist (pip download; the version below, the one the
benchmarks name), unpacks it under .cache/llama.cpp/src, and builds the
llama.cpp it vendors with -march=native (GGML_NATIVE) into
.cache/llama.cpp/bin: llama-bench, llama-server, llama-quantize,
llama-perplexity, linked statically so they run from there.
benchmarks/common.py's `llama_cpp_bin()` finds them; BUILD.json beside them
says how they were built.

AMX: a CPU may report AMX (amx_tile in /proc/cpuinfo) while the kernel does
not grant a process the tile state, which Linux hands out on request
(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). A native build then
compiles ggml's AMX matmul and dies with SIGILL in it (llama-bench and
llama-server alike). So the build asks for the permission first, as ggml
does at run time, and leaves AMX out (-mno-amx-*) when it is refused.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from common import ANCHORS, LLAMA_TOOLS

LLAMA_CPP_PYTHON = "0.3.36"
SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


def cpu_flags() -> set[str]:
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def amx_granted() -> bool:
    """Whether this process may use AMX tiles (Linux x86-64 asks the kernel; elsewhere: no)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def compiler_flags(flags: set[str], granted: bool, force_off: bool = False) -> tuple[str, ...]:
    """Extra C/C++ flags for a -march=native build: AMX off where the CPU has it but may not use it."""
    has_amx = bool(flags & {"amx_tile", "amx_int8", "amx_bf16"})
    return NO_AMX if has_amx and (force_off or not granted) else ()


def cmake_args(source: Path, build: Path, extra: tuple[str, ...]) -> list[str]:
    flags = " ".join(extra)
    return ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DGGML_OPENMP=ON",
            f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


def fetch_sources(src: Path) -> Path:
    """The sdist, downloaded once and unpacked: its vendor/llama.cpp and convert_hf_to_gguf.py."""
    folder = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if (folder / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return folder
    src.mkdir(parents=True, exist_ok=True)
    tarball = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not tarball.is_file():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (llama.cpp's sources)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "-d", str(src)], check=True)
    with tarfile.open(tarball) as tar:
        try:
            tar.extractall(src, filter="data")
        except TypeError:  # Python without extraction filters (before 3.10.12)
            tar.extractall(src)
    return folder


def build(jobs: int, force_off_amx: bool, force: bool) -> Path:
    out = ANCHORS / "bin"
    record = out / "BUILD.json"
    if not force and record.is_file() and all((out / t).is_file() for t in LLAMA_TOOLS):
        print(f"llama.cpp's tools are already built in {out} (--force rebuilds)")
        return out
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing: apt-get install cmake g++")
    sources = fetch_sources(ANCHORS / "src")
    flags, granted = cpu_flags(), amx_granted()
    extra = compiler_flags(flags, granted, force_off_amx)
    if extra:
        print("the CPU reports AMX but " + ("--no-amx was given" if force_off_amx else
              "the kernel does not grant the tile state") + ": building without AMX", flush=True)
    build_dir = ANCHORS / "build"
    start = time.monotonic()
    subprocess.run(cmake_args(sources / "vendor" / "llama.cpp", build_dir, extra), check=True,
                   stdout=subprocess.DEVNULL)
    print(f"building {', '.join(LLAMA_TOOLS)} with {jobs} jobs (several minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target",
                    *LLAMA_TOOLS], check=True)
    out.mkdir(parents=True, exist_ok=True)
    for tool in LLAMA_TOOLS:
        shutil.copy2(build_dir / "bin" / tool, out / tool)
    record.write_text(json.dumps({"llama_cpp_python": LLAMA_CPP_PYTHON, "native": True, "extra_flags": list(extra),
                                  "amx_on_cpu": sorted(flags & {"amx_tile", "amx_int8", "amx_bf16"}),
                                  "amx_granted": granted, "seconds": round(time.monotonic() - start)}, indent=2))
    print(f"built {', '.join(LLAMA_TOOLS)} into {out}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--no-amx", action="store_true", help="leave AMX out even where the kernel grants it")
    parser.add_argument("--force", action="store_true", help="rebuild even when the tools are there")
    args = parser.parse_args()
    build(args.jobs, args.no_amx, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
