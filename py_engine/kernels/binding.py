"""The compiled library bound with ctypes: CpuKernels (torch-facing wrappers of its entry points), ColdTier
(decode.c's cold_t), and loading the best variant this CPU runs (build.py builds it)."""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from typing import Sequence

import torch
from torch import Tensor

from .build import VARIANTS, build_variant, cpu_flags, supported_cpu, variant_fits
from .plans import LinearPlan, _ptr

log = logging.getLogger("ruvllm.kernels")
_lock = threading.RLock()  # cpu_kernels holds it while kernel_variant takes it
_loaded: "CpuKernels | None | bool" = False  # False: not tried yet
_variants: dict[str, "CpuKernels | None"] = {}


class CpuKernels:
    """The compiled library with torch-facing wrappers."""

    MAX_PARTS = 8  # MAX_PARTS in linear.c

    def __init__(self, lib: ctypes.CDLL, variant: str = "avx2") -> None:
        self.lib, self.variant = lib, variant
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.rk_linear_parts.argtypes = [p, i, i, p, i, p, i, p, p, i, i64, i64]
        lib.rk_linear_parts.restype = i
        lib.rk_set_threads.argtypes = [i]
        lib.rk_set_threads.restype = i
        lib.rk_amx.argtypes = [i]
        lib.rk_amx.restype = i
        lib.rk_linear_gated.argtypes = [p, i, p, p, i, p, p, i, p, i, i64, i64]
        lib.rk_linear_gated.restype = i
        lib.rk_rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_float, i, i]
        lib.rk_rms_norm.restype = None
        f = ctypes.c_float
        lib.rk_attend_one.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, f, f, i, p, p]
        lib.rk_attend_one.restype = i
        lib.rk_attend_rows.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, f, f, i]
        lib.rk_attend_rows.restype = i
        lib.rk_argmax.argtypes = [p, i64]
        lib.rk_argmax.restype = i64
        self.threads = 0
        self._scratch = threading.local()  # float32 work space of rk_attend_one, per calling thread
        # quant.c (driven by py_engine.quant.kernels): quantized linears; gate.c: the SiLU gate; rtn.c: one-pass RTN
        lib.rk_qlinear_parts.argtypes = [p, i, i, p, p, i, i64, i64, i, p]
        lib.rk_qlinear_parts.restype = i
        lib.rk_quant_tile_rows.restype = i64
        lib.rk_gate.argtypes = [p, p, i, i64, i64]
        lib.rk_gate.restype = i
        lib.rk_quantize_rtn.argtypes = [p, i, i64, i64, i, i64, i, p, p, p]
        lib.rk_quantize_rtn.restype = i
        # step.c (driven by py_engine.cpu.stack): a whole decode step of the decoder stack
        lib.rk_decode_step.argtypes = [p, p, p, p, i64, i64, p]
        lib.rk_decode_step.restype = i
        lib.rk_rows_step.argtypes = [p, p, p, p, p, i64, i64, i64, p]  # a step of T rows of one sequence
        lib.rk_rows_step.restype = i
        # paged.c (driven by py_engine.kernels.paged): the server's paged decode attention
        lib.rk_paged_decode.argtypes = [p]
        lib.rk_paged_decode.restype = i
        self.int8_rows = lib.rk_quant_tile_rows()  # rows of x below which int8-x layers round x (quant.c)
        lib.rk_quant_int8_rows.argtypes = [i]
        lib.rk_quant_int8_rows.restype = i64

    def int8_rows_for(self, bits: int) -> int:
        """Rows of x below which an int8-x layer with `bits`-bit codes rounds x: `int8_rows`, or every count of
        rows where the build has qpanel.c's integer panels (AVX-512 VNNI; 4-bit and 8-bit codes alike)."""
        return self.lib.rk_quant_int8_rows(int(bits <= 4))

    def __deepcopy__(self, memo: dict) -> "CpuKernels":
        return self  # one library per process: a copied model shares it

    def __reduce__(self):
        return kernel_variant, (self.variant,)

    def set_threads(self, n: int) -> None:
        """Run linear() on n threads in all (the caller's plus n - 1 pool workers)."""
        if n != self.threads:
            self.threads = self.lib.rk_set_threads(n)

    @staticmethod
    def supports_weight(weight: Tensor) -> bool:
        """Whether linear() takes this weight: CPU, fp32 or bf16, [N, K] contiguous, K % 8 == 0."""
        return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and weight.dim() == 2 and weight.shape[1] % 8 == 0 and weight.is_contiguous())

    def supports(self, x: Tensor, weight: Tensor) -> bool:
        """Whether linear(x, weight) runs here: a supported weight and x on the CPU in its dtype."""
        return x.is_cpu and x.dtype == weight.dtype and self.supports_weight(weight)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """F.linear(x, weight, bias) where supports(x, weight)."""
        return LinearPlan(self, [weight], [bias])(x)

    def linear_parts(self, x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> Tensor:
        """torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1) as one job."""
        return LinearPlan(self, weights, biases)(x)

    def linear_gated(self, x: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Tensor | None,
                     b_up: Tensor | None) -> Tensor:
        """F.silu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up) for one row x [..., K]."""
        if not self.threads:
            self.set_threads(torch.get_num_threads())
        x = x.contiguous()
        n, k = w_gate.shape
        if x.numel() != k:
            raise ValueError(f"linear_gated takes one row of {k} values, got x {tuple(x.shape)}")
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        bf16 = x.dtype == torch.bfloat16
        status = self.lib.rk_linear_gated(x.data_ptr(), bf16, w_gate.data_ptr(), w_up.data_ptr(), bf16,
                                          _ptr(b_gate), _ptr(b_up), bf16, y.data_ptr(), bf16, n, k)
        if status != 0:
            raise RuntimeError(f"rk_linear_gated failed ({status}) for x {tuple(x.shape)}, weights {(n, k)}")
        return y

    def silu_gate(self, y: Tensor) -> Tensor:
        """F.silu(gate) * up for y [..., 2 N] = cat(gate, up), fp32 or bf16 (rounded as torch does in bf16), on
        the pool: a SiLU MLP's hidden layer in prefill, after one gate/up product."""
        if y.dtype not in (torch.float32, torch.bfloat16) or not y.is_cpu or y.shape[-1] % 2:
            raise ValueError(f"silu_gate takes [..., 2 N] float32/bfloat16 on the CPU, not {y.dtype} {tuple(y.shape)}")
        y = y.contiguous()
        n = y.shape[-1] // 2
        out = torch.empty(*y.shape[:-1], n, dtype=y.dtype)
        if out.numel() and self.lib.rk_gate(y.data_ptr(), out.data_ptr(), y.dtype == torch.bfloat16,
                                            y.numel() // (2 * n), n) != 0:
            raise RuntimeError(f"rk_gate failed for {tuple(y.shape)}")
        return out

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> Tensor:
        """layers.RMSNorm's forward for x [..., dim] of weight's dtype (fp32 or bf16)."""
        x = x.contiguous()
        y = torch.empty_like(x)
        dim = x.shape[-1]
        self.lib.rk_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps,
                             unit_offset, x.dtype == torch.bfloat16)
        return y

    def attend_one(self, qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                   heads: int, position: int, start: int, scale: float, softcap: float | None,
                   cold: "ColdTier | None" = None) -> Tensor:
        """Rope, cache write and attention of one token: qkv [(H + 2 KV) * D] -> [H * D].

        keys and values are one layer's contiguous [1, KV, max_len, D] cache; the
        new key and value go to `position`, and the query sees start..position;
        with `cold` (a two-tier cache), tokens before cold.tokens are read from its codes.
        """
        _, kv_heads, max_len, head_dim = keys.shape
        groups = heads // kv_heads
        need = kv_heads * ((groups + 1) * head_dim + max_len)
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._scratch.buffer = torch.empty(need, dtype=torch.float32)
        out = torch.empty(heads * head_dim, dtype=qkv.dtype)
        status = self.lib.rk_attend_one(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                                        values.data_ptr(), out.data_ptr(), heads, kv_heads, head_dim,
                                        cos.shape[-1], position, start, max_len, scale, softcap or 0.0,
                                        qkv.dtype == torch.bfloat16, scratch.data_ptr(),
                                        None if cold is None else ctypes.addressof(cold))
        if status != 0:
            raise RuntimeError(f"rk_attend_one failed ({status}): heads {heads}, cache {tuple(keys.shape)}, "
                               f"position {position}, start {start}")
        return out

    def attend_rows(self, qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, heads: int,
                    position: int, window: int | None, scale: float, softcap: float | None) -> Tensor:
        """attend_one for T tokens at positions position..position + T - 1: qkv [T, (H + 2 KV) * D], cos and sin
        [T, rot] -> [T, H * D]. Every key and value is stored first; then each row gets exactly what attend_one
        gives at its position (so a prompt chunk or a speculative step computes a token as decode does)."""
        _, kv_heads, max_len, head_dim = keys.shape
        rows = qkv.shape[0]
        out = torch.empty(rows, heads * head_dim, dtype=qkv.dtype)
        status = self.lib.rk_attend_rows(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                                         values.data_ptr(), out.data_ptr(), rows, heads, kv_heads, head_dim,
                                         cos.shape[-1], position, window or 0, max_len, scale, softcap or 0.0,
                                         qkv.dtype == torch.bfloat16)
        if status != 0:
            raise RuntimeError(f"rk_attend_rows failed ({status}): {rows} rows at {position}, heads {heads}, "
                               f"cache {tuple(keys.shape)}")
        return out

    def amx(self, on: bool) -> bool:
        """Let the quantized linears' rows of x run on Intel AMX tiles (qamx.c) where Linux grants them, or not
        (the same bits either way: an A/B, or a check); returns whether they do now."""
        return bool(self.lib.rk_amx(1 if on else 0))

    def argmax(self, x: Tensor) -> int:
        """int(torch.argmax(x)) for a contiguous fp32 CPU tensor: the first index of the largest value
        (of the first NaN, if any), as torch."""
        if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or x.numel() == 0:
            raise ValueError(f"argmax takes a non-empty contiguous float32 CPU tensor, not {x.dtype} {tuple(x.shape)}")
        return self.lib.rk_argmax(x.data_ptr(), x.numel())


class ColdTier(ctypes.Structure):
    """decode.c's cold_t: one layer's cold tier of a two-tier cache (models/kv_cache.py's ColdCodes, row 0)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("kc", "vc", "ks", "kz", "vs", "vz")] + [
        (name, ctypes.c_int64) for name in ("tokens", "bits", "bs", "max_blocks")]

    @classmethod
    def of(cls, codes, tokens: int, bits: int) -> "ColdTier":
        """codes: a ColdCodes of contiguous CPU tensors with batch 1."""
        kc = codes.key_codes
        tier = cls(kc.data_ptr(), codes.value_codes.data_ptr(), codes.key_scales.data_ptr(),
                   codes.key_zeros.data_ptr(), codes.value_scales.data_ptr(), codes.value_zeros.data_ptr(),
                   tokens, bits, kc.shape[3], kc.shape[2])
        tier.keep = codes  # the tensors outlive the structure
        return tier


def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process; None where unsupported. The variant is the
    best this CPU has (best_variant), or $RUVLLM_KERNEL_VARIANT."""
    global _loaded
    with _lock:
        if _loaded is False:
            _loaded = _load_best()
        return _loaded  # type: ignore[return-value]


def kernel_variant(name: str) -> CpuKernels | None:
    """One variant of the kernels (VARIANTS), loaded once per process; None where this CPU lacks its
    instructions or it does not build. Tests run every variant the CPU has against the reference."""
    if name not in VARIANTS:
        raise ValueError(f"unknown kernel variant {name!r}: one of {', '.join(VARIANTS)}")
    with _lock:
        if name not in _variants:
            _variants[name] = _load(name)
        return _variants[name]


def kernels_report() -> dict:
    """What runs here, for `ruvllm info --json` and the benchmarks' JSON: the variant in use, those the
    CPU has, and the CPU's SIMD flags."""
    kernels = cpu_kernels()
    flags = cpu_flags()
    return {"variant": None if kernels is None else kernels.variant,
            "available": [name for name in VARIANTS if variant_fits(name, flags)],
            "forced": os.environ.get("RUVLLM_KERNEL_VARIANT") or None,
            "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "sse4")))}


def _load_best() -> CpuKernels | None:
    if os.environ.get("RUVLLM_NO_KERNELS") or not supported_cpu():
        return None
    forced = os.environ.get("RUVLLM_KERNEL_VARIANT")
    if forced and forced not in VARIANTS:
        raise ValueError(f"RUVLLM_KERNEL_VARIANT={forced!r}: one of {', '.join(VARIANTS)}")
    names = [forced] if forced else [n for n in reversed(VARIANTS) if variant_fits(n)]
    for name in names:  # best first; one that fails to build or load gives way to the next
        kernels = kernel_variant(name)
        if kernels is not None:
            log.info("CPU kernels: %s variant%s", name, " (RUVLLM_KERNEL_VARIANT)" if forced else "")
            return kernels
        log.warning("CPU kernels: the %s variant did not load%s", name, "" if forced else "; trying the next")
    return None


def _load(name: str) -> CpuKernels | None:
    if os.environ.get("RUVLLM_NO_KERNELS") or platform.system() != "Linux" or not variant_fits(name):
        return None
    target = build_variant(name)
    if target is None:
        return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        return None
    lib.rk_variant_supported.restype = ctypes.c_int
    if not lib.rk_variant_supported():  # the library's own cpuid check: /proc/cpuinfo said yes, cpuid says no
        log.warning("CPU kernels: cpuid lacks what the %s variant needs", name)
        return None
    return CpuKernels(lib, name)
