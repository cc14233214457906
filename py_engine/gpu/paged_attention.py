"""Paged attention in Triton: decode (split-KV) and chunked prefill over block tables, one kernel.

The new tokens of a step sit in q [N, H, D] (vLLM's flattened batch); their
keys and values are already in the paged cache [num_blocks, block_size, KV, D]
(store_kv ran first), after each sequence's earlier context: key position p of
a sequence lives in block table[p // block_size] at offset p % block_size.

The host cuts the work in query blocks, one row of `qblocks` [NB, 4] int32 each:
(block-table row, index of its first token in q, that token's position, number
of tokens). Grid (NB, KV heads, splits). A program holds BLOCK_Q tokens x the G
query heads of one KV head as BLOCK_M rows (vLLM's unified attention packs GQA
the same way), so each key tile is read once for all of them; tl.dot needs 16
rows, so decode (one token a block) pads G up to 16. The program walks the key
tiles from the first any row sees (sliding window) to its last token's
position, with flash attention's online softmax; a row sees key p when
p <= its position and, with a window W, p > position - W.

Decode with few sequences and long contexts cannot fill the GPU with one
program per (sequence, KV head), so each sequence divides its tiles among
`splits` programs; each writes its unnormalized output, max and sum, and a
second kernel merges them (FlashInfer's merge of attention states). The split
count is a launch constant while each sequence divides its own tiles, so one
CUDA graph serves every context length.

Two-tier KV (int8/int4, py_engine/models/kv_quant.py): with BITS > 0 the
first cold_counts[row] ids of a block table are cold-pool blocks (kv_cache.py's
ColdPool: codes [blocks, block_size, KV, D * BITS / 8], int4 two a byte, the
even channel in the low nibble; keys' float32 scale and zero point per
(block, head, channel), values' per (block, token, head)). The kernel reads a
cold key or value as code * scale + zero (float32, then the cache's dtype, as
ColdPool.blocks does) and hot ones as they are: one tile may hold both.
A 16-bit cache (--kv-cache-dtype fp16 / bf16) beside queries of another
dtype is widened to q's dtype as it is loaded, as the torch oracle's
`.to(q.dtype)` does.
A prompt chunk longer than the hot window has later queries that read blocks
of the chunk itself cold, blocks still in the hot pool (kv_quant.py's
per-query rule: a query at p reads the blocks ending at or before
p + 1 - hot_tokens cold). With FAKE the prefill launch quantizes each tile's
hot blocks on the fly as ColdPool.store would (keys per channel over the
block, values per token; torch's float32 arithmetic: IEEE division, round
half to even) and each row takes, key by key, the quantized or the hot
copy: two dots where one sufficed, in those launches only. Tiles must hold
whole blocks (BLOCK_SIZE divides PREFILL_TILE).

Interpreter notes: a nested @triton.jit call costs the interpreter a re-patch
of triton.language (milliseconds), so the tile step is written inline, cdiv by
hand, and max and sum are tl.reduce over combine.py's functions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import dot_precision, multiprocessors, next_power_of_2
from .combine import max_combine, sum_combine

DECODE_TILE, PREFILL_TILE = 64, 32  # key positions per step
PREFILL_ROWS = 64  # query rows (tokens x heads of a group) per prefill program
MAX_SPLITS = 32


@triton.jit
def _fake_quantize(x, lo, hi, LEVELS: tl.constexpr):
    """x float32 with its group's min and max (broadcast to x's shape) -> code * scale + min, the numbers
    kv_quant.quantize then dequantize give: scale = (max - min) / LEVELS (1 where 0), code =
    round_half_even((x - min) / scale) clamped to 0..LEVELS."""
    scale = tl.math.div_rn(hi - lo, tl.full(x.shape, LEVELS, tl.float32))
    scale = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x - lo, scale)
    f = tl.floor(y)
    frac = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    code = f + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
    return tl.minimum(tl.maximum(code, 0.0), LEVELS) * scale + lo


@triton.jit
def _attention_kernel(q_ptr, k_cache, v_cache, tables_ptr, qblocks_ptr, out_ptr, part_acc, part_ml,
                      scale, softcap, q_s0, q_s1, o_s0, o_s1, bt_s0, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                      cold_counts, k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros,
                      hot_tokens, BITS: tl.constexpr, FAKE: tl.constexpr, LEVELS: tl.constexpr, KV: tl.constexpr,
                      H: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                      WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    qb, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(qblocks_ptr + qb * 4).to(tl.int64)
    first_token = tl.load(qblocks_ptr + qb * 4 + 1).to(tl.int64)
    first_pos = tl.load(qblocks_ptr + qb * 4 + 2).to(tl.int64)
    count = tl.load(qblocks_ptr + qb * 4 + 3).to(tl.int64)

    r = tl.arange(0, BLOCK_M).to(tl.int64)
    t = r // G  # the row's token within the block
    heads = kv_head * G + r % G
    rmask = (r < BLOCK_Q * G) & (t < count)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < D
    q = tl.load(q_ptr + (first_token + t)[:, None] * q_s0 + heads[:, None] * q_s1 + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    qpos = first_pos + t  # [BLOCK_M]
    end = first_pos + count  # one past the last key any row sees
    first_tile = 0
    if WINDOW > 0:
        first_tile = tl.maximum(first_pos - WINDOW + 1, 0) // TILE
    end_tile = (end + TILE - 1) // TILE  # (tl.cdiv is a nested jit call: slow in the interpreter)
    per_split = (end_tile - first_tile + SPLITS - 1) // SPLITS
    lo = first_tile + split * per_split
    hi = tl.minimum(lo + per_split, end_tile)
    table = tables_ptr + seq * bt_s0
    if BITS > 0:
        n_cold = tl.load(cold_counts + seq).to(tl.int64)  # leading table entries in the cold pool
    if FAKE:  # each row's cold edge: it reads keys before it dequantized
        edge = tl.maximum(qpos + 1 - hot_tokens, 0) // BLOCK_SIZE * BLOCK_SIZE  # [BLOCK_M]

    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)  # (tl.zeros: a nested jit call)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    for j in range(lo, hi):
        kpos = j * TILE + tl.arange(0, TILE).to(tl.int64)  # [TILE]
        key_ok = kpos < end
        block = tl.load(table + kpos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)  # block ids, as integers
        offset = kpos % BLOCK_SIZE
        tile_mask = key_ok[:, None] & dmask[None, :]
        if BITS > 0:
            cold = (kpos // BLOCK_SIZE) < n_cold  # [TILE]
            cold_mask = tile_mask & cold[:, None]
            tile_mask = tile_mask & (cold == 0)[:, None]  # what the hot pool holds
            token = (block * BLOCK_SIZE + offset) * KV + kv_head  # [TILE]: (block, token, head) of the codes
            k_scale = tl.load(k_scales + ((block * KV + kv_head) * D)[:, None] + d[None, :], mask=cold_mask,
                              other=0.0)
            k_zero = tl.load(k_zeros + ((block * KV + kv_head) * D)[:, None] + d[None, :], mask=cold_mask,
                             other=0.0)
            v_scale = tl.load(v_scales + token, mask=cold & key_ok, other=0.0)[:, None]
            v_zero = tl.load(v_zeros + token, mask=cold & key_ok, other=0.0)[:, None]
            if BITS == 8:
                at = (token * D)[:, None] + d[None, :]
                k_code = tl.load(k_codes + at, mask=cold_mask, other=0).to(tl.float32)
                v_code = tl.load(v_codes + at, mask=cold_mask, other=0).to(tl.float32)
            else:  # int4: channel d in byte d // 2, the even one in the low nibble
                at = (token * (D // 2))[:, None] + (d // 2)[None, :]
                shift = ((d % 2) * 4).to(tl.int32)[None, :]
                k_code = ((tl.load(k_codes + at, mask=cold_mask, other=0).to(tl.int32) >> shift) & 15).to(tl.float32)
                v_code = ((tl.load(v_codes + at, mask=cold_mask, other=0).to(tl.int32) >> shift) & 15).to(tl.float32)
        k = tl.load(k_cache + (block * kc_s0 + offset * kc_s1 + kv_head * kc_s2)[:, None] + d[None, :],
                    mask=tile_mask, other=0.0).to(q_ptr.dtype.element_ty)  # [TILE, BLOCK_D], q's dtype
        if BITS > 0:
            k = tl.where(cold_mask, (k_code * k_scale + k_zero).to(k.dtype), k)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, TILE]
        if FAKE:  # keys per channel over each block's tokens
            fake = (kpos[None, :] < edge[:, None]) & (cold == 0)[None, :]  # [BLOCK_M, TILE]: quantized on the fly
            k3 = tl.reshape(k.to(tl.float32), (TILE // BLOCK_SIZE, BLOCK_SIZE, BLOCK_D))
            k_lo = tl.broadcast_to(-tl.reduce(-k3, 1, max_combine, keep_dims=True), k3.shape)
            k_hi = tl.broadcast_to(tl.reduce(k3, 1, max_combine, keep_dims=True), k3.shape)
            k_fake = tl.reshape(_fake_quantize(k3, k_lo, k_hi, LEVELS), (TILE, BLOCK_D)).to(k.dtype)
            s = tl.where(fake, tl.dot(q, tl.trans(k_fake), input_precision=PRECISION), s)
        s = s * scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp (its overflow to inf gives 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (kpos[None, :] <= qpos[:, None]) & rmask[:, None]
        if WINDOW > 0:
            visible = visible & (kpos[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: no NaN
        p = tl.exp(s - m_safe[:, None])  # [BLOCK_M, TILE]
        alpha = tl.exp(m - m_safe)  # rescales what came before
        v = tl.load(v_cache + (block * vc_s0 + offset * vc_s1 + kv_head * vc_s2)[:, None] + d[None, :],
                    mask=tile_mask, other=0.0).to(q_ptr.dtype.element_ty)  # [TILE, BLOCK_D]
        if BITS > 0:
            v = tl.where(cold_mask, (v_code * v_scale + v_zero).to(v.dtype), v)
        if FAKE:  # values per token over the head's channels
            vf = v.to(tl.float32)
            v_lo = tl.broadcast_to(-tl.reduce(tl.where(dmask[None, :], -vf, float("-inf")), 1, max_combine,
                                              keep_dims=True), vf.shape)
            v_hi = tl.broadcast_to(tl.reduce(tl.where(dmask[None, :], vf, float("-inf")), 1, max_combine,
                                             keep_dims=True), vf.shape)
            v_fake = _fake_quantize(vf, v_lo, v_hi, LEVELS).to(v.dtype)
            acc = acc * alpha[:, None] + (
                tl.dot(tl.where(fake, p, 0.0).to(v.dtype), v_fake, input_precision=PRECISION)
                + tl.dot(tl.where(fake, 0.0, p).to(v.dtype), v, input_precision=PRECISION))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l = l * alpha + tl.reduce(p, 1, sum_combine)
        m = m_new

    if SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # l = 0: an empty (padding, count 0) block writes zeros
        written = (r < BLOCK_Q * G) & (t < tl.maximum(count, 1))
        tl.store(out_ptr + (first_token + t)[:, None] * o_s0 + heads[:, None] * o_s1 + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=written[:, None] & dmask[None, :])
    else:  # decode (BLOCK_Q = 1): partials [NB, H, SPLITS, BLOCK_D] and [NB, H, SPLITS, 2] (max, sum)
        at = (qb * H + heads) * SPLITS + split  # [BLOCK_M]
        rows = r < G
        tl.store(part_acc + at[:, None] * BLOCK_D + d[None, :], acc, mask=rows[:, None])
        tl.store(part_ml + at * 2, m, mask=rows)
        tl.store(part_ml + at * 2 + 1, l, mask=rows)


@triton.jit
def _merge_kernel(out_ptr, part_acc, part_ml, qblocks_ptr, o_s0, o_s1,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i over the splits of one (token, head)."""
    qb, head = tl.program_id(0), tl.program_id(1)
    token = tl.load(qblocks_ptr + qb * 4 + 1).to(tl.int64)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    at = (qb * H + head) * SPLITS + s  # [SPLITS]
    m = tl.load(part_ml + at * 2)
    l = tl.load(part_ml + at * 2 + 1)
    top = tl.reduce(m, 0, max_combine)
    top = tl.where(top > float("-inf"), top, 0.0)  # every split empty (a padding row): no NaN
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # an empty split weighs nothing
    total = tl.reduce(w * l, 0, sum_combine)
    acc = tl.load(part_acc + at[:, None] * BLOCK_D + d[None, :])  # [SPLITS, BLOCK_D]
    out = tl.reduce(acc * w[:, None], 0, sum_combine) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * o_s0 + head * o_s1 + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def prefill_block_tokens(groups: int) -> int:
    """Tokens per prefill query block for GQA groups of `groups` query heads."""
    return max(PREFILL_ROWS, next_power_of_2(groups)) // groups


