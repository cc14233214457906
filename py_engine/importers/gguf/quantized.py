"""GGUF's quantized tensors as QuantLinear weights, kept as integer codes (nothing re-rounded).

Q5_0, Q5_1 and the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) are kept as the file's own blocks
(py_engine.quant.ggml.GGMLWeight: the kernels decode each block's scales as they reach it). Q4_0,
Q4_1 and Q8_0 are copied into quant.c's own layout:

ggml's blocks of 32 values (ggml-common.h), and the QuantizedWeight each becomes (groups of 32 along
the input dimension, scales in float32 from the blocks' fp16):

    Q8_0  fp16 d, int8 q[32]                   w = d * q            codes q + 128, zero point 128
    Q4_0  fp16 d, 16 bytes of nibbles          w = d * (q - 8)      codes q, zero point 8
    Q4_1  fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m        codes q, zero point 0, offset m

Nibble j of a block holds value j (low) and value j + 16 (high), the order quant.c packs 4-bit
codes in. Q4_1's minimum m is a float per block, which no integer zero point holds exactly: it is
kept as `QuantizedWeight.offsets`, and the kernels add it (quant.c: w = s * c - mins with
mins = -m), so every weight is bit for bit gguf's reference dequantization. llama.cpp's q/k row
permutation is undone by gathering whole rows (blocks never cross rows).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from py_engine.models.hugepages import HugeArena
from py_engine.quant.embedding import install_quant_embedding
from py_engine.quant.ggml import TYPES as BLOCK_TYPES, GGMLWeight
from py_engine.quant.linear import QuantLinear
from py_engine.quant.mapped import MappedPages
from py_engine.quant.kernels import PackedWeight, broadcast_zero
from py_engine.quant.rtn import QuantizedWeight

from .blocks import check_weight, dequantized_notice
from .reader import GGUFTensor
from .tensors import row_order

PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # copied into quant.c's PackedWeight layout
NATIVE_TYPES = PACKED_TYPES + tuple(BLOCK_TYPES)  # everything the kernels run as codes
BLOCK = 32


def gguf_weight(t: GGUFTensor, rows: np.ndarray | None = None) -> QuantizedWeight:
    """The QuantizedWeight of a Q4_0 / Q4_1 / Q8_0 matrix [N, K], rows gathered by `rows` when given."""
    n, k = t.shape
    nb = k // BLOCK
    blocks = np.asarray(t.data).reshape(n, nb, -1)  # [N, blocks, bytes per block]
    if rows is not None:
        blocks = blocks[rows]
    half = lambda lo: np.ascontiguousarray(blocks[..., lo:lo + 2]).view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    scales, offsets = half(0), None
    if t.type_name == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [N, blocks, 32]
        zero = 128
    else:
        start = 2 if t.type_name == "Q4_0" else 4
        nibbles = blocks[..., start:start + BLOCK // 2]  # [N, blocks, 16]
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # values 0-15, then 16-31
        zero = 8 if t.type_name == "Q4_0" else 0
        if t.type_name == "Q4_1":
            offsets = torch.from_numpy(half(2))
    return QuantizedWeight(codes=torch.from_numpy(np.ascontiguousarray(codes).reshape(n, nb * BLOCK)),
                           scales=torch.from_numpy(scales), zero_points=torch.full((n, nb), zero, dtype=torch.uint8),
                           bits=8 if t.type_name == "Q8_0" else 4, block_size=BLOCK, in_features=k,
                           symmetric=t.type_name != "Q4_1", offsets=offsets)


def gguf_packed(t: GGUFTensor, rows: np.ndarray | None = None) -> PackedWeight:
    """PackedWeight.pack(gguf_weight(t, rows)) straight from the blocks: Q4_0/Q4_1 bytes already hold
    code[j] | code[j + 16] << 4 and Q8_0's are code - 128 as int8, so the codes are one copy of the file's
    bytes (unpacking the tied 151936 x 896 head to a byte a code and back cost ~0.5 GB of temporaries)."""
    n, k = t.shape
    nb = k // BLOCK
    blocks = np.asarray(t.data).reshape(n, nb, -1)  # [N, blocks, bytes per block]
    if rows is not None:
        blocks = blocks[rows]
    half = lambda lo: torch.from_numpy(  # noqa: E731
        np.ascontiguousarray(blocks[..., lo:lo + 2]).view(np.float16)[..., 0].astype(np.float32))
    scales, offsets = half(0), None
    if t.type_name == "Q8_0":
        codes, zero, bits = blocks[..., 2:], 128, 8
    else:
        start = 2 if t.type_name == "Q4_0" else 4
        codes, zero, bits = blocks[..., start:start + BLOCK // 2], 8 if t.type_name == "Q4_0" else 0, 4
        if t.type_name == "Q4_1":
            offsets = half(2)
    codes = torch.from_numpy(np.ascontiguousarray(codes).reshape(n, -1))
    # one zero point per type: held as one byte, no mins (quant.c takes s * z' from the scales)
    return PackedWeight.from_parts(codes, scales, broadcast_zero(zero, (n, nb)), bits, BLOCK, k,
                                   t.type_name != "Q4_1", 1, offsets)


CHUNK_ROWS = 8192  # rows copied at a time before their mapped pages are given back


def gguf_blocks(t: GGUFTensor, rows: np.ndarray | None = None) -> GGMLWeight:
    """The GGMLWeight of a Q5_0 / Q5_1 / K-quant matrix [N, K]: its blocks as the file holds them, rows
    gathered by `rows` when given."""
    n, k = t.shape
    blocks = np.asarray(t.data).reshape(n, -1)  # [N, K / block * bytes]
    blocks = blocks[rows] if rows is not None else np.array(blocks)  # a copy either way: the file is released
    return GGMLWeight(t.type_name, torch.from_numpy(np.ascontiguousarray(blocks)), k)


def arena_bytes(t: GGUFTensor) -> int:
    """At most the bytes packed_from_file puts in an arena for t (HugeArena.ALIGN each array)."""
    n, k = t.shape
    if t.type_name in BLOCK_TYPES:
        return np.asarray(t.data).nbytes + HugeArena.ALIGN
    per_group = n * (k // BLOCK) * 4  # scales, offsets, mins: float32 per block of 32
    return n * k // (1 if t.type_name == "Q8_0" else 2) + 3 * per_group + 4 * HugeArena.ALIGN


def device_is_cpu(device) -> bool:
    return device is None or torch.device(device).type == "cpu"


def _like(heap: HugeArena, x: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """An uninitialised [n, x.shape[1]] array of x's dtype from heap (None for None)."""
    return None if x is None else heap.new((n, x.shape[1]), x.dtype)


