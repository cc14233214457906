"""Bit packing of the Hugging Face GPTQ and AWQ layouts, between them and `QuantizedWeight`.

Both layouts hold the codes of W [N, K] (nn.Linear's [out, in]) transposed, as int32 words:

GPTQ (AutoGPTQ / gptqmodel, `checkpoint_format` "gptq" = v1, "gptq_v2"):
    qweight  int32 [K * bits / 32, N]   codes packed along K: a little-endian bit stream per
                                         column, code k at bit bits*k (3-bit codes straddle words:
                                         32 codes fill 3 words)
    qzeros   int32 [groups, N * bits / 32]  zero points packed the same way along N; v1 stores
                                         zero - 1 (kernels add the 1 back), v2 the zero itself
    scales   fp16  [groups, N]
    g_idx    int32 [K]                   the group of each input channel
    w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k]

AWQ (AutoAWQ, `version` "gemm", 4-bit only):
    qweight  int32 [K, N / 8]           8 codes per word along N, nibble i holding column
                                         AWQ_ORDER[i] of its 8 (0, 2, 4, 6, 1, 3, 5, 7)
    qzeros   int32 [groups, N / 8]      the same interleave; zero points stored as they are
    scales   fp16  [groups, N]
    w[n, k] = scales[k // group, n] * (q[k, n] - zero[k // group, n])

Groups run along K in both; a K that is not a whole number of groups gets a short last group
(groups = ceil(K / group)), as AutoGPTQ sizes its scales. Torch only; no numpy.

Act-order GPTQ (`desc_act`, AutoGPTQ / GPTQModel): the columns were quantized in an order `perm`
(decreasing Hessian diagonal) and numbered into groups along it, g_idx[perm[j]] = j // group. As
exllama does, `from_gptq` recovers a perm as the stable argsort of g_idx and returns the weight
over the columns W[:, perm], whose groups are contiguous again, with perm: y = x[..., perm] @
W[:, perm]^T. Which of a group's columns comes first does not matter, so any order that sorts
g_idx is exact. `to_gptq` with that perm writes the original column order and g_idx back.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .rtn import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # argsort of AWQ_ORDER


def _to_int32(words: Tensor) -> Tensor:
    """uint32 values held in int64 -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(codes: Tensor, bits: int) -> Tensor:
    """codes [R, C] (each < 2**bits) -> int32 [R * bits / 32, C]: a bit stream down each column."""
    r, c = codes.shape
    if (r * bits) % 32:
        raise ValueError(f"{r} codes of {bits} bits do not fill whole 32-bit words")
    pad = -r % 32  # whole 32-code runs (`bits` words each); the padding's words are cut off below
    x = torch.cat([codes.to(torch.int64), codes.new_zeros(pad, c, dtype=torch.int64)]).view(-1, 32, c)
    words = torch.zeros(x.shape[0], bits, c, dtype=torch.int64)  # [runs, bits, C]
    for j in range(32):
        offset = bits * j
        w, s = divmod(offset, 32)
        words[:, w] |= x[:, j] << s
        if s + bits > 32:  # the code straddles into the next word
            words[:, w + 1] |= x[:, j] >> (32 - s)
    return _to_int32(words.view(-1, c)[: r * bits // 32])


def unpack_rows(words: Tensor, bits: int, rows: int) -> Tensor:
    """Inverse of pack_rows: int32 [rows * bits / 32, C] -> uint8 codes [rows, C]."""
    if words.dtype != torch.int32 or words.dim() != 2 or words.shape[0] * 32 != rows * bits:
        raise ValueError(f"expected int32 [{rows * bits // 32 if rows * bits % 32 == 0 else '?'}, C] "
                         f"words for {rows} {bits}-bit codes, got {words.dtype} {list(words.shape)}")
    c = words.shape[1]
    w64 = words.to(torch.int64) & 0xFFFFFFFF
    pad = -w64.shape[0] % bits
    w64 = torch.cat([w64, w64.new_zeros(pad, c)]).view(-1, bits, c)  # [runs, bits, C]
    mask = (1 << bits) - 1
    out = torch.empty(w64.shape[0], 32, c, dtype=torch.int64)
    for j in range(32):
        w, s = divmod(bits * j, 32)
        v = w64[:, w] >> s
        if s + bits > 32:
            v = v | (w64[:, w + 1] << (32 - s))
        out[:, j] = v & mask
    return out.view(-1, c)[:rows].to(torch.uint8)


def pack_cols(codes: Tensor, bits: int) -> Tensor:
    """codes [R, C] -> int32 [R, C * bits / 32], packed along each row."""
    return pack_rows(codes.T, bits).T.contiguous()


def unpack_cols(words: Tensor, bits: int, cols: int) -> Tensor:
    return unpack_rows(words.T.contiguous(), bits, cols).T.contiguous()


def groups_of(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


# --- QuantizedWeight <-> GPTQ -----------------------------------------------------------------
def to_gptq(q: QuantizedWeight, v1: bool = True, perm: Tensor | None = None) -> dict[str, Tensor]:
    """qweight, qzeros, scales (fp16) and g_idx of a weight; v1 stores zero - 1 (needs every zero >= 1).

    With perm (act-order: q holds the columns W[:, perm], as from_gptq returns them) the codes are
    written in W's own column order and g_idx numbers each column's group, as AutoGPTQ writes them."""
    k, bits = q.in_features, q.bits
    zeros = q.zero_points.T.to(torch.int64)  # [groups, N]
    if v1:
        if bool((zeros == 0).any()):
            raise ValueError("a zero point of 0 cannot be stored in GPTQ v1 (it stores zero - 1); use gptq_v2")
        zeros = zeros - 1
    codes = q.codes[:, :k].T  # [K, N], row j is column perm[j] of W
    g_idx = torch.arange(k) // q.block_size
    if perm is not None:
        where = torch.argsort(perm.cpu())  # W's column i is row where[i] of codes
        codes, g_idx = codes[where], g_idx[where]
    return {
        "qweight": pack_rows(codes, bits),
        "qzeros": pack_cols(zeros, bits),
        "scales": q.scales.T.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def act_order_perm(g_idx: Tensor, in_features: int, group_size: int) -> Tensor | None:
    """The column order perm (int64 [K]) in which g_idx numbers contiguous groups of group_size, so that
    g_idx[perm] == arange(K) // group_size; None when g_idx already is that grouping (no act-order)."""
    k, block = in_features, group_size
    g = g_idx.to(torch.int64).flatten()
    contiguous = torch.arange(k) // block
    if torch.equal(g, contiguous):
        return None
    groups = groups_of(k, block)
    if g.numel() != k or bool((g < 0).any()) or bool((g >= groups).any()):
        raise ValueError(f"g_idx must give each of the {k} input channels a group in [0, {groups}); "
                         f"found values from {int(g.min())} to {int(g.max())}")
    counts = torch.bincount(g, minlength=groups)
    want = torch.bincount(contiguous, minlength=groups)
    if not torch.equal(counts, want):
        bad = int((counts != want).nonzero()[0])
        raise ValueError(f"g_idx is not a grouping of the input channels into groups of {block} in some order "
                         f"(act-order): group {bad} has {int(counts[bad])} channels, not {int(want[bad])}; "
                         "ruvllm reads GPTQ checkpoints whose groups are all of group_size (but the last)")
    return torch.argsort(g, stable=True)  # g[perm] == contiguous: the counts match


def from_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None, *, bits: int,
              group_size: int, in_features: int, symmetric: bool, v1: bool = True
              ) -> tuple[QuantizedWeight, Tensor | None]:
    """A QuantizedWeight from GPTQ tensors (shapes checked by the caller), and the act-order perm.

    perm is None when g_idx is the contiguous grouping k // group_size (or absent); otherwise the weight
    holds W[:, perm] (see the module docstring) and the layer must read x[..., perm]."""
    k, n = in_features, qweight.shape[1]
    block = k if group_size in (-1, 0, None) else group_size
    groups = groups_of(k, block)
    perm = None if g_idx is None else act_order_perm(g_idx, k, block)
    codes = torch.zeros(n, groups * block, dtype=torch.uint8)
    rows = unpack_rows(qweight, bits, k)  # [K, N] in W's column order
    codes[:, :k] = (rows if perm is None else rows[perm]).T
    zeros = unpack_cols(qzeros, bits, n).to(torch.int64) + (1 if v1 else 0)  # [groups, N]
    if bool((zeros >= 1 << bits).any()):
        raise ValueError(f"zero points past {(1 << bits) - 1} (a v1 zero of {(1 << bits) - 1} + 1 would wrap)")
    weight = QuantizedWeight(codes=codes, scales=scales.float().T.contiguous(),
                             zero_points=zeros.T.to(torch.uint8).contiguous(), bits=bits, block_size=block,
                             in_features=k, symmetric=symmetric)
    return weight, perm


# --- QuantizedWeight <-> AWQ (gemm) -----------------------------------------------------------
def _awq_interleave(x: Tensor, order: tuple[int, ...]) -> Tensor:
    """[R, C] -> [R, C] with each run of 8 columns reordered by `order`."""
    r, c = x.shape
    return x.view(r, c // 8, 8)[:, :, list(order)].reshape(r, c)


def to_awq(q: QuantizedWeight) -> dict[str, Tensor]:
    if q.bits != 4:
        raise ValueError(f"the AWQ gemm layout holds 4-bit codes, not {q.bits}-bit")
    if q.out_features % 8:
        raise ValueError(f"the AWQ layout packs 8 output channels a word; {q.out_features} is not a multiple of 8")
    k = q.in_features
    return {
        "qweight": pack_cols(_awq_interleave(q.codes[:, :k].T.contiguous(), AWQ_ORDER), 4),
        "qzeros": pack_cols(_awq_interleave(q.zero_points.T.contiguous(), AWQ_ORDER), 4),
        "scales": q.scales.T.to(torch.float16).contiguous(),
    }


def from_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, *, group_size: int, in_features: int,
             symmetric: bool = False) -> QuantizedWeight:
    k, n = in_features, scales.shape[1]
    block = k if group_size in (-1, 0, None) else group_size
    groups = groups_of(k, block)
    codes = torch.zeros(n, groups * block, dtype=torch.uint8)
    codes[:, :k] = _awq_interleave(unpack_cols(qweight, 4, n), AWQ_REVERSE_ORDER).T
    zeros = _awq_interleave(unpack_cols(qzeros, 4, n), AWQ_REVERSE_ORDER)  # [groups, N]
    return QuantizedWeight(codes=codes, scales=scales.float().T.contiguous(), zero_points=zeros.T.contiguous(),
                           bits=4, block_size=block, in_features=k, symmetric=symmetric)
