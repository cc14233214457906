"""Token embeddings gathered from quantized rows, as llama.cpp gathers them from a quantized token_embd.

    model.model.embed_tokens = QuantEmbedding(model.lm_head, torch.float32)  # tied: the head's own codes
    x = model.model.embed_tokens(input_ids)  # [..., hidden]: dequantized rows of the ids asked for

A quantized model that kept its float table for the embedding held Qwen2.5-0.5B's 151936 x 896 float32
matrix (545 MB) beside an int8 LM head of 136 MB: most of the gap to llama.cpp's peak RSS. Here the
table is a `QuantLinear` (the tied head itself, or the embedding's own int8 codes when untied) and a
forward dequantizes only the rows of the step. Each row is exactly the table's reference dequantization,
`table.dequantize()[ids]` ((q - z) * s (+ offset) in float32), then rounded to the model's dtype: for a
tied head, the very weights the head multiplies with. Against the float table this moves the input of
the first layer by the table's rounding error (int8 per channel: ~0.4% of a row's largest value).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ggml import GGMLWeight
from .kernels import PackedWeight, broadcast_zero
from .linear import QuantLinear, dequantize_packed
from .rtn import QuantizedWeight


class QuantEmbedding(nn.Module):
    """nn.Embedding over a QuantLinear's rows: forward(ids [...]) -> [..., hidden] in `dtype`."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype, *, tied: bool) -> None:
        """tied: `table` is the model's LM head (registered there, not here: one module, listed once)."""
        super().__init__()
        if table.packed is None or table.perm is not None:
            raise ValueError("QuantEmbedding takes a packed QuantLinear with its columns in order")
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype, self.tied = dtype, tied
        if tied:
            object.__setattr__(self, "_head", table)  # read at each call: follows the head's .to(device)
        else:
            self.table = table

    @property
    def rows(self) -> QuantLinear:
        return self._head if self.tied else self.table

    @property
    def qweight(self) -> QuantizedWeight:
        """The table's QuantizedWeight (the ONNX exporter gathers rows from it)."""
        return self.rows.qweight

    @property
    def nbytes(self) -> int:
        """Bytes held by this module alone (a tied table is the head's)."""
        return 0 if self.tied else self.table.nbytes

    def forward(self, input_ids: Tensor) -> Tensor:
        table = self.rows
        if not isinstance(table, QuantLinear):  # a float Linear put in its place (a model's dequantized copy)
            return F.embedding(input_ids, table.weight).to(self.dtype)
        ids = input_ids.reshape(-1)  # an id out of range fails in index_select, as in nn.Embedding
        p = table.packed
        if isinstance(p, PackedWeight) and p.bits == 8 and p.scales.shape[1] == 1 and p.mins is None and p.offsets is None:
            # int8 per channel, symmetric (the default head): w = c * s, c the stored int8 (code - 128);
            # dequantize_packed's (c + 128 - 128) * s in 4 ops instead of ~15 (a decode step gathers one row)
            codes = p.codes.index_select(0, ids.to(p.codes.device))[:, :p.in_features]
            x = codes.view(torch.int8).float() * p.scales.index_select(0, ids.to(p.codes.device))
        else:
            x = dequantize_packed(gather_rows(p, ids))  # [n, hidden] float32
        return x.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def _apply(self, fn, recurse: bool = True):
        """.to(dtype) sets the output dtype (the codes stay integers); .to(device) moves an own table."""
        probe = fn(torch.zeros((), dtype=self.dtype))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {'tied to the LM head' if self.tied else 'own table'}"


def gather_rows(p: PackedWeight | GGMLWeight, ids: Tensor) -> PackedWeight | GGMLWeight:
    """The rows `ids` of a packed weight, as a packed weight of len(ids) rows."""
    if isinstance(p, GGMLWeight):
        return p.rows(ids)
    ids = ids.to(p.codes.device)
    take = lambda t: None if t is None else t.index_select(0, ids)  # noqa: E731
    zeros = take(p.zero_points) if p.zero is None else broadcast_zero(p.zero, (len(ids), p.zero_points.shape[1]),
                                                                      p.zero_points.device)
    return PackedWeight(take(p.codes), take(p.scales), zeros, take(p.mins), p.bits, p.block_size,
                        p.in_features, p.symmetric, p.spg, take(p.offsets))


def install_quant_embedding(model: nn.Module, table: QuantLinear, tied: bool,
                            dtype: torch.dtype | None = None) -> QuantEmbedding | None:
    """Swap the model's float embedding (model.model.embed_tokens) for a QuantEmbedding over `table`: the
    LM head when `tied`, else the embedding's own codes; rows come out in `dtype` (default: the float
    table's). None (nothing changed) when the shapes differ or the table cannot be gathered from."""
    decoder = getattr(model, "model", None)
    embedding = getattr(decoder, "embed_tokens", None)
    if type(embedding) is not nn.Embedding or table.packed is None or table.perm is not None:
        return None
    if (table.out_features, table.in_features) != tuple(embedding.weight.shape):
        return None
    decoder.embed_tokens = QuantEmbedding(table, dtype or embedding.weight.dtype, tied=tied)
    return decoder.embed_tokens
