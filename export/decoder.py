"""Build the whole decoder graph (prefill and decode in one) from a loaded torch model.

    ids -> embed -> [norm -> attention -> add -> norm -> mlp -> add] x L -> norm -> lm_head -> logits

The graph is written node by node from the weights (onnx.helper) rather
than traced with torch.onnx.export: tracing the torch model would bake in
its dense-cache scatter and dynamic mask building, and the rewrite needed
to reach onnxruntime's fused ops (GroupQueryAttention, SkipSimplifiedLayer-
Normalization, MatMulNBits) costs more than writing the ~15 nodes a layer
needs directly. Names and shapes follow export.contract.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto

from py_engine.config import ModelConfig
from py_engine.models import CausalLM
from py_engine.quant import QuantizedWeight

from . import contract as C
from .attention import AttentionInputs
from .blocks import BlockEmitter
from .graph import GraphBuilder, TensorStore
from .linear import Linear, PackedInits, rows_len
from .options import ExportError, ExportOptions
from .quantized import layer_weight
from .rope_tables import rope_tables
from .web_weights import WebInits, gather_rows
from py_engine.models.rope import rotary_dim

DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64}


def build_decoder(model: CausalLM, config: ModelConfig, options: ExportOptions, metadata: dict[str, str],
                  store: TensorStore | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  records: dict[str, dict] | None = None) -> onnx.ModelProto:
    """The decoder ModelProto; `progress(done, total)` is called after each layer; `records` receives which
    initializers each projection and norm uses (export.web_engine)."""
    float_dtype = np.float16 if options.precision == "fp16" else np.float32
    g = GraphBuilder(store)
    if records is not None:
        g.records = records
    emit = BlockEmitter(g, config, options, Linear(g, options, float_dtype))
    io = C.IOContract.for_config(config, "float16" if float_dtype == np.float16 else "float32")
    for name, dtype, shape in io.inputs():
        g.add_input(name, DTYPES[dtype], shape)
    shared = attention_inputs(g, config, options, float_dtype)
    x, lm_head = embed(emit, model)
    delta, presents = None, []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        x, delta, present = decoder_layer(emit, layer, i, x, delta, shared)
        presents.append(present)
        if progress:
            progress(i + 1, len(layers))
    hidden, _ = emit.add_norm(x, delta, model.model.norm, "model.norm")
    logits = head(emit, model, hidden, lm_head)
    for (name, dtype, shape), source in zip(io.outputs(), [logits] + [t for p in presents for t in p]):
        g.add_output(source, name, DTYPES[dtype], shape)
    return g.model("ruvllm_decoder", metadata)


def decoder_layer(emit: BlockEmitter, layer, i: int, x: str, delta: str | None,
                  shared: AttentionInputs) -> tuple[str, str, tuple[str, str]]:
    """One block; returns the residual stream, the pending residual delta and (present_k, present_v).

    The delta is added by the next norm, so the residual add fuses with it.
    """
    name = f"model.layers.{i}"
    h, x = emit.add_norm(x, delta, layer.input_layernorm, f"{name}.input_layernorm")
    attn, pk, pv = emit.attention(h, layer.self_attn, i, (C.past_key(i), C.past_value(i)), shared,
                                  f"{name}.self_attn")
    if layer.sandwich:  # Gemma 2 normalises the sublayer outputs before adding them
        attn = emit.rms_norm(attn, layer.post_attention_layernorm, f"{name}.post_attention_layernorm")
        h, x = emit.add_norm(x, attn, layer.pre_feedforward_layernorm, f"{name}.pre_feedforward_layernorm")
    else:
        h, x = emit.add_norm(x, attn, layer.post_attention_layernorm, f"{name}.post_attention_layernorm")
    if layer.moe:
        out = emit.moe(h, layer.block_sparse_moe, f"{name}.block_sparse_moe")
    else:
        out = emit.mlp(h, layer.mlp, f"{name}.mlp")
    if layer.sandwich:
        out = emit.rms_norm(out, layer.post_feedforward_layernorm, f"{name}.post_feedforward_layernorm")
    return x, out, (pk, pv)


def attention_inputs(g: GraphBuilder, config: ModelConfig, options: ExportOptions,
                     float_dtype: type) -> AttentionInputs:
    """Rope tables (picked by sequence length for LongRoPE) and the mask-derived inputs."""
    cos_t, sin_t, switch = rope_tables(config)
    cos = g.initializer("rope.cos_table", cos_t.astype(float_dtype))
    sin = g.initializer("rope.sin_table", sin_t.astype(float_dtype))
    g.records["rope"] = {"cos": cos, "sin": sin}
    total = g.node("Gather", [g.node("Shape", [C.ATTENTION_MASK], "mask/shape"), g.const(1)], "mask/total")
    rot = 2 * cos_t.shape[1]
    if not options.contrib_ops:
        cos, sin = _rope_by_position(g, config, cos, sin, switch)
        return AttentionInputs(cos, sin, masks=_masks(g, config, total), rot_dim=rot, float_dtype=float_dtype)
    valid = g.node("ReduceSum", [C.ATTENTION_MASK, g.const([1])], "mask/valid", keepdims=0)
    seqlens = g.node("Cast", [g.node("Sub", [valid, g.const(1)], "mask/seqlens")], "mask/seqlens_k",
                     to=TensorProto.INT32)
    total32 = g.node("Cast", [total], "mask/total_seq_len", to=TensorProto.INT32)
    if not gqa_rotates(config):  # rope by position outside the kernel, GroupQueryAttention without it
        cos, sin = _rope_by_position(g, config, cos, sin, switch)
        return AttentionInputs(cos, sin, seqlens_k=seqlens, total_len=total32, rot_dim=rot, rope_in_kernel=False,
                               float_dtype=float_dtype)
    if switch is not None:  # LongRoPE: the long table once the sequence passes `switch`
        max_pos = config.max_position_embeddings
        cos, sin = (_pick_variant(g, t, total, switch, max_pos, n) for t, n in ((cos, "cos"), (sin, "sin")))
    return AttentionInputs(cos, sin, seqlens_k=seqlens, total_len=total32, rot_dim=rot, float_dtype=float_dtype)


def gqa_rotates(config: ModelConfig) -> bool:
    """GroupQueryAttention's rotary needs rot/2 a multiple of 8 (true of real checkpoints)."""
    return (rotary_dim(config) // 2) % 8 == 0


def _rope_by_position(g: GraphBuilder, config: ModelConfig, cos: str, sin: str,
                      switch: int | None) -> tuple[str, str]:
    """cos, sin [B, 1, T, rot] gathered by position_ids (the long LongRoPE rows past `switch`)."""
    index = C.POSITION_IDS
    if switch is not None:
        seq_len = g.node("Add", [g.node("ReduceMax", [C.POSITION_IDS], "rope/max_pos", keepdims=0), g.const(1)],
                         "rope/seq_len")
        offset = g.node("Mul", [g.node("Cast", [g.node("Greater", [seq_len, g.const(switch)], "rope/long")],
                                       "rope/variant", to=TensorProto.INT64),
                                g.const(config.max_position_embeddings)], "rope/offset")
        index = g.node("Add", [C.POSITION_IDS, offset], "rope/index")
    pair = []
    for table, n in ((cos, "cos"), (sin, "sin")):
        t = g.node("Gather", [table, index], f"rope/{n}_half", axis=0)  # [B, T, rot/2]
        t = g.node("Concat", [t, t], f"rope/{n}_full", axis=-1)  # [B, T, rot]
        pair.append(g.node("Unsqueeze", [t, g.const([1])], f"rope/{n}"))  # [B, 1, T, rot]
    return pair[0], pair[1]


def _pick_variant(g: GraphBuilder, table: str, total: str, switch: int, max_pos: int, name: str) -> str:
    start = g.node("Mul", [g.node("Cast", [g.node("Greater", [total, g.const(switch)], f"rope/{name}_long")],
                                  f"rope/{name}_variant", to=TensorProto.INT64), g.const(max_pos)],
                   f"rope/{name}_start")
    start = g.node("Unsqueeze", [start, g.const([0])], f"rope/{name}_start1")
    end = g.node("Add", [start, g.const([max_pos])], f"rope/{name}_end")
    return g.node("Slice", [table, start, end, g.const([0])], f"rope/{name}_table")


def _masks(g: GraphBuilder, config: ModelConfig, total: str) -> dict[int | None, str]:
    """bool [B, 1, G*T, S] per window: causal by cache slot, padding from attention_mask."""
    T = g.node("Gather", [g.node("Shape", [C.INPUT_IDS], "mask/ids_shape"), g.const(1)], "mask/T")
    past = g.node("Sub", [total, T], "mask/past")
    k_slot = g.node("Unsqueeze", [g.node("Range", [g.const(0), total, g.const(1)], "mask/k_range"), g.const([0])],
                    "mask/k_slot")  # [1, S]
    q_slot = g.node("Unsqueeze", [g.node("Range", [past, total, g.const(1)], "mask/q_range"), g.const([1])],
                    "mask/q_slot")  # [T, 1]
    causal = g.node("LessOrEqual", [k_slot, q_slot], "mask/causal")  # [T, S]
    pad = g.node("Cast", [C.ATTENTION_MASK], "mask/pad_bool", to=TensorProto.BOOL)
    pad = g.node("Unsqueeze", [pad, g.const([1, 2])], "mask/pad")  # [B, 1, 1, S]
    groups = config.num_key_value_groups
    windows = {config.sliding_window if config.is_sliding(i) else None for i in range(config.num_hidden_layers)}
    masks = {}
    for w in sorted(windows, key=lambda v: v or 0):
        m = causal
        if w is not None:  # keys inside the last w slots, the query's own included
            low = g.node("Sub", [q_slot, g.const(w)], f"mask/low_{w}")
            m = g.node("And", [m, g.node("Greater", [k_slot, low], f"mask/in_window_{w}")], f"mask/window_{w}")
        m = g.node("And", [pad, m], f"mask/full_{w}")  # [B, 1, T, S]
        masks[w] = g.node("Tile", [m, g.const([1, 1, groups, 1])], f"mask/groups_{w}")  # [B, 1, G*T, S]
    return masks


def embed(emit: BlockEmitter, model: CausalLM) -> tuple[str, PackedInits | None]:
    """Token embeddings [B, T, hidden]; a quantized tied table is shared with the LM head."""
    g, config, options = emit.g, emit.config, emit.options
    table = layer_weight(model.model.embed_tokens)  # a QuantizedWeight when the model quantized it
    packed = None
    if isinstance(table, QuantizedWeight) or (options.quantized and options.quantize_lm_head
                                               and not options.prequantized):
        packed = emit.linear.packed(table, "model.embed_tokens")
        bits = packed.weight.bits if isinstance(packed, WebInits) else packed.packed.bits
        if bits not in (4, 8):  # py_engine's quantizers keep the head (and tied table) at 4 or 8 bits
            raise ExportError(f"the embedding table is {packed.packed.bits}-bit; the graph gathers rows of 4- and "
                              "8-bit tables only")
        if isinstance(packed, WebInits):  # the same initializers as the LM head's MatMulNBits
            x = gather_rows(g, packed, C.INPUT_IDS, "model.embed_tokens")
            width = packed.weight.k_pad
        else:
            x = emit.linear.dequantize_rows(packed.B, packed, "model.embed_tokens", None, index=C.INPUT_IDS)
            width = rows_len(packed.packed)
        g.records["model.embed_tokens"] = {"weight": packed}
        if width != config.hidden_size:
            x = g.node("Slice", [x, g.const([0]), g.const([config.hidden_size]), g.const([-1])], "embed/trim")
    else:
        w = g.initializer("model.embed_tokens.weight", table.detach().float().numpy().astype(emit.linear.float_dtype))
        x = g.node("Gather", [w, C.INPUT_IDS], "model.embed_tokens/Gather", axis=0)
        g.records["model.embed_tokens"] = {"float": w}
        packed = w
    if config.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden), rounded to the activation dtype
        x = g.node("Mul", [x, g.const(config.embedding_multiplier, emit.linear.float_dtype)], "embed/scale")
    # A model whose quantizer replaced the tied head (a QuantLinear), or whose merged LoRA untied it
    # (py_engine.adapters.merge), has a head of its own.
    tied = (config.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear)
            and model.lm_head.weight is model.model.embed_tokens.weight)
    # a quantized table read through the head's own module (a GGUF's tied token_embd: QuantEmbedding(tied=True))
    tied = tied or (getattr(model.model.embed_tokens, "tied", False)
                    and getattr(model.model.embed_tokens, "rows", None) is model.lm_head)
    return x, packed if tied else None


