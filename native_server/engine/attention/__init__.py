"""Paged attention: the interface (interface.py), its backends, and `backend_for`, which picks one.

    reference.py  TorchPagedAttention: plain torch, any device, the oracle
    cpu.py        CpuPagedAttention: decode rows in C, the rest as reference.py
    triton.py     TritonPagedAttention: CUDA (the CPU only under TRITON_INTERPRET=1)
    cold.py       the torch path over a two-tier (int8/int4) cache
    torch_path.py the torch path's gather-then-attention, shared by reference.py and cold.py

MPS keeps the torch path (Triton has no Metal backend). The backends import
interface.py, never this module, so nothing here imports in a circle.
"""
from __future__ import annotations

import logging

import torch

from native_server.engine.attention.interface import (BACKENDS, PagedAttentionBackend, PagedMetadata,
                                                      decode_kv_positions)
from native_server.engine.attention.reference import TorchPagedAttention
from py_engine.gpu import triton_problem

__all__ = ["BACKENDS", "PagedAttentionBackend", "PagedMetadata", "TorchPagedAttention", "backend_for",
           "decode_kv_positions"]

logger = logging.getLogger("ruvllm.server")


def backend_for(device: torch.device | str, name: str = "auto") -> PagedAttentionBackend:
    """The attention backend: "torch" (the oracle, any device), "triton" (CUDA; the CPU only under
    TRITON_INTERPRET=1), "cpu" (the C kernels' decode rows) or "auto" (Triton on CUDA when it imports,
    the C kernels on the CPU when they load, else torch)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _cpu_backend(device, required=name == "cpu")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchPagedAttention()
    problem = triton_problem(device)
    if problem is None:
        try:
            from native_server.engine.attention.triton import TritonPagedAttention
            return TritonPagedAttention()
        except Exception as exc:  # noqa: BLE001 - a broken install (no driver, no compiler): say which
            problem = f"triton failed to import ({type(exc).__name__}: {exc})"
    if name == "triton":
        raise ValueError(f"--attention-backend triton cannot run here: {problem}")
    logger.warning("attention: the torch path on %s (%s)", device, problem)
    return TorchPagedAttention()


def _cpu_backend(device: torch.device, required: bool) -> PagedAttentionBackend:
    """CpuPagedAttention where the kernels load; else torch, or an error when it was asked for by name."""
    from py_engine.kernels import cpu_kernels

    kernels = cpu_kernels() if device.type == "cpu" else None
    if kernels is None:
        if required:
            raise ValueError(f"--attention-backend cpu cannot run here: the CPU kernels do not load on {device} "
                             "(x86-64 Linux with AVX2 and a C compiler; RUVLLM_NO_KERNELS unset)")
        return TorchPagedAttention()
    from native_server.engine.attention.cpu import CpuPagedAttention
    return CpuPagedAttention(kernels)
