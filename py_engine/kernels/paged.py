"""Paged decode attention in C (kernels/paged.c): the server's decode rows over block tables.

    args = PagedDecode.for_rows(tables, seqs, tokens, lens, n_cold)   # once per step
    out = paged_decode(kernels, args, q, key_cache, value_cache, scale, window, softcap, cold_codes, bits)  # per layer

`PagedDecode` is paged.c's paged_t; the step's int64 arrays are laid out once
and each layer only sets its tensors' addresses. `supported` says which
inputs the kernel takes (the caller keeps torch for the rest). `PagedStepView`
is a single-sequence decode step as the one-call stack (step.c) runs it.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .binding import CpuKernels

P, I64, F32, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
MAX_HEAD_DIM = 512  # paged.c's bounds on its stack arrays
MAX_GROUP_FLOATS = 8192  # (H / KV) * D and (H / KV) * block_size


class PagedDecode(ctypes.Structure):
    """paged.c's paged_t."""

    _fields_ = [("q", P), ("out", P), ("keys", P), ("values", P), ("tables", P), ("seqs", P), ("tokens", P),
                ("lens", P), ("n_cold", P), ("q_token_stride", I64), ("q_head_stride", I64),
                ("table_stride", I64), ("rows", I64), ("H", I64), ("KV", I64), ("D", I64), ("bs", I64),
                ("window", I64), ("scale", F32), ("softcap", F32), ("bf16", I32), ("bits", I32),
                ("kc", P), ("vc", P), ("ks", P), ("kz", P), ("vs", P), ("vz", P), ("kv", I32)]

    @classmethod
    def for_rows(cls, tables: Tensor, seqs: Tensor, tokens: Tensor, lens: Tensor,
                 n_cold: Tensor | None = None) -> "PagedDecode":
        """tables [S, width] block ids; per decode row: its sequence, its token in the batch, its context
        length (the query sits at lens - 1) and how many leading ids of its table are cold (or None)."""
        keep = [t.to(torch.int64).contiguous() for t in (tables, seqs, tokens, lens)]
        keep.append(None if n_cold is None else n_cold.to(torch.int64).contiguous())
        t, s, tok, ln, nc = keep
        args = cls(tables=t.data_ptr(), seqs=s.data_ptr(), tokens=tok.data_ptr(), lens=ln.data_ptr(),
                   n_cold=None if nc is None else nc.data_ptr(), table_stride=t.shape[1], rows=len(s))
        args.keep = keep  # the arrays outlive the structure
        return args


# The hot blocks' element types paged.c reads (paged_t.kv, attend.h's KV_*): the model's fp32 or bf16, or a
# --kv-cache-dtype fp16 / bf16 cache beside a model of another dtype
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def supported(kernels: CpuKernels | None, q: Tensor, key_cache: Tensor) -> str | None:
    """Why paged_decode cannot take these (None: it can)."""
    if kernels is None:
        return "the CPU kernels did not load"
    _, block_size, kv_heads, head_dim = key_cache.shape
    heads = q.shape[1]
    if q.device.type != "cpu" or key_cache.device.type != "cpu":
        return "not on the CPU"
    if q.dtype not in (torch.float32, torch.bfloat16) or key_cache.dtype not in KV_TYPES:
        return f"q {q.dtype} with a {key_cache.dtype} cache (q fp32 or bf16; the cache fp32, bf16 or fp16)"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM or q.stride(2) != 1 or not key_cache.is_contiguous():
        return f"head_dim {head_dim} (a multiple of 8 up to {MAX_HEAD_DIM}, contiguous)"
    if heads % kv_heads or heads // kv_heads * max(head_dim, block_size) > MAX_GROUP_FLOATS:
        return f"{heads} heads over {kv_heads} KV heads with block size {block_size}"
    return None


def paged_decode(kernels: CpuKernels, args: PagedDecode, q: Tensor, key_cache: Tensor, value_cache: Tensor,
                 scale: float, window: int | None, softcap: float | None,
                 cold: Sequence[Tensor] | None = None, bits: int = 0) -> Tensor:
    """q [N, H, D] -> out [N, H, D]: the rows args names are attended; the others are left unset.

    cold: the layer's (key codes, value codes, key scales, key zeros, value scales, value zeros) of
    the cold pool (kv_cache.ColdPool) when args.n_cold is set."""
    if value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape or not value_cache.is_contiguous():
        raise ValueError(f"the value cache ({value_cache.dtype}, {tuple(value_cache.shape)}) must be laid out as the "
                         f"key cache ({key_cache.dtype}, {tuple(key_cache.shape)}, contiguous): paged.c reads both alike")
    out = torch.empty(q.shape, dtype=q.dtype)
    _, block_size, kv_heads, head_dim = key_cache.shape
    args.q, args.out, args.keys, args.values = q.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr()
    args.q_token_stride, args.q_head_stride = q.stride(0), q.stride(1)
    args.H, args.KV, args.D, args.bs = q.shape[1], kv_heads, head_dim, block_size
    args.window, args.scale, args.softcap = window or 0, scale, softcap or 0.0
    args.bf16, args.kv = q.dtype == torch.bfloat16, KV_TYPES[key_cache.dtype]
    if cold is not None:
        kc, vc, ks, kz, vs, vz = cold
        args.kc, args.vc, args.ks, args.kz, args.vs, args.vz = (t.data_ptr() for t in (kc, vc, ks, kz, vs, vz))
        args.bits = bits
    elif args.n_cold:
        raise ValueError("rows with cold blocks need the cold pool's tensors")
    if not kernels.threads:
        kernels.set_threads(torch.get_num_threads())
    status = kernels.lib.rk_paged_decode(ctypes.byref(args))
    if status != 0:
        raise RuntimeError(f"rk_paged_decode refused q {tuple(q.shape)}, cache {tuple(key_cache.shape)}")
    return out


@dataclass
class PagedStepView:
    """One sequence decoding one token over a paged cache: what the one-call stack (py_engine/cpu/stack.py,
    rk_decode_step) needs to run the step on it. The server's PagedKVStep.decode_view builds it."""

    keys: list[Tensor]  # per layer [num_blocks, block_size, KV, D] (fp32, bf16 or fp16); the list names the cache
    values: list[Tensor]
    cold: list[tuple[Tensor, ...]] | None  # per layer (key codes, value codes, key scales, key zeros, value scales,
    bits: int  # value zeros) of the cold pool (native_server.engine.kv_cache.ColdPool), or None; its bits (8 or 4)
    table: Tensor  # [blocks] int64, contiguous: the sequence's block ids, n_cold leading ones in the cold pool
    length: int  # context length after this step's write
    n_cold: int
    slot: int  # where the new token's key and value go: block * block_size + offset
