"""Ring 1: native CPU kernels, compiled on first use with the system C compiler.

    from py_engine.kernels import cpu_kernels
    k = cpu_kernels()          # None where they cannot be had: callers keep plain torch
    k.set_threads(2)           # the kernels' own pool (pool.h says why not OpenMP)
    y = k.linear(x, w, bias)   # F.linear for x [..., K], w [N, K], fp32 or bf16

Only Linux on x86-64 with AVX2 and FMA is supported. The C sources are small
and plain (no torch headers, which take minutes to compile), so building them
takes a second or two; the shared object is cached under
`kernels/` of ruvllm's cache (`$RUVLLM_CACHE_DIR`, default `~/.cache/ruvllm`:
py_engine.hub.cache_root), named by a hash
of the source and flags, and written atomically so processes may race.

Variants (VARIANTS): the same sources built once per instruction set, each
with its own flags (`avx2`, `avx512`, `avx512-vnni`, `avx512-bf16`); the C
code picks wider or fused instructions under the compiler's feature macros
(`__AVX512VNNI__`: vpdpbusd for the int8 dot products; `__F16C__`, in the AVX-512 variants:
vcvtph2ps for an fp16 KV cache). At load the best
variant the CPU has is chosen: the flags Linux reports from cpuid
(/proc/cpuinfo, which also drops AVX-512 where the OS does not save its
registers), confirmed by the loaded library's own cpuid check
(rk_variant_supported); `RUVLLM_KERNEL_VARIANT=avx2` forces one. The choice is
logged (logger `ruvllm.kernels`) and reported by `ruvllm info --json` and the
benchmarks (`kernels_report()`).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import Tensor

from ..hub.resolve import cache_root

HERE = Path(__file__).parent
SOURCES = [HERE / f"{name}.c" for name in ("linear", "decode", "pool", "quant", "gate", "rtn", "qtile", "qpanel",
                                          "kquant", "step", "paged")]
HEADERS = [HERE / f"{name}.h" for name in ("attend", "decode", "gate", "linear", "paged", "pool", "quant", "vmath")]
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


class LinearPlan:
    """Weights that read the same input, laid out once for rk_linear_parts.

    Calling it is one ctypes call: the pointer arrays are built here, not per
    token (building them took longer than a small GEMV). Holds its tensors,
    so they outlive any call; `weights` says which ones it was built for.
    """

    def __init__(self, kernels: CpuKernels, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> None:
        if not all(kernels.supports_weight(w) and w.dtype == weights[0].dtype
                   and w.shape[1] == weights[0].shape[1] for w in weights) or len(weights) > kernels.MAX_PARTS:
            raise ValueError(f"weights the kernels cannot take: {[(tuple(w.shape), w.dtype) for w in weights]}")
        if not kernels.threads:
            kernels.set_threads(torch.get_num_threads())
        self.weights = list(weights)
        self.biases = [None if b is None else b.contiguous() for b in biases]
        n = len(weights)
        self.dtype = weights[0].dtype
        self.k, self.out = weights[0].shape[1], sum(w.shape[0] for w in weights)
        self._args = (n, (ctypes.c_void_p * n)(*(w.data_ptr() for w in self.weights)),
                      (ctypes.c_void_p * n)(*(_ptr(b) for b in self.biases)),
                      (ctypes.c_int64 * n)(*(w.shape[0] for w in self.weights)))
        self._fn = kernels.lib.rk_linear_parts

    def __call__(self, x: Tensor) -> Tensor:
        """x [..., K] of the weights' dtype, on the CPU -> [..., sum of N]."""
        if x.dtype != self.dtype or not x.is_cpu:  # the C side would misread it
            raise ValueError(f"x of {x.dtype} on {x.device} for {self.dtype} weights on the CPU")
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], self.out, dtype=self.dtype)
        bf16 = self.dtype == torch.bfloat16
        n, w_ptrs, b_ptrs, sizes = self._args
        status = self._fn(x.data_ptr(), bf16, n, w_ptrs, bf16, b_ptrs, bf16, sizes, y.data_ptr(), bf16,
                          x.numel() // self.k, self.k)
        if status != 0:
            raise RuntimeError(f"rk_linear_parts failed ({status}) for x {tuple(x.shape)} {x.dtype}, "
                               f"weights {[tuple(w.shape) for w in self.weights]} {self.dtype}")
        return y


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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


def kernels_report() -> dict:
    """What runs here, for `ruvllm info --json` and the benchmarks' JSON: the variant in use, those the
    CPU has, and the CPU's SIMD flags."""
    kernels = cpu_kernels()
    flags = cpu_flags()
    return {"variant": None if kernels is None else kernels.variant,
            "available": [name for name in VARIANTS if variant_fits(name, flags)],
            "forced": os.environ.get("RUVLLM_KERNEL_VARIANT") or None,
            "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "sse4")))}


def _supported_cpu() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return variant_fits("avx2")


def _load_best() -> CpuKernels | None:
    if os.environ.get("RUVLLM_NO_KERNELS") or not _supported_cpu():
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
