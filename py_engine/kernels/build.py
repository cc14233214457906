"""Building the CPU kernels: the C sources beside this file, the instruction-set variants, the compile.

Variants (VARIANTS): the same sources built once per instruction set, each with its own flags (`avx2`, `avx512`,
`avx512-vnni`, `avx512-bf16`); the C code picks wider or fused instructions under the compiler's feature macros
(`__AVX512VNNI__`: vpdpbusd for the int8 dot products; `__F16C__`, in the AVX-512 variants: vcvtph2ps for an fp16
KV cache). The flags come from what Linux reports from cpuid (/proc/cpuinfo, which also drops AVX-512 where the
OS does not save its registers). A build is cached under `kernels/` of ruvllm's cache
(py_engine.hub.cache_root), named by a hash of the sources and flags, and written atomically so processes may
race. Stdlib only: binding.py loads what this builds.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..hub.resolve import cache_root

HERE = Path(__file__).parent
SOURCES = [HERE / f"{name}.c" for name in ("linear", "decode", "pool", "quant", "gate", "rtn", "qtile", "qtile_k", "qrow", "qamx", "qpanel",
                                          "kquant", "step", "paged")]
HEADERS = [HERE / f"{name}.h" for name in ("attend", "decode", "gate", "linear", "paged", "pool", "quant", "qtile", "vmath")]
FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-pthread"]  # no contraction: torch rounds each op
# Macros for an A/B build of the kernels (benchmarks: `ruvllm:int8+DQ_ROWS8=4`), e.g. "Q_ROWS8=4 Q_PREFETCH=1024"
FLAGS += [f"-D{d}" for d in os.environ.get("RUVLLM_KERNEL_DEFINES", "").split()]
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c")  # F16C: every AVX-512 CPU has it (fp16 KV)
AVX512_FLAGS = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c")
# name -> (/proc/cpuinfo flags it needs, compiler flags), worst first: the last one the CPU has wins. The plain
# avx2 variant is the portable one: no F16C, fp16 converted with integer AVX2 (attend.h)
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
    "avx512": (("avx2", "fma", *AVX512), AVX512_FLAGS),
    "avx512-vnni": (("avx2", "fma", *AVX512, "avx512_vnni"), (*AVX512_FLAGS, "-mavx512vnni")),
    "avx512-bf16": (("avx2", "fma", *AVX512, "avx512_vnni", "avx512_bf16"),
                    (*AVX512_FLAGS, "-mavx512vnni", "-mavx512bf16")),
}
log = logging.getLogger("ruvllm.kernels")


def cpu_flags() -> set[str]:
    """The CPU feature flags Linux reports (from cpuid, less what the OS cannot save), empty elsewhere."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def variant_fits(name: str, flags: set[str] | None = None) -> bool:
    """Whether the CPU has every instruction set variant `name` is built for."""
    return set(VARIANTS[name][0]) <= (cpu_flags() if flags is None else flags)


def best_variant(flags: set[str] | None = None) -> str | None:
    """The last variant of VARIANTS the CPU has; None where not even AVX2 + FMA."""
    fitting = [name for name in VARIANTS if variant_fits(name, flags)]
    return fitting[-1] if fitting else None


def supported_cpu() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return variant_fits("avx2")


def build_variant(name: str) -> Path | None:
    """The variant's shared object, compiled if not cached (any CPU can build every variant); None
    where there is no C compiler or it fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    flags = [*FLAGS, *VARIANTS[name][1]]
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    cache = cache_root() / "kernels"
    target = cache / f"ruvllm_cpu-{name}-{digest}.so"
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built)],
                               check=True, capture_output=True, timeout=900)  # a shared 2-core machine: minutes
                os.replace(built, target)  # atomic: a racing process sees all of it or none
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("CPU kernels: building the %s variant failed: %s", name, error)
        return None
    return target
