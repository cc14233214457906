"""Where the page's wasm kernels find each weight: the `engine` entry of a web graph in ruvllm_contract.json.

A web export's weights live in external data files beside its graph (export.web_weights). The page's own
decoder (web/kernels, C compiled to wasm SIMD128) runs Llama-family models without onnxruntime; it reads
the same bytes, so it only needs to know which initializer is which:

    "engine": {"format": 1, "files": ["model_q4_web.onnx_data"],           (beside the graph, in order)
               "config": {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "inter": 1536, ...},
               "tensors": {NAME: [file, offset, bytes, dtype, shape], ...},   (every initializer it reads)
               "embed": PROJ, "head": PROJ | "tied", "norm": NAME, "rope": {"cos": NAME, "sin": NAME},
               "layers": [{"attn_norm": NAME, "qkv": PROJ, "o": PROJ, "mlp_norm": NAME, "gate_up": PROJ,
                           "down": PROJ}, ...]}
    PROJ = {"codes": NAME, "scales": NAME, "mins": NAME | null, "bias": NAME | null, "bits": 4 | 8, "N", "K"}

A model the kernels do not run (`unsupported` says why: sliding windows, soft-capping, qk-norm, experts,
partial rotary, 2-bit or non-32 blocks, float projections...) gets no `engine`, and the page runs its graph
in onnxruntime-web instead.
"""
from __future__ import annotations

from typing import Any

from onnx import GraphProto, TensorProto

from py_engine.config import ModelConfig

from .web_weights import ENGINE_BLOCK, WebInits

FORMAT = 1
DTYPES = {TensorProto.UINT8: "uint8", TensorProto.FLOAT16: "float16", TensorProto.FLOAT: "float32"}


def unsupported(config: ModelConfig, records: dict[str, dict]) -> str | None:
    """Why the wasm kernels cannot run this graph, or None."""
    checks = [
        (config.model_type in ("llama", "qwen2", "mistral"), f"model type {config.model_type}"),
        (not any(config.is_sliding(i) for i in range(config.num_hidden_layers)), "sliding-window attention"),
        (not config.attn_logit_softcapping and not config.final_logit_softcapping, "logit soft-capping"),
        (not config.qk_norm, "qk-norm"), (not config.num_local_experts, "mixture of experts"),
        (config.hidden_act in ("silu", "swish"), f"activation {config.hidden_act}"),
        (config.rope_parameters.partial_rotary_factor == 1.0, "partial rotary"),
        (config.rope_parameters.rope_type not in ("longrope", "dynamic"), "length-dependent rope"),
        (config.embedding_multiplier == 1.0, "scaled embeddings"),
        (not config.o_proj_bias and not config.mlp_bias, "o/mlp biases"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    for name in _projection_names(config) + ["model.embed_tokens"]:
        w = records.get(name, {}).get("weight")
        if not isinstance(w, WebInits):
            return f"{name} is not a quantized web weight"
        if w.weight.bits not in (4, 8) or w.weight.block_size != ENGINE_BLOCK or w.weight.k_pad % ENGINE_BLOCK:
            return f"{name}: {w.weight.bits}-bit blocks of {w.weight.block_size} (the kernels take 4/8-bit blocks of 32)"
    head = records.get("lm_head", {})
    if "tied" not in head and not isinstance(head.get("weight"), WebInits):
        return "lm_head is not a quantized web weight"
    return None


def _projection_names(config: ModelConfig) -> list[str]:
    out = []
    for i in range(config.num_hidden_layers):
        out += [f"model.layers.{i}.self_attn/qkv_proj", f"model.layers.{i}.self_attn/o_proj",
                f"model.layers.{i}.mlp/gate_up_proj", f"model.layers.{i}.mlp/down_proj"]
    return out


def engine_entry(graph: GraphProto, records: dict[str, dict], config: ModelConfig) -> dict[str, Any]:
    """The contract's `engine` entry, or {"unsupported": why}."""
    why = unsupported(config, records)
    if why:
        return {"unsupported": why}
    places = _places(graph)
    used: set[str] = set()

    def name(init: str | None) -> str | None:
        if init is not None:
            if init not in places:
                raise ValueError(f"{init} is not in the external data (the web store keeps every weight there)")
            used.add(init)
        return init

    def proj(rec: dict) -> dict[str, Any]:
        w: WebInits = rec["weight"]
        return {"codes": name(w.codes), "scales": name(w.scales), "mins": name(w.mins), "bias": name(rec.get("bias")),
                "bits": w.weight.bits, "N": w.weight.N, "K": w.weight.k_pad}

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        layers.append({"attn_norm": name(records[f"{p}.input_layernorm"]["norm"]),
                       "qkv": proj(records[f"{p}.self_attn/qkv_proj"]), "o": proj(records[f"{p}.self_attn/o_proj"]),
                       "mlp_norm": name(records[f"{p}.post_attention_layernorm"]["norm"]),
                       "gate_up": proj(records[f"{p}.mlp/gate_up_proj"]), "down": proj(records[f"{p}.mlp/down_proj"])})
    head = records["lm_head"]
    rope = records["rope"]
    entry = {"format": FORMAT, "files": sorted({places[n][0] for n in places}, key=_file_order),
             "config": {"hidden": config.hidden_size, "heads": config.num_attention_heads,
                        "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                        "inter": config.intermediate_size, "layers": config.num_hidden_layers,
                        "vocab": config.vocab_size, "eps": config.rms_norm_eps, "scale": config.attention_scale,
                        "max_pos": config.max_position_embeddings},
             "embed": proj(records["model.embed_tokens"]), "head": "tied" if "tied" in head else proj(head),
             "norm": name(records["model.norm"]["norm"]), "rope": {"cos": name(rope["cos"]), "sin": name(rope["sin"])},
             "layers": layers}
    files = entry["files"]
    entry["tensors"] = {n: [files.index(places[n][0])] + list(places[n][1:]) for n in sorted(used)}
    return entry


def _file_order(name: str) -> tuple[int, str]:
    return (len(name), name)  # model.onnx_data, model.onnx_data_1, ...


def _places(graph: GraphProto) -> dict[str, tuple[str, int, int, str, list[int]]]:
    out = {}
    for t in graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        out[t.name] = (info["location"], int(info.get("offset", 0)), int(info["length"]),
                       DTYPES.get(t.data_type, str(t.data_type)), list(t.dims))
    return out
