"""step.c's structures as ctypes mirrors (proj_t, lora_t, step_layer_t, step_t), and NotStackable."""
from __future__ import annotations

import ctypes

from ..kernels import ColdTier

P = ctypes.c_void_p


class Proj(ctypes.Structure):
    """step.c's proj_t: one projection, quantized (QuantPlan's matrices) or float (weights)."""

    _fields_ = [("parts", P), ("biases", P), ("ns", P), ("quant", ctypes.c_int32), ("n_parts", ctypes.c_int32),
                ("mode", ctypes.c_int32), ("gated", ctypes.c_int32), ("out", ctypes.c_int64), ("lora", P)]


class Lora(ctypes.Structure):
    """step.c's lora_t: A [r, in], scaled B^T [r, rows], each column's rows lo..hi and weight, fp32."""

    _fields_ = [("A", P), ("Bt", P), ("r", ctypes.c_int64), ("lo", P), ("hi", P), ("scale", P)]


class Layer(ctypes.Structure):
    """step.c's step_layer_t."""

    _fields_ = [("norm_attn", P), ("norm_mlp", P), ("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("keys", P), ("values", P), ("window", ctypes.c_int64), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("cold", ColdTier)]


class Step(ctypes.Structure):
    """step.c's step_t."""

    _fields_ = [("layers", P), ("final_norm", P), ("n_layers", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("H", ctypes.c_int64), ("KV", ctypes.c_int64), ("D", ctypes.c_int64), ("max_len", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("eps", ctypes.c_float), ("unit_offset", ctypes.c_int32),
                ("bf16", ctypes.c_int32), ("h", P), ("qkv", P), ("attn", P), ("wide", P), ("act", P), ("tmp", P),
                ("scratch", P), ("lora_h", P), ("lora_x", P), ("lora_d", P), ("cold_tokens", ctypes.c_int64),
                ("cold_bits", ctypes.c_int64), ("cold_bs", ctypes.c_int64), ("cold_max_blocks", ctypes.c_int64),
                ("paged", P), ("q", P), ("slot", ctypes.c_int64)]


class NotStackable(Exception):
    """Why a model or a step cannot take the one-call path (internal: it falls back)."""
