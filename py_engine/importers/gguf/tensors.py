"""GGUF tensors -> Hugging Face parameters: names, shapes, and what llama.cpp's converter changed.

Names come from ggml's own table (`gguf.get_tensor_name_map`, the one llama.cpp's
converter writes with), asked for each parameter the model has. Three changes
made by convert_hf_to_gguf.py are undone here:

- llama: q_proj and k_proj rows (and biases) are permuted per head from the
  halves layout transformers' rotary uses to interleaved pairs (ggml's rope):
  `permute` reshapes [heads, 2, d/2, ...] and swaps the two middle axes; the inverse
  reshapes [heads, d/2, 2, ...] and swaps them back (k uses the KV head count).
  It moves whole rows, so quantized rows are un-permuted as they are.
- gemma, gemma2: norm weights are stored as 1 + w (ggml multiplies by the
  weight); transformers' Gemma norms take w and add 1 themselves.
- shapes: ggml lists dimensions innermost first; reversed, they are torch's.

Float, F16, BF16 and every quantized type are read as float32 with gguf's reference
dequantization (`gguf.quants.dequantize`, bit-exact with ggml's C); see
quantized.py for the types kept as integer codes.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .reader import GGUFFile, GGUFTensor, load_error

PERMUTED_ARCHS = ("llama",)  # converters of the other families keep transformers' row order (NeoX rope)
NORM_PLUS_ONE_ARCHS = ("gemma", "gemma2")


def name_map(gguf: GGUFFile, hf_names: Iterable[str], layers: int) -> dict[str, str]:
    """{HF parameter name: GGUF tensor name} for the parameters the GGUF names (others are left out)."""
    import gguf as ggml

    arch = {v: k for k, v in ggml.MODEL_ARCH_NAMES.items()}[gguf.architecture]
    table = ggml.get_tensor_name_map(arch, layers)
    out = {}
    for name in hf_names:
        stem, _, suffix = name.rpartition(".")
        found = table.get_name(stem)
        if found is not None:
            out[name] = f"{found}.{suffix}"
    return out


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Index i -> the GGUF row that holds HF row i of a permuted q/k projection with `heads` heads."""
    half = rows // heads // 2
    # GGUF row order: HF rows reshaped [heads, 2, half] with the last two axes swapped ([heads, half, 2])
    order = np.arange(rows).reshape(heads, 2, half).swapaxes(1, 2).reshape(rows)  # GGUF row j holds HF row order[j]
    inverse = np.empty(rows, dtype=np.int64)
    inverse[order] = np.arange(rows)
    return inverse


def row_order(gguf: GGUFFile, gguf_name: str, config: dict) -> np.ndarray | None:
    """The row gather that undoes llama.cpp's q/k permutation for this tensor, or None."""
    if gguf.architecture not in PERMUTED_ARCHS:
        return None
    if ".attn_q." in gguf_name:
        heads = config["num_attention_heads"]
    elif ".attn_k." in gguf_name:
        heads = config["num_key_value_heads"]
    else:
        return None
    rows = gguf.tensors[gguf_name].shape[0]
    if rows % (2 * heads):
        raise load_error(f"{gguf.path}: tensor {gguf_name!r} has {rows} rows, not whole pairs of {heads} heads")
    return unpermute_rows(rows, heads)


def float_tensor(gguf: GGUFFile, gguf_name: str, config: dict) -> np.ndarray:
    """The tensor as HF float32, dequantized, un-permuted, norms as transformers stores them."""
    t = gguf.tensors[gguf_name]
    values = dequantize(gguf, t)
    order = row_order(gguf, gguf_name, config)
    if order is not None:
        values = values[order]
    if gguf.architecture in NORM_PLUS_ONE_ARCHS and gguf_name.endswith("norm.weight"):
        values = values - np.float32(1.0)
    if values.nbytes <= SMALL_COPY and np.may_share_memory(values, t.data):
        # an F32 norm or bias would stay a view of the file's mapping: every forward then touches the file, and
        # each first touch maps the pages around it too (SmolLM2 Q4_K_M: 28 MiB of the GGUF back in the RSS
        # after one prefill, beside the codes' own copies). A copy of a few KiB lets the mapping go untouched.
        return np.array(values, dtype=np.float32, copy=True)
    return np.ascontiguousarray(values)


SMALL_COPY = 1 << 20  # bytes: the F32 tensors copied out of the file (norms, biases), not an F32 model's matrices


DEQUANT_ROWS = 8192  # rows of a matrix dequantized at a time


def dequantize(gguf: GGUFFile, t: GGUFTensor) -> np.ndarray:
    """float32 in torch's shape, with ggml's reference dequantization."""
    import gguf as ggml

    qtype = ggml.GGMLQuantizationType.BF16 if t.type_name == "BF16" else t.qtype
    data = t.data
    try:
        if data.ndim == 2 and len(t.shape) == 2 and data.shape[0] == t.shape[0] > DEQUANT_ROWS:
            # rows of blocks, a chunk at a time into one float32 array: gguf.quants' temporaries are
            # several times their input's float size (a 151936 x 896 Q4_0 embedding peaked ~2 GB whole)
            out = np.empty(t.shape, dtype=np.float32)
            for r in range(0, t.shape[0], DEQUANT_ROWS):
                out[r:r + DEQUANT_ROWS] = np.asarray(ggml.quants.dequantize(data[r:r + DEQUANT_ROWS], qtype),
                                                     dtype=np.float32).reshape(-1, t.shape[1])
            return out
        values = ggml.quants.dequantize(data, qtype)
    except NotImplementedError:
        raise load_error(f"{gguf.path}: tensor {t.name!r} is {t.type_name}, which gguf cannot dequantize; "
                         "ruvllm reads F32, F16, BF16 and the types gguf.quants implements") from None
    return np.asarray(values, dtype=np.float32).reshape(t.shape)


def check_shape(gguf: GGUFFile, gguf_name: str, hf_name: str, shape: tuple[int, ...]) -> None:
    found = gguf.tensors[gguf_name].shape
    if tuple(found) != tuple(shape):
        raise load_error(f"{gguf.path}: tensor {gguf_name!r} ({hf_name}) has shape {list(found)} but the "
                         f"file's metadata implies {list(shape)}: its size disagrees with its shape")