def _adopt(q: PackedWeight | GGMLWeight, arena: HugeArena | None) -> PackedWeight | GGMLWeight:
    """q with its arrays copied into the arena (the copies it had are dropped)."""
    if arena is not None:
        for f in ("blocks",) if isinstance(q, GGMLWeight) else ("codes", "scales", "mins", "offsets"):
            setattr(q, f, arena.take(getattr(q, f)))
    return q


def packed_from_file(t: GGUFTensor, rows: np.ndarray | None, pages: MappedPages,
                     arena: HugeArena | None = None) -> PackedWeight | GGMLWeight:
    """gguf_packed(t, rows) (gguf_blocks for the block types), with t's mapped pages given back as they are
    copied: a chunk of rows at a time, so the file's pages of a large table (the 151936 x 896 Q8_0 token_embd:
    144 MB) never sit beside its copy. With an arena, the arrays are the arena's (a large table's filled in
    place, chunk by chunk)."""
    data = np.asarray(t.data)
    n = t.shape[0]
    heap = arena if arena is not None else HugeArena(0)  # HugeArena(0) is off: plain heap tensors
    if t.type_name in BLOCK_TYPES:
        if rows is not None or n <= CHUNK_ROWS:
            w = _adopt(gguf_blocks(t, rows), arena)
            release(pages, t)
            return w
        out = heap.new((n, data.reshape(n, -1).shape[1]), torch.uint8)
        for r in range(0, n, CHUNK_ROWS):
            piece = GGUFTensor(t.name, t.type_name, (min(n, r + CHUNK_ROWS) - r, t.shape[1]), data[r:r + CHUNK_ROWS], 0)
            out[r:r + CHUNK_ROWS].copy_(torch.from_numpy(np.asarray(piece.data).reshape(len(out[r:r + CHUNK_ROWS]), -1)))
            release(pages, piece)
        return GGMLWeight(t.type_name, out, t.shape[1])
    if rows is not None or n <= CHUNK_ROWS or data.ndim != 2 or data.shape[0] != n:
        packed = _adopt(gguf_packed(t, rows), arena)
        release(pages, t)
        return packed
    out: PackedWeight | None = None
    names = ("codes", "scales", "zero_points", "mins", "offsets")
    for r in range(0, n, CHUNK_ROWS):
        piece = GGUFTensor(t.name, t.type_name, (min(n, r + CHUNK_ROWS) - r, t.shape[1]), data[r:r + CHUNK_ROWS], 0)
        part = gguf_packed(piece)
        release(pages, piece)
        if out is None:  # the whole tensor's arrays, filled chunk by chunk
            out = PackedWeight(*(_like(heap, getattr(part, f), n) for f in names[:4]), part.bits, part.block_size,
                               part.in_features, part.symmetric, part.spg, _like(heap, part.offsets, n))
            if part.zero is not None:  # every chunk's: the type's one zero point
                out.zero_points = broadcast_zero(part.zero, (n, part.zero_points.shape[1]))
        for f in names:
            whole = getattr(out, f)
            if whole is not None and not (f == "zero_points" and out.zero is not None):
                whole[r:r + CHUNK_ROWS].copy_(getattr(part, f))
    assert out is not None
    return out


