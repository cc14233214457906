"""ggml's block types kept as the file's own bytes: Q5_0, Q5_1 and the K-quants (Q2_K ... Q6_K).

    w = GGMLWeight.from_blocks("Q4_K", blocks, in_features=2048)  # blocks: uint8 [N, K / 256 * 144]
    w.dequantize()  # float32 [N, K], bit for bit gguf.quants.dequantize
    QuantLinear(w)  # quant.c's kquant.c kernels on the CPU, py_engine/gpu/ggml_matmul.py on CUDA

A row is its ggml blocks as the file holds them (ggml-common.h), nothing re-rounded and nothing
unpacked: the kernels decode the scales of a block as they reach it, as llama.cpp does, so a Q4_K
matrix takes the file's 4.5 bits a weight. Every type is one formula,
w = s_j * (q - z) - m_j for the values of sub-block j (16 or 32 of them), with s_j and m_j float32
products of the block's fp16 scale(s) and small integers, exact in float32 (at most 18 significant
bits), so `unpack()` is a `QuantizedWeight` whose dequantize() gives gguf's floats exactly:

    type  block bytes  bits  sub-block  s_j              z   m_j              layout (bytes)
    Q5_0     32    22     5     32      d                16  -                d, qh[4], qs[16]
    Q5_1     32    24     5     32      d                0   -m               d, m, qh[4], qs[16]
    Q2_K    256    84     2     16      d * (sc & 15)    0   dmin * (sc >> 4) sc[16], qs[64], d, dmin
    Q3_K    256   110     3     16      d * (sc6 - 32)   4   -                hmask[32], qs[64], sc[12], d
    Q4_K    256   144     4     32      d * sc6          0   dmin * m6        d, dmin, sc[12], qs[128]
    Q5_K    256   176     5     32      d * sc6          0   dmin * m6        d, dmin, sc[12], qh[32], qs[128]
    Q6_K    256   210     6     16      d * sc8          32  -                ql[128], qh[64], sc[16], d

(sc6/m6: 6-bit scales and mins packed in 12 bytes; sc8: int8.) Value orders, per 256: Q4_K/Q5_K's
qs hold sub-blocks 2i (low nibbles) and 2i + 1 (high) in bytes 32i..32i + 31, Q5_K's qh bit b is
sub-block b's fifth bit; Q6_K's ql and Q2_K/Q3_K's qs are read in halves of 128 (gguf/quants.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .rtn import QuantizedWeight


@dataclass(frozen=True)
class BlockType:
    """One ggml block type: its id (ggml_type, quant.c's qmat kind), values and bytes a block, code bits."""

    kind: int
    values: int  # per block: 32 or 256
    nbytes: int  # per block
    bits: int
    sub: int  # values per scale: 16 or 32


TYPES: dict[str, BlockType] = {
    "Q5_0": BlockType(6, 32, 22, 5, 32), "Q5_1": BlockType(7, 32, 24, 5, 32),
    "Q2_K": BlockType(10, 256, 84, 2, 16), "Q3_K": BlockType(11, 256, 110, 3, 16),
    "Q4_K": BlockType(12, 256, 144, 4, 32), "Q5_K": BlockType(13, 256, 176, 5, 32),
    "Q6_K": BlockType(14, 256, 210, 6, 16),
}


@dataclass
class GGMLWeight:
    """W [N, K] as ggml blocks: `blocks` uint8 [N, K / values * nbytes], a row's blocks in order."""

    type_name: str
    blocks: Tensor
    in_features: int

    def __post_init__(self) -> None:
        t = TYPES.get(self.type_name)
        if t is None:
            raise ValueError(f"no ggml block layout for {self.type_name}; kept as codes: {', '.join(TYPES)}")
        if self.in_features % t.values or self.blocks.dim() != 2 or self.blocks.dtype != torch.uint8:
            raise ValueError(f"{self.type_name} takes uint8 [N, K / {t.values} * {t.nbytes}] for K a multiple of "
                             f"{t.values}, not {self.blocks.dtype} {tuple(self.blocks.shape)} for K = {self.in_features}")
        if self.blocks.shape[1] != self.in_features // t.values * t.nbytes:
            raise ValueError(f"{self.type_name} rows of {self.in_features} values take "
                             f"{self.in_features // t.values * t.nbytes} bytes, not {self.blocks.shape[1]}")

    # what QuantLinear, the kernels' plans and the exporters read of a packed weight
    offsets = None
    mins = None
    symmetric = False

    @property
    def layout(self) -> BlockType:
        return TYPES[self.type_name]

    @property
    def kind(self) -> int:
        return self.layout.kind

    @property
    def bits(self) -> int:
        return self.layout.bits

    @property
    def block_size(self) -> int:
        """Values per scale (16 or 32): the group of the QuantizedWeight `unpack()` gives."""
        return self.layout.sub

    @property
    def codes(self) -> Tensor:
        return self.blocks

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def sub_blocks(self) -> int:
        """Sub-blocks of 32 per row (x is rounded per 32 values for the integer dot products)."""
        return self.in_features // 32

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def to(self, device: torch.device | str) -> "GGMLWeight":
        return GGMLWeight(self.type_name, self.blocks.to(device), self.in_features)

    def rows(self, ids: Tensor) -> "GGMLWeight":
        """The rows `ids` (a token embedding's gather), as a weight of len(ids) rows."""
        return GGMLWeight(self.type_name, self.blocks.index_select(0, ids.to(self.blocks.device)), self.in_features)

    def unpack(self) -> QuantizedWeight:
        """The QuantizedWeight of the same values: codes, s_j, z and -m_j as offsets (see the table above)."""
        n, t = self.out_features, self.layout
        b = self.blocks.view(n, -1, t.nbytes)  # [N, blocks, bytes]
        codes, scales, mins = _UNPACK[self.type_name](b)  # [N, blocks, values], [N, blocks, values / sub] x2
        zero = {"Q5_0": 16, "Q3_K": 4, "Q6_K": 32}.get(self.type_name, 0)
        scales = scales.reshape(n, -1).contiguous()
        return QuantizedWeight(codes.reshape(n, -1).contiguous(), scales,
                               torch.full(scales.shape, zero, dtype=torch.uint8, device=scales.device), t.bits,
                               t.sub, self.in_features, zero != 0,
                               None if mins is None else (-mins).reshape(n, -1).contiguous())

    def dequantize(self) -> Tensor:
        """float32 [N, K]: gguf.quants.dequantize of the same blocks, bit for bit."""
        return self.unpack().dequantize()

    def export_form(self) -> tuple[QuantizedWeight, dict]:
        """The weight as MatMulNBits takes it (4 or 8 bits, blocks of 32) and a note of how it got there.

        Exact: Q4_K (its own codes, s_j and -m_j as offsets); Q5_0, Q5_1 and Q5_K (the 5-bit codes as 8-bit
        codes); Q3_K (c = 128 - (sc - 32)(q - 4) over -D, every product of a 6-bit signed scale and a 3-bit
        signed code being within [-124, 128]). Re-quantized to 8 bits per 32 (RTN), their error against the
        file's weights stated: Q6_K (its two int8 scales of a block of 32 cannot be one) and Q2_K (its minimums
        per 16 cannot be one per 32; 4 bits would add ~8% relative error to its weights, 8 bits ~0.4%)."""
        q = self.unpack()
        n, k = self.out_features, self.in_features
        if self.type_name == "Q4_K":
            return q, {"type": self.type_name, "form": "4-bit, exact"}
        if self.type_name in ("Q5_0", "Q5_1", "Q5_K"):
            # The 5-bit codes c (0-31) as 8-bit codes c + 112 and zero points z + 112 (centred on 128, MatMulNBits'
            # default zero point): with c itself, onnxruntime and the page's kernels, which round a few activations
            # apart, parted by ~1 logit on the first token of llama-quantize's Q4_K_M SmolLM2
            # (benchmarks/kquant_web_check.py). Q5_0 (z = 16) becomes symmetric.
            assert q.bits == 5, q.bits
            return (q.as_centred_int8(),
                    {"type": self.type_name, "form": "8-bit, exact"})
        if self.type_name == "Q3_K":  # per 16: s_j (q - 4) with s_j = D (sc_j - 32): D over 32 values, c signed
            b = self.blocks.view(n, -1, self.layout.nbytes)
            d = _half(b, 108).expand(n, b.shape[1], 8).reshape(n, -1)  # [N, K / 32]
            sc = torch.round(q.scales / _half(b, 108).expand(n, b.shape[1], 16).reshape(n, -1).where(
                q.scales != 0, torch.ones(()))).to(torch.int16)  # the integer sc - 32 (0 where D is 0)
            p = sc.repeat_interleave(16, dim=1) * (q.codes.to(torch.int16) - 4)  # [N, K] in [-124, 128]
            codes = (128 - p).to(torch.uint8)
            return (QuantizedWeight(codes, -d, torch.full(d.shape, 128, dtype=torch.uint8), 8, 32, k, True),
                    {"type": self.type_name, "form": "8-bit, exact"})
        from .rtn import quantize_rtn  # Q6_K, Q2_K: re-quantized a slab of rows at a time (a 128256-row head)

        bits, symmetric = 8, self.type_name == "Q6_K"
        parts, worst, err2, ref2 = [], 0.0, 0.0, 0.0
        for r in range(0, n, 4096):
            w = GGMLWeight(self.type_name, self.blocks[r:r + 4096], k).dequantize()
            part = quantize_rtn(w, bits, 32, symmetric)
            diff = part.dequantize() - w
            worst, err2, ref2 = max(worst, diff.abs().max().item()), err2 + diff.square().sum().item(), \
                ref2 + w.square().sum().item()
            parts.append(part)
        out = QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                              torch.cat([p.zero_points for p in parts]), bits, 32, k, symmetric)
        return out, {"type": self.type_name, "form": f"re-quantized to {bits}-bit blocks of 32 (RTN)",
                     "max_abs_error": worst, "relative_rms_error": (err2 / ref2) ** 0.5 if ref2 else 0.0}