def query_blocks(seqs: list[tuple[int, int, int, int]], block_q: int) -> list[tuple[int, int, int, int]]:
    """(table row, first token index, first position, tokens) per sequence -> the same per query block."""
    out = []
    for row, token, position, count in seqs:
        for start in range(0, count, block_q):
            out.append((row, token + start, position + start, min(block_q, count - start)))
    return out


def choose_splits(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Decode splits: enough programs to fill the GPU twice over, a power of two, at most
    MAX_SPLITS, at most one per key tile."""
    want = max(2 * multiprocessors(device) // max(rows * kv_heads, 1), 1)
    splits = 1
    while splits * 2 <= min(want, MAX_SPLITS, max(-(-max_len // DECODE_TILE), 1)):
        splits *= 2
    return splits


@dataclass
class ColdBlocks:
    """One layer of a cold pool (kv_cache.ColdPool) and how many leading ids of each table row are its."""

    counts: Tensor  # [S] int32, per block-table row
    key_codes: Tensor  # [blocks, block_size, KV, D * bits / 8] uint8
    key_scales: Tensor  # [blocks, 1, KV, D] float32
    key_zeros: Tensor
    value_codes: Tensor
    value_scales: Tensor  # [blocks, block_size, KV, 1] float32
    value_zeros: Tensor
    bits: int
    hot_tokens: int | None = None  # prefill: apply kv_quant's per-query rule to the hot blocks (FAKE)

    def check(self, key_cache: Tensor) -> None:
        _, block_size, kv_heads, head_dim = key_cache.shape
        blocks = self.key_codes.shape[0]
        want = {"key_codes": (blocks, block_size, kv_heads, head_dim * self.bits // 8),
                "key_scales": (blocks, 1, kv_heads, head_dim), "value_scales": (blocks, block_size, kv_heads, 1)}
        want |= {"value_codes": want["key_codes"], "key_zeros": want["key_scales"], "value_zeros": want["value_scales"]}
        if self.bits not in (4, 8) or (self.bits == 4 and head_dim % 2):
            raise ValueError(f"cold blocks of {self.bits} bits over head_dim {head_dim} are not readable")
        for name, shape in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"cold {name} {tuple(t.shape)} does not fit a cache {tuple(key_cache.shape)}")


def paged_attention(out: Tensor, q: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    qblocks: Tensor, scale: float, window: int | None, softcap: float | None, *,
                    decode: bool, splits: int = 1, cold: ColdBlocks | None = None) -> None:
    """out[tokens] = causal attention of each query block of qblocks [NB, 4] int32 over its cached context.

    decode: blocks of one token each (split-KV allowed, `splits` a power of two); else blocks of
    prefill_block_tokens(H / KV) tokens (query_blocks). q, out [N, H, D] with head_dim stride 1;
    caches [num_blocks, block_size, KV, D] contiguous; block_tables [S, W] integer. cold: the
    int8/int4 blocks the first cold.counts[row] entries of each table name (module docstring).
    """
    nb = qblocks.shape[0]
    if nb == 0:
        return
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("paged attention needs contiguous caches and head_dim-contiguous q and out")
    if key_cache.dtype not in (q.dtype, torch.float16, torch.bfloat16) or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache holds {key_cache.dtype} / {value_cache.dtype} (q's dtype, "
                         f"or fp16 / bf16 for both)")
    if splits & (splits - 1) or (splits > 1 and not decode):
        raise ValueError(f"splits must be a power of two, and 1 for prefill; got {splits}")
    if cold is not None:
        cold.check(key_cache)
    fake = cold is not None and cold.hot_tokens is not None and not decode
    if fake and PREFILL_TILE % block_size:
        raise ValueError(f"prompt chunks quantize blocks on the fly only when {block_size}-token blocks divide "
                         f"the {PREFILL_TILE}-token key tile")
    c = cold if cold is not None else ColdBlocks(qblocks, *[out] * 6, bits=0)  # unused pointers when bits is 0
    g = heads // kv_heads
    block_d = max(next_power_of_2(head_dim), 16)
    block_m = max(16 if decode else PREFILL_ROWS, next_power_of_2(g))
    if splits > 1:
        part_acc = torch.empty(nb, heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(nb, heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _attention_kernel[(nb, kv_heads, splits)](
        q, key_cache, value_cache, block_tables, qblocks, out, part_acc, part_ml, scale, softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        c.counts, c.key_codes, c.key_scales, c.key_zeros, c.value_codes, c.value_scales, c.value_zeros,
        c.hot_tokens or 0, BITS=c.bits, FAKE=fake, LEVELS=2**c.bits - 1, KV=kv_heads,
        H=heads, G=g, BLOCK_Q=1 if decode else block_m // g, BLOCK_M=block_m, D=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE=DECODE_TILE if decode else PREFILL_TILE, WINDOW=window or 0,
        SOFTCAP=softcap is not None, SPLITS=splits, PRECISION=dot_precision(q.dtype),
        num_warps=4 if block_d * block_m <= 64 * 128 else 8)
    if splits > 1:
        _merge_kernel[(nb, heads)](out, part_acc, part_ml, qblocks, out.stride(0), out.stride(1),
                                   H=heads, D=head_dim, BLOCK_D=block_d, SPLITS=splits,
                                   num_warps=1 if block_d <= 128 else 2)
