"""The GPU fast path: Triton kernels for the paged KV cache and weight-only quantized matmuls.

    from py_engine.gpu import triton_problem
    if triton_problem("cuda") is None:
        from py_engine.gpu.kv_store import store_kv          # k/v into the paged cache by slot
        from py_engine.gpu.paged_decode import paged_decode  # one query per sequence, split-KV
        from py_engine.gpu.paged_prefill import paged_prefill  # prompt chunks over block tables
        from py_engine.gpu.quant_matmul import quant_matmul  # int2-8 codes in PackedWeight's layout

Ring 1, beside `py_engine/cpu/` (the CPU fast path). Every kernel has a plain-torch
oracle: native_server/engine/attention/interface.py for attention, quant.linear.reference_forward for the
matmuls. Each kernel is written so Triton's interpreter (TRITON_INTERPRET=1, set before this
package's kernel modules are imported) runs it on CPU tensors: fp32/fp16 only there (no bf16
tl.dot), block ids loaded as integers and turned into offsets (never a pointer read from
memory), power-of-two tl.arange sizes. `triton` is imported only by the kernel modules, so
importing this package costs nothing where Triton is absent (MPS, CPU-only installs).
"""
from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (on the CPU, with numpy): TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def triton_problem(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can."""
    device = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    if device.type == "cpu":
        return "the Triton kernels run on CUDA GPUs (on the CPU only under TRITON_INTERPRET=1, for tests)"
    return f"the Triton kernels run on CUDA GPUs, not {device.type} (that device keeps the torch path)"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 (tf32 would cost ~3e-4), the native
    tensor-core path otherwise (the setting is ignored for fp16/bf16)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (work to fill); 1 under the interpreter."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