def install_native(checkpoint, model: nn.Module, device) -> set[str]:
    """Swap each nn.Linear whose GGUF tensor is of a NATIVE_TYPES type for a QuantLinear over its codes, and a
    token_embd of those types for a QuantEmbedding (py_engine.quant.embedding) that dequantizes the rows of
    each step, as llama.cpp does: over the head's codes when tied (one copy of the table), else its own.
    Every block's scales are checked on the copy (check_weight); the tensors left to dequantize to float are
    named in one logged line with the memory they take (dequantized_notice)."""
    gguf, config = checkpoint.gguf, checkpoint.config
    consumed: set[str] = set()
    tied = bool(config.get("tie_word_embeddings"))
    pages = MappedPages()  # the file's blocks are copied once into the kernels' layout, then given back
    linears = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        hf = f"{name}.weight"
        tensor_name = checkpoint.names.get(hf)
        if tensor_name is None and name == "lm_head" and tied:
            tensor_name = checkpoint.names.get("model.embed_tokens.weight")
        t = gguf.tensors.get(tensor_name) if tensor_name else None
        if t is not None and t.type_name in NATIVE_TYPES:
            linears.append((name, module, hf, tensor_name, t))
    # every code a decode step streams, in one mapping of 2 MiB pages (models/hugepages.py), in module order
    arena = HugeArena(sum(arena_bytes(t) for *_, t in linears)) if linears and device_is_cpu(device) else None
    for name, module, hf, tensor_name, t in linears:
        q = packed_from_file(t, row_order(gguf, tensor_name, config), pages, arena)
        check_weight(gguf.path, tensor_name, t.type_name, q)
        bias = None if module.bias is None else torch.empty(module.out_features, device="meta")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, QuantLinear(q, bias))
        if hf in checkpoint.names:
            consumed.add(hf)
    consumed |= _install_embedding(checkpoint, model, tied, pages)
    dequantized_notice(checkpoint, model, consumed)
    return consumed


def release(pages: MappedPages, t: GGUFTensor) -> None:
    """Drop the mapped pages of t's bytes (copied): they would stay resident beside the copy while the file
    is mapped (the Q4_0 Qwen2.5-0.5B file held 336 MB so). A later read maps the file's bytes in again."""
    data = np.asarray(t.data)
    if data.flags.c_contiguous and data.flags.writeable:  # a copy-on-write view: torch can wrap it
        pages.release(torch.from_numpy(data.reshape(-1)))


def _install_embedding(checkpoint, model: nn.Module, tied: bool, pages: MappedPages) -> set[str]:
    """The QuantEmbedding for a token_embd of a NATIVE_TYPES type; the names it took."""
    name = "model.embed_tokens.weight"
    tensor_name = checkpoint.names.get(name)
    t = checkpoint.gguf.tensors.get(tensor_name) if tensor_name else None
    if t is None or t.type_name not in NATIVE_TYPES:
        return set()
    if tied and isinstance(model.lm_head, QuantLinear):
        table = model.lm_head
    else:
        q = packed_from_file(t, None, pages)
        check_weight(checkpoint.gguf.path, tensor_name, t.type_name, q)
        tied, table = False, QuantLinear(q)
    # its rows' dtype is the loader's, set once the float parameters are in (models/loader.py)
    return {name} if install_quant_embedding(model, table, tied) is not None else set()
