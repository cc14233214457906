"""Rotary cos/sin tables for the exported graph, from the torch model's own frequencies.

A table row p holds cos(p * inv_freq) * scale for the rotary pairs, [max_pos, rot/2]:
the half-width layout onnxruntime's GroupQueryAttention and RotaryEmbedding
take, duplicated in-graph for the plain variant. Values come from
`py_engine.models.rope.inv_frequencies` and the same float32 arithmetic as
`RotaryEmbedding.forward`, so ONNX and torch rotate by identical numbers.

Two rope types depend on the sequence length:
- LongRoPE switches to its long factors once the sequence passes
  `original_max_position_embeddings`: the table stacks the short then the
  long variant, and the graph picks one from max(position_ids) + 1, as torch does.
- dynamic NTK changes frequencies only past `max_position_embeddings`, which
  is also the longest context ruvllm runs, so inside it the default table is exact.
"""
from __future__ import annotations

import numpy as np
import torch

from py_engine.config import ModelConfig
from py_engine.models.rope import inv_frequencies, longrope_switch_length, rotary_dim


def rope_tables(config: ModelConfig) -> tuple[np.ndarray, np.ndarray, int | None]:
    """cos, sin [variants * max_pos, rot/2] float32, and the switch length (LongRoPE) or None."""
    rope, dim, max_pos = config.rope_parameters, rotary_dim(config), config.max_position_embeddings
    switch = longrope_switch_length(config)
    lengths = [0] if switch is None else [0, switch + 1]  # the seq_len keys RotaryEmbedding uses
    positions = torch.arange(max_pos)[:, None].float()  # [max_pos, 1]
    cos, sin = [], []
    for seq_len in lengths:
        inv_freq, scale = inv_frequencies(rope, dim, max_pos, seq_len)
        freqs = positions * inv_freq  # [max_pos, rot/2]
        cos.append((freqs.cos() * scale).numpy())
        sin.append((freqs.sin() * scale).numpy())
    return np.concatenate(cos).astype(np.float32), np.concatenate(sin).astype(np.float32), switch
