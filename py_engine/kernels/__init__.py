"""Ring 1: native CPU kernels, compiled on first use with the system C compiler.

    from py_engine.kernels import cpu_kernels
    k = cpu_kernels()          # None where they cannot be had: callers keep plain torch
    k.set_threads(2)           # the kernels' own pool (pool.h says why not OpenMP)
    y = k.linear(x, w, bias)   # F.linear for x [..., K], w [N, K], fp32 or bf16

Only Linux on x86-64 with AVX2 and FMA is supported. The C sources are small
and plain (no torch headers, which take minutes to compile), so building them
takes a second or two; the shared object is cached under
`$RUVLLM_CACHE/kernels` (default `~/.cache/ruvllm/kernels`), named by a hash
of the source and flags, and written atomically so processes may race.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

HERE = Path(__file__).parent
SOURCES = [HERE / "linear.c", HERE / "pool.c"]
HEADERS = [HERE / "pool.h"]
FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread"]
_lock = threading.Lock()
_loaded: "CpuKernels | None | bool" = False  # False: not tried yet


class CpuKernels:
    """The compiled library with torch-facing wrappers."""

    MAX_PARTS = 8  # MAX_PARTS in linear.c

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.rk_linear_parts.argtypes = [p, i, i, p, i, p, i, p, p, i, i64, i64]
        lib.rk_linear_parts.restype = i
        lib.rk_set_threads.argtypes = [i]
        lib.rk_set_threads.restype = i
        self.threads = 0

    def set_threads(self, n: int) -> None:
        """Run linear() on n threads in all (the caller's plus n - 1 pool workers)."""
        if n != self.threads:
            self.threads = self.lib.rk_set_threads(n)

    def supports(self, x: Tensor, weight: Tensor) -> bool:
        """Whether linear() takes these: CPU, one dtype (fp32 or bf16), K % 8 == 0."""
        return (x.device.type == "cpu" and x.dtype == weight.dtype
                and weight.dtype in (torch.float32, torch.bfloat16)
                and weight.dim() == 2 and weight.shape[1] % 8 == 0 and weight.is_contiguous())

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear(x, weight, bias) where supports(x, weight)."""
        return self.linear_parts(x, [weight], [bias])

    def linear_parts(self, x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> Tensor:
        """torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1) as one job.

        Every weight must pass supports(x, w) and have the same in_features;
        biases are all None or all tensors of their weight's dtype.
        """
        if not self.threads:
            self.set_threads(torch.get_num_threads())
        k = weights[0].shape[1]
        x = x.contiguous()
        sizes = [w.shape[0] for w in weights]
        y = torch.empty(*x.shape[:-1], sum(sizes), dtype=x.dtype)
        bf16 = x.dtype == torch.bfloat16
        biases = [None if b is None else b.contiguous() for b in biases]
        n = len(weights)
        w_ptrs = (ctypes.c_void_p * n)(*(w.data_ptr() for w in weights))
        b_ptrs = (ctypes.c_void_p * n)(*(None if b is None else b.data_ptr() for b in biases))
        status = self.lib.rk_linear_parts(x.data_ptr(), bf16, n, w_ptrs, bf16, b_ptrs, bf16,
                                          (ctypes.c_int64 * n)(*sizes), y.data_ptr(), bf16, x.numel() // k, k)
        if status != 0:
            raise RuntimeError(f"rk_linear_parts failed ({status}) for x {tuple(x.shape)}, "
                               f"weights {[tuple(w.shape) for w in weights]}")
        return y


def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process; None where unsupported."""
    global _loaded
    with _lock:
        if _loaded is False:
            _loaded = _load()
        return _loaded  # type: ignore[return-value]


def _supported_cpu() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma"} <= set(flags.split())


def _load() -> CpuKernels | None:
    if os.environ.get("RUVLLM_NO_KERNELS") or not _supported_cpu():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("RUVLLM_CACHE", Path.home() / ".cache" / "ruvllm")) / "kernels"
    target = cache / f"ruvllm_cpu-{digest}.so"
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: a racing process sees all of it or none
        return CpuKernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError):
        return None