def _half(b: Tensor, at: int) -> Tensor:
    """The fp16 at byte `at` of every block, as float32: [N, blocks, 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _scales_k4(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 mins (get_scale_min_k4): [..., 8] each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _bits(v: Tensor, shifts: list[int], mask: int) -> Tensor:
    """(v[..., None, :] >> shift) & mask for each shift: [..., len(shifts), v.shape[-1]]."""
    sh = torch.tensor(shifts, dtype=torch.uint8, device=v.device).view(-1, 1)
    return (v.unsqueeze(-2) >> sh) & mask


def _q5(b: Tensor, d_at: int, qh_at: int) -> Tensor:
    """Q5_0/Q5_1 codes [N, blocks, 32]: nibble j = value j (low) and j + 16 (high), qh bit i = value i's 5th."""
    qs = b[..., qh_at + 4:qh_at + 20]
    low = torch.cat([qs & 15, qs >> 4], dim=-1)  # [N, blocks, 32]
    qh = b[..., qh_at:qh_at + 4].contiguous().view(torch.int32)  # little-endian u32 (bit 31 kept by the & 1)
    high = (qh >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1
    return low | (high.to(torch.uint8) << 4)


def _q5_0(b: Tensor):
    return _q5(b, 0, 2), _half(b, 0), None


def _q5_1(b: Tensor):
    return _q5(b, 0, 4), _half(b, 0), -_half(b, 2)  # w = d q + m: m_j = -m


def _q2_k(b: Tensor):
    sc, qs = b[..., 0:16], b[..., 16:80]
    n, nb = b.shape[:2]
    codes = _bits(qs.view(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 256)  # [h, r, l] -> value 128h + 32r + l
    return codes, _half(b, 80) * (sc & 15).float(), _half(b, 82) * (sc >> 4).float()


def _q3_k(b: Tensor):
    hmask, qs, s = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    n, nb = b.shape[:2]
    low = _bits(qs.view(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 256)
    high = _bits(hmask, list(range(8)), 1).reshape(n, nb, 256)  # bit b of hmask[l]: value 32b + l
    lo4 = torch.cat([s[..., 0:8] & 15, s[..., 0:8] >> 4], dim=-1)  # [N, blocks, 16]
    hi2 = _bits(s[..., 8:12], [0, 2, 4, 6], 3).reshape(n, nb, 16)  # scale 4i + k: bits 2i of byte 8 + k
    sc = (lo4 | (hi2 << 4)).to(torch.int16) - 32
    return low | (high << 2), _half(b, 108) * sc.float(), None


def _q4_k(b: Tensor):
    sc, mn = _scales_k4(b[..., 4:16])
    qs = b[..., 16:144]
    n, nb = b.shape[:2]
    codes = _bits(qs.view(n, nb, 4, 32), [0, 4], 15).reshape(n, nb, 256)  # [i, nibble, l] -> 64i + 32 nibble + l
    return codes, _half(b, 0) * sc.float(), _half(b, 2) * mn.float()


def _q5_k(b: Tensor):
    sc, mn = _scales_k4(b[..., 4:16])
    qh, qs = b[..., 16:48], b[..., 48:176]
    n, nb = b.shape[:2]
    low = _bits(qs.view(n, nb, 4, 32), [0, 4], 15).reshape(n, nb, 256)
    high = _bits(qh, list(range(8)), 1).reshape(n, nb, 256)
    return low | (high << 4), _half(b, 0) * sc.float(), _half(b, 2) * mn.float()


def _q6_k(b: Tensor):
    ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208]
    n, nb = b.shape[:2]
    low = _bits(ql.view(n, nb, 2, 64), [0, 4], 15).reshape(n, nb, 256)  # [h, nibble, l]: value 128h + 64 nibble + l
    high = _bits(qh.view(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 256)  # [h, r, l]: 128h + 32r + l
    return low | (high << 4), _half(b, 208) * sc.view(torch.int8).float(), None


_UNPACK = {"Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
