"""Rotary position embeddings, computed exactly as transformers 5 does.

`inv_frequencies` turns a `RopeParameters` into the per-pair inverse
frequencies for each rope type (default, linear, dynamic NTK, llama3, YaRN,
LongRoPE) and the factor that scales cos and sin (YaRN and LongRoPE's
attention factor). Two types depend on how long the sequence is: dynamic NTK
stretches the base once the sequence passes `max_position_embeddings`, and
LongRoPE swaps its short factors for its long ones once the sequence passes
`original_max_position_embeddings`. The sequence length is the largest
position in the call plus one, as in transformers.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from ..config import ModelConfig, RopeParameters, longrope_switch_length  # noqa: F401 (re-exported)


def rotary_dim(config: ModelConfig) -> int:
    """How many leading channels of each head rotate (Phi's partial_rotary_factor)."""
    return int(config.head_dim * config.rope_parameters.partial_rotary_factor)


@functools.lru_cache(maxsize=64)
def inv_frequencies(rope: RopeParameters, dim: int, max_position_embeddings: int,
                    seq_len: int = 0) -> tuple[Tensor, float]:
    """Inverse frequencies [dim // 2] (float32, CPU) and the cos/sin scale.

    `seq_len` matters only for "dynamic" and "longrope"; callers pass 0 for
    the others so the cache keeps one entry per model.
    """
    base, kind = rope.rope_theta, rope.rope_type
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    if kind == "default":
        return 1.0 / (base ** exponents), 1.0
    if kind == "linear":
        return 1.0 / (base ** exponents) / rope.factor, 1.0
    if kind == "dynamic":
        return _dynamic_ntk(rope, exponents, dim, max_position_embeddings, seq_len), 1.0
    if kind == "llama3":
        return _llama3(rope, 1.0 / (base ** exponents)), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    if kind == "longrope":
        return _longrope(rope, exponents, max_position_embeddings, seq_len)
    raise ValueError(f"unsupported rope type {kind!r}")


def _dynamic_ntk(rope: RopeParameters, exponents: Tensor, dim: int, max_pos: int, seq_len: int) -> Tensor:
    if seq_len <= max_pos:  # inside the trained length: plain rope
        return 1.0 / (rope.rope_theta ** exponents)
    # transformers computes the stretched base from a tensor seq_len, so in float32.
    length = torch.tensor(seq_len)
    stretch = (rope.factor * length / max_pos) - (rope.factor - 1)
    base = rope.rope_theta * stretch ** (dim / (dim - 2))
    return 1.0 / (base ** exponents)


def _llama3(rope: RopeParameters, inv_freq: Tensor) -> Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend between."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeParameters, dim: int, max_pos: int) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between."""
    base = rope.rope_theta
    original = rope.original_max_position_embeddings or max_pos
    factor = rope.factor if rope.factor is not None else max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate is None or rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [dim/2]
    extrapolation = 1 - ramp  # 1 keeps a frequency, 0 interpolates it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _longrope(rope: RopeParameters, exponents: Tensor, max_pos: int, seq_len: int) -> tuple[Tensor, float]:
    """LongRoPE (Phi-3): per-frequency factors, short or long by sequence length."""
    original = rope.original_max_position_embeddings or max_pos
    factor = rope.factor if rope.factor is not None else max_pos / original
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = rope.long_factor if seq_len > original else rope.short_factor
    ext = torch.tensor(factors, dtype=torch.float32)  # [dim/2]
    return 1.0 / (ext * rope.rope_theta ** exponents), attention_factor


class RotaryEmbedding(nn.Module):
    """cos and sin [B, T, rotary_dim] for the positions of one forward call."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rope = config.rope_parameters
        self.dim = rotary_dim(config)
        self.max_position_embeddings = config.max_position_embeddings
        self.switch_length = {"dynamic": self.max_position_embeddings,
                              "longrope": self.rope.original_max_position_embeddings or self.max_position_embeddings,
                              }.get(self.rope.rope_type)
        self._device_freqs: dict[torch.device, Tensor] = {}

    def _length_key(self, positions: Tensor) -> int:
        """The sequence length if it changes the frequencies, else 0 (one cache entry)."""
        if self.switch_length is None:
            return 0
        seq_len = int(positions.max()) + 1  # a device sync, only for dynamic and longrope
        if seq_len <= self.switch_length:
            return 0
        return seq_len if self.rope.rope_type == "dynamic" else self.switch_length + 1

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        seq_len = self._length_key(positions)
        inv_freq, scale = inv_frequencies(self.rope, self.dim, self.max_position_embeddings, seq_len)
        if seq_len == 0:  # one copy per device, not one per call (a CUDA graph can capture no host copy)
            if positions.device not in self._device_freqs:
                self._device_freqs[positions.device] = inv_freq.to(positions.device)
            inv_freq = self._device_freqs[positions.device]
        freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, dim]
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, D]; with partial rope only the first cos.shape[-1] channels turn."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, rot]
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