def head(emit: BlockEmitter, model: CausalLM, hidden: str, tied) -> str:
    """Logits [B, T, V] float32, softcapped for Gemma 2."""
    g, config = emit.g, emit.config
    if isinstance(tied, (PackedInits, WebInits)):
        logits = emit.linear.nbits(hidden, tied, "lm_head")
        g.records["lm_head"] = {"tied": "model.embed_tokens"}
    elif isinstance(tied, str):  # float table [V, h]: Gemm with transB reads it in place
        flat = g.node("Reshape", [hidden, g.const([-1, config.hidden_size])], "lm_head/flat")
        logits = g.node("Gemm", [flat, tied], "lm_head/Gemm", transB=1)
        shape = g.node("Concat", [g.node("Slice", [g.node("Shape", [hidden], "lm_head/shape"), g.const([0]),
                                                   g.const([2])], "lm_head/lead"), g.const([config.vocab_size])],
                       "lm_head/out_shape", axis=0)
        logits = g.node("Reshape", [logits, shape], "lm_head/unflat")
        g.records["lm_head"] = {"tied": "model.embed_tokens"}
    else:
        logits = emit.linear(hidden, layer_weight(model.lm_head), None, "lm_head",
                             quantize=emit.options.quantize_lm_head)
    if emit.linear.float_dtype != np.float32:
        logits = g.node("Cast", [logits], "logits/float", to=TensorProto.FLOAT)
    cap = config.final_logit_softcapping
    if cap:
        c = g.const(cap, np.float32)
        logits = g.node("Mul", [g.node("Tanh", [g.node("Div", [logits, c], "logits/cap_div")], "logits/tanh"), c],
                        "logits/cap")
    return logits
