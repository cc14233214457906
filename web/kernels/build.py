"""Compile the page's kernels (web/kernels/*.c) to wasm with PyPI's `ziglang` (a clang with a wasm32 target).

    python -m web.kernels.build [--out npm/src/kernels] [--check]

Two builds: rkw.wasm (SIMD128) and rkw-relaxed.wasm (SIMD128 + relaxed SIMD's i8 dot products, Chrome 114+,
Node 21+); npm/src/kernels.js picks one at run time. Both import one shared memory (threads: npm/src/
kernel_worker.js) and export every rk_* function, the stack pointer (each thread sets its own) and the heap base.
The .wasm files are committed, so the npm package and the page need no toolchain; --check rebuilds in a
temporary folder and fails when they differ from the sources (tests/web/test_wasm_kernels.py).
"""
from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent.parent / "npm" / "src" / "kernels"
SOURCES = ("engine.c", "qdot.c", "pool.c", "alloc.c")
FLAGS = ["-target", "wasm32-freestanding", "-O3", "-msimd128", "-matomics", "-mbulk-memory", "-mnontrapping-fptoint",
         "-mmutable-globals", "-nostdlib", "-fvisibility=default", "-Wall", "-Werror", "-Wl,--no-entry",
         "-Wl,--export-dynamic", "-Wl,--import-memory", "-Wl,--shared-memory", "-Wl,--max-memory=4294901760",
         "-Wl,--export=__stack_pointer", "-Wl,--export=__heap_base", "-Wl,-z,stack-size=262144",
         # no debug sections: they hold the checkout's absolute paths, so a build would differ per clone
         "-g0", "-Wl,--strip-debug"]
BUILDS = {"rkw.wasm": [], "rkw-relaxed.wasm": ["-mrelaxed-simd", "-DRKW_RELAXED"]}


class KernelBuildError(RuntimeError):
    pass


def zig() -> list[str]:
    try:
        import ziglang  # noqa: F401
    except ImportError as error:
        raise KernelBuildError("the wasm kernels build with PyPI's ziglang: pip install ziglang==0.17.0") from error
    return [sys.executable, "-m", "ziglang"]


def build(out: Path = OUT) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name, extra in BUILDS.items():
        cmd = zig() + ["cc", *FLAGS, *extra, "-o", str(out / name), *(str(HERE / s) for s in SOURCES)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise KernelBuildError(f"{name}: {done.stderr.strip()}")
        made.append(out / name)
    return made


def stale() -> list[str]:
    """Committed builds that differ from a fresh build of the sources."""
    with tempfile.TemporaryDirectory() as tmp:
        return [p.name for p in build(Path(tmp)) if not filecmp.cmp(p, OUT / p.name, shallow=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="fail when the committed builds are stale")
    args = parser.parse_args()
    if args.check:
        bad = stale()
        if bad:
            raise SystemExit(f"stale kernels: {', '.join(bad)}; run python -m web.kernels.build")
        return print("kernels up to date")
    for p in build(args.out):
        print(f"wrote {p} ({p.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
