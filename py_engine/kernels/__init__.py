"""Ring 1: native CPU kernels, compiled on first use with the system C compiler.

    from py_engine.kernels import cpu_kernels
    k = cpu_kernels()          # None where they cannot be had: callers keep plain torch
    k.set_threads(2)           # the kernels' own pool (pool.h says why not OpenMP)
    y = k.linear(x, w, bias)   # F.linear for x [..., K], w [N, K], fp32 or bf16

Only Linux on x86-64 with AVX2 and FMA is supported. The C sources are small
and plain (no torch headers, which take minutes to compile) and live beside
this package's modules:

    build.py     the sources, the instruction-set variants (VARIANTS), the compile into ruvllm's cache (stdlib only)
    binding.py   CpuKernels: the library's entry points bound with ctypes behind torch-facing methods; loading
                 the best variant the CPU has (confirmed by the library's own cpuid check, rk_variant_supported;
                 `RUVLLM_KERNEL_VARIANT=avx2` forces one), logged (`ruvllm.kernels`) and reported by
                 `ruvllm info --json` and the benchmarks (`kernels_report()`)
    plans.py     LinearPlan: float weights laid out once for rk_linear_parts
    paged.py     the server's paged decode attention (paged.c); py_engine.quant.kernels drives quant.c,
                 py_engine.cpu.stack drives step.c

    C: linear.c (float GEMV/GEMM), quant.c + qtile.c + qtile_k.c + qpanel.c + kquant.c (quantized products), gate.c (the SiLU
    gate), rtn.c (one-pass RTN quantization), decode.c (norm, attention, argmax), step.c (a whole decode step),
    paged.c, pool.c (the thread pool); headers: linear.h, quant.h, decode.h, paged.h, attend.h, gate.h, pool.h, qtile.h,
    vmath.h.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from .binding import ColdTier, CpuKernels, cpu_kernels, kernel_variant, kernels_report
from .build import FLAGS, HEADERS, SOURCES, VARIANTS, best_variant, build_variant, cpu_flags, variant_fits
from .plans import LinearPlan

__all__ = ["ColdTier", "CpuKernels", "FLAGS", "HEADERS", "LinearPlan", "SOURCES", "VARIANTS", "best_variant",
           "build_variant", "cpu_flags", "cpu_kernels", "kernel_step", "kernel_variant", "kernels_report",
           "variant_fits"]


@contextmanager
def kernel_step(kernels: CpuKernels) -> Iterator[None]:
    """Run torch single-threaded and the kernels on torch's thread count: a step's small torch ops (and a
    quantizer's block copies) over 2 OpenMP threads waited milliseconds for the second on a busy machine,
    while the kernels' own pool does the heavy work (py_engine/cpu/transforms.py's module docstring)."""
    threads = torch.get_num_threads()
    kernels.set_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
