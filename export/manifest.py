"""Which graph file each runtime should load, written into `ruvllm_contract.json`.

An export folder can hold one graph per (precision, target): `ruvllm export`
writes the int4/int8 weights twice by default, as MatMulNBits kernels
(`onnx/model_q4.onnx`, the transformers.js name) and as packed bytes that
onnxruntime dequantizes once at session creation (`onnx/model_q4_web.onnx`),
because the fastest choice depends on the runtime (benchmarks/onnx_runtimes.py,
results in benchmarks/results/onnx_runtimes*.json; decode tok/s, 1 thread):

- onnxruntime-web (wasm): its MatMulNBits kernel is far slower than its float
  MatMul, so the web graph wins: 4x on tiny-shakespeare (41 vs 10.5), 7x on a
  123M-parameter model (4.9 vs 0.7), 6.5x on Qwen2.5-0.5B's shape (1.3 vs
  0.2), at the memory of float weights (paid once, at session start).
- onnxruntime (CPython), onnxruntime-node, onnxruntime-genai: MatMulNBits is
  fast and keeps the weights packed, so native wins (node, 123M: 65 vs 12;
  0.5B: 12.9 vs 3.5).

The contract file gains two keys (the rest of it is export.contract's):

    "files":    {"onnx/model_q4_web.onnx": {"precision": "int4", "target": "web",
                  "kv_dtype": "float32", "session_options": {"session.disable_quant_qdq": "1"},
                  "bytes": ..., ...}, ...}
    "runtimes": {"onnxruntime-web": {"default": "onnx/model_q4_web.onnx",
                  "int4": "onnx/model_q4_web.onnx", "fp32": "onnx/model.onnx"}, ...}

`files` lists every graph in the folder (merged across exports of the same
checkpoint) with the session config entries it needs (onnxruntime-web:
`sessionOptions.extra = {session: {disable_quant_qdq: "1"}}`; CPython:
`SessionOptions.add_session_config_entry`); `runtimes` maps each runtime and
precision to the file it should load, and `default` to the precision it
should pick when not told (the smallest download that runs fastest there).
Consumers read `runtimes`; the preference tables below are the measured
decision, kept as data. "onnxruntime-web" means its wasm backend: WebGPU,
whose fast 4-bit path is MatMulNBits, was not measured (no GPU here).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from py_engine.config import ModelConfig

from .options import FILE_NAMES, ExportOptions

# Targets in order of preference per runtime (first present wins).
TARGET_PREFERENCE: dict[str, tuple[str, ...]] = {
    "onnxruntime-web": ("web", "native", "plain"),
    "onnxruntime-node": ("native", "web", "plain"),
    "onnxruntime": ("native", "web", "plain"),
    "onnxruntime-genai": ("native", "web", "plain"),
}
# Largest folded float weights (bytes) a web graph may have for the runtime to be pointed at it:
# onnxruntime-web's wasm heap is at most 4 GiB and folding peaks near twice the folded size (the
# folded tensor and its copy into the session) plus the graph's bytes. Measured in Node: Qwen2.5-0.5B's
# shape (1.98 GB folded) loads at 4.4 GB peak RSS, at the ceiling; larger models get native instead.
FOLDED_LIMIT: dict[str, int] = {"onnxruntime-web": 2 << 30}
# Precisions in order of preference when the caller does not name one. int2 comes last: only a model quantized
# to 2 bits exports it, and 2 bits cost far more than 4 (GPTQ: +3.2% perplexity on the built-in model, +1013% on
# stories260K; README's Quantization), so a folder that also holds another precision does not hand it out unasked.
PRECISION_PREFERENCE: dict[str, tuple[str, ...]] = {
    "onnxruntime-web": ("int4", "int8", "fp32", "fp16", "int2"),
    "onnxruntime-node": ("int4", "int8", "fp32", "fp16", "int2"),
    "onnxruntime": ("int4", "int8", "fp32", "fp16", "int2"),
    "onnxruntime-genai": ("int4", "int8", "fp32", "fp16", "int2"),
}


# Session config entries a file needs to run as measured (export.web_weights: without it onnxruntime
# keeps the web graph's DequantizeLinear nodes and dequantizes every weight on every call).
WEB_SESSION_OPTIONS = {"session.disable_quant_qdq": "1"}


def session_options(options: ExportOptions) -> dict[str, str]:
    return dict(WEB_SESSION_OPTIONS) if options.quantized and options.target == "web" else {}


def folded_bytes(config: ModelConfig, options: ExportOptions) -> int | None:
    """Float32 bytes a web graph's weights take once onnxruntime has folded them (None: not a web graph).

    Every quantized weight becomes float32; the embedding table stays packed (GatherBlockQuantized).
    """
    if not (options.quantized and options.target == "web"):
        return None
    embed = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return 4 * (config.num_parameters() - embed)


def file_entry(options: ExportOptions, config: ModelConfig, kv_dtype: str, config_sha256: str,
               size: int) -> dict[str, Any]:
    return {"precision": options.precision, "target": options.target, "kv_dtype": kv_dtype,
            "block_size": options.block_size if options.quantized else None,
            "symmetric": options.symmetric if options.quantized else None,
            "session_options": session_options(options), "folded_bytes": folded_bytes(config, options),
            "config_sha256": config_sha256, "bytes": size}


def merged_files(out_dir: Path, new: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The files already recorded in out_dir (same checkpoint, still on disk) plus `new`."""
    sha = next(iter(new.values()))["config_sha256"]
    old = read_manifest(out_dir).get("files", {})
    kept = {k: v for k, v in old.items() if v.get("config_sha256") == sha and (out_dir / k).exists()}
    return dict(sorted({**kept, **new}.items()))


def fits(runtime: str, entry: dict[str, Any]) -> bool:
    """Whether the runtime can hold the graph once its weights are folded (wasm: a 4 GiB heap)."""
    limit = FOLDED_LIMIT.get(runtime)
    return limit is None or (entry.get("folded_bytes") or 0) <= limit


def runtime_files(files: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Per runtime: precision -> the file to load, and `default` -> the precision's file to pick."""
    out: dict[str, dict[str, str]] = {}
    for runtime, targets in TARGET_PREFERENCE.items():
        choice: dict[str, str] = {}
        for precision in FILE_NAMES:
            candidates = [(targets.index(e["target"]), path) for path, e in files.items()
                          if e["precision"] == precision and e["target"] in targets and fits(runtime, e)]
            if candidates:
                choice[precision] = min(candidates)[1]
        default = next((p for p in PRECISION_PREFERENCE[runtime] if p in choice), None)
        out[runtime] = ({"default": choice[default]} if default else {}) | choice
    return out


def read_manifest(out_dir: Path) -> dict[str, Any]:
    from .contract import CONTRACT_FILE

    path = out_dir / CONTRACT_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
